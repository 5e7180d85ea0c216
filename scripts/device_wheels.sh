#!/usr/bin/env bash
# The Python wheels a lent GPU machine lacks for the device check, fetched here in one command
# and installed there in one command (the machine has no network).
#
#   bash scripts/device_wheels.sh fetch     # here: into .whl/ (git-ignored), ~110 MB
#   bash scripts/device_wheels.sh install   # there: into /tmp/site ($SITE); prints the PYTHONPATH
#
# .whl/core       msgspec, structlog: the engine imports them (the GPU image has neither)
# .whl/flash      flash-attn 4 and its small needs (the image has torch, einops, typing-ext.)
# .whl/cutlass-1  the first and second halves of nvidia-cutlass-dsl-libs-cu12 (92 MB): one
# .whl/cutlass-2  call carries at most 64 MiB, so the halves travel in two calls
#
# `install` installs whatever has arrived: core always; flash-attn 4 only once both halves
# of the CuTe DSL library are there (they are joined first). docs/gpu.md has the two calls.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHL="${WHL:-$ROOT/.whl}"
PYTHON="${PYTHON:-python3}"
CORE=(msgspec==0.23.0 structlog==26.1.0)
FLASH=(
  flash-attn-4==4.0.0b40
  quack-kernels==0.6.5
  nvidia-cutlass-dsl==4.8.1
  nvidia-cutlass-dsl-libs-base==4.8.1
  nvidia-cutlass-dsl-libs-core==4.8.1
  apache-tvm-ffi==0.1.15.post2
  torch-c-dlpack-ext==0.1.5
)
BIG=nvidia-cutlass-dsl-libs-cu12==4.8.1
HALF=46000000  # bytes per half: each well under a call's 64 MiB with .whl/core and .whl/flash

download() {  # the GPU image: CPython 3.12 on x86-64 Linux
  "$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -q -d "$@"
}

fetch() {
  rm -rf "$WHL/core" "$WHL/flash" "$WHL/cutlass-1" "$WHL/cutlass-2" "$WHL/big"
  mkdir -p "$WHL/core" "$WHL/flash" "$WHL/cutlass-1" "$WHL/cutlass-2" "$WHL/big"
  download "$WHL/core" "${CORE[@]}"
  download "$WHL/flash" "${FLASH[@]}"
  download "$WHL/big" "$BIG"
  local wheel
  wheel="$(ls "$WHL/big"/*.whl)"
  split -b "$HALF" -d "$wheel" "$WHL/big/part-"
  mv "$WHL/big/part-00" "$WHL/cutlass-1/$(basename "$wheel").part-00"
  mv "$WHL/big/part-01" "$WHL/cutlass-2/$(basename "$wheel").part-01"
  if ls "$WHL/big"/part-* >/dev/null 2>&1; then
    echo "the wheel split into more than two halves: raise HALF" >&2
    exit 1
  fi
  rm -rf "$WHL/big"
  du -sh "$WHL"/*
}

install() {
  local site=${SITE:-/tmp/site} wheels=("$WHL"/core/*.whl)
  local first=("$WHL"/cutlass-1/*.part-00) second=("$WHL"/cutlass-2/*.part-01)
  if [[ -e "${first[0]}" && -e "${second[0]}" ]]; then
    local name
    name="$(basename "${first[0]}" .part-00)"
    mkdir -p /tmp/joined
    cat "${first[0]}" "${second[0]}" >"/tmp/joined/$name"
    wheels+=("$WHL"/flash/*.whl "/tmp/joined/$name")
  else
    echo "flash-attn 4 not installed: the CuTe DSL library has not arrived in both halves" >&2
  fi
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "${wheels[@]}"
  # the CuTe DSL's packages sit under nvidia_cutlass_dsl/dsl_packages, put on sys.path by a
  # .pth file that only a site directory runs, never a PYTHONPATH entry: name it too
  if [[ -d "$site/nvidia_cutlass_dsl/dsl_packages" ]]; then
    echo "$site:$site/nvidia_cutlass_dsl/dsl_packages"
  else
    echo "$site"
  fi
}

case "${1:-}" in
  fetch) fetch ;;
  install) install ;;
  *)
    echo "usage: $0 fetch|install" >&2
    exit 2
    ;;
esac
