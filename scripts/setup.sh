#!/usr/bin/env bash
# Creates .venv and installs rlt with its dev extras from this repo's own files.
# Without a GPU, torch is pinned to the CPU build first so pip never pulls a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip 2>/dev/null || true
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    .venv/bin/pip install -q torch
  else
    .venv/bin/pip install -q "${RLT_TORCH_SPEC:-torch==2.13.0}"
  fi
fi
.venv/bin/pip install -q -e '.[dev]'
# FlashLoop's reference (tests/test_sparse_prefill_reference.py): its flashloop_torch imports
# only torch, but the package pins an older transformers, hence --no-deps
.venv/bin/pip install -q --no-deps flashloop==0.1.0
