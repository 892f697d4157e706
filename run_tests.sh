#!/usr/bin/env bash
# Install (first call only) and run the test suite: ./run_tests.sh [pytest args]
# Set LOGRA_DATA_DIR to the GSM8K/MATH-500 JSONL folder (CI: ../shared/data).
set -euo pipefail
cd "$(dirname "$0")"
source scripts/bootstrap.sh
exec python -m pytest "$@"
