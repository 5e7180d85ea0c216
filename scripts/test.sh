#!/usr/bin/env bash
# The test command: set up if needed, lint (ruff, import layering), then the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/lint-imports --no-logo  # the layering contracts in pyproject.toml
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} .venv/bin/pytest "$@"
