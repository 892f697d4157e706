#!/usr/bin/env bash
# Install (first call only) and run the default profile: a short dense GRPO run of the embedded
# SmolLM2-135M-Instruct on arithmetic, on CPU. Usage: ./run_all.sh [key=value overrides]
# (Sweeps, profiles and the analysis step are added by experiments.launch.)
set -euo pipefail
cd "$(dirname "$0")"
source scripts/bootstrap.sh
# GSM8K/MATH-500 come from LOGRA_DATA_DIR; default to ../shared/data beside the repo when present.
if [ -z "${LOGRA_DATA_DIR:-}" ] && [ -d ../shared/data ]; then export LOGRA_DATA_DIR="$(cd ../shared/data && pwd)"; fi
python -m experiments.train config=quick "$@"
