#!/usr/bin/env bash
# The run command: set up if needed, then embedded NATS + all services, serving the trained
# checkpoint shipped in checkpoints/looped-stdlib (a --checkpoint DIR of yours replaces it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
shipped=(--checkpoint checkpoints/looped-stdlib)
for arg in "$@"; do
  case "$arg" in --checkpoint|--checkpoint=*) shipped=() ;; esac
done
exec .venv/bin/rlt up "${shipped[@]}" "$@"
