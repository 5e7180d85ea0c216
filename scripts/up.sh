#!/usr/bin/env bash
# The run command: set up if needed, then embedded NATS + all services on the toy checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/rlt up "$@"
