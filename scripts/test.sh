#!/usr/bin/env bash
# The test command: set up if needed, lint, then the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} .venv/bin/pytest "$@"
