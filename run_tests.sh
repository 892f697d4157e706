#!/usr/bin/env bash
# Install (first call only) and run the test suite: ./run_tests.sh [pytest args]
# Set LOGRA_DATA_DIR to the GSM8K/MATH-500 JSONL folder (CI: ../shared/data).
# Tests run in LOGRA_TEST_WORKERS pytest-xdist processes (default 2; `auto`: one per core; 0: in this
# process), each test file whole on one worker (its module fixtures built once); `-n N` overrides.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/bootstrap.sh
exec python -m pytest -n "${LOGRA_TEST_WORKERS:-2}" --dist loadfile "$@"
