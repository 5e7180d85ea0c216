"""Micro-benchmark: query-length bucketing in the attention metadata and kernels.

µs per ``build_attention_metadata`` and per attention call (reference ``paged_attention`` and
the SDPA backend), bucketed vs one full padded grid (``bucketed=False``, the old behaviour),
on the ``small`` toy dims (8 heads, 4 kv heads, head_dim 32, block_size 16, float32):

* mixed: 32 decode rows with ~200-token contexts + one 64-token prefill chunk
* decode: 32 decode rows with ~200-token contexts
* prefill: 2 x 64-token prefill chunks from position 0

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_attention.py [--iters 200]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch

from kernels.paged_attention import Segment, build_attention_metadata, paged_attention
from kernels.sdpa_attention import build_sdpa_state, sdpa_paged_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 4, 32, 16
SCALE = HEAD_DIM**-0.5


def layout(name: str, rng: random.Random) -> list[tuple[int, int]]:
    """(num_rows, pos_start) per segment, in row order."""
    decode = [(1, rng.randint(180, 220)) for _ in range(32)]
    if name == "mixed":
        return [*decode, (64, 0)]
    if name == "decode":
        return decode
    if name == "prefill":
        return [(64, 0), (64, 0)]
    raise ValueError(name)


def make_segments(spec: list[tuple[int, int]]) -> tuple[list[Segment], int]:
    segments, row, next_block = [], 0, 0
    for n, p in spec:
        nb = -(-(p + n) // BLOCK)
        segments.append(Segment(row, n, p, list(range(next_block, next_block + nb))))
        row += n
        next_block += nb
    return segments, row


def time_us(fn: Callable[[], object], iters: int, repeats: int = 5) -> float:
    """Median over ``repeats`` of the mean µs per call over ``iters`` calls."""
    for _ in range(max(3, iters // 10)):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(samples)


def bench_case(name: str, iters: int) -> dict[str, float]:
    segments, rows = make_segments(layout(name, random.Random(0)))
    num_blocks = sum(len(s.block_table) for s in segments) + 1
    gen = torch.Generator().manual_seed(0)
    kc = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    vc = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=gen)
    res: dict[str, float] = {}
    outs = {}
    for tag, bucketed in (("before", False), ("after", True)):
        meta = build_attention_metadata(segments, BLOCK, rows, bucketed=bucketed)
        state = build_sdpa_state(meta)
        res[f"buckets_{tag}"] = len(meta.buckets)
        res[f"build_{tag}"] = time_us(
            lambda b=bucketed: build_attention_metadata(segments, BLOCK, rows, bucketed=b), iters
        )
        res[f"ref_{tag}"] = time_us(lambda m=meta: paged_attention(q, kc, vc, m, SCALE), iters)
        res[f"sdpa_{tag}"] = time_us(
            lambda m=meta, s=state: sdpa_paged_attention(q, kc, vc, m, SCALE, s), iters
        )
        outs[tag] = paged_attention(q, kc, vc, meta, SCALE)
    res["max_abs_diff"] = float((outs["before"] - outs["after"]).abs().max())
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, µs per call")
    print(
        "| case | buckets | build before | build after | reference before | reference after "
        "| sdpa before | sdpa after | max |Δ| |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in ("mixed", "decode", "prefill"):
        r = bench_case(name, args.iters)
        print(
            f"| {name} | {r['buckets_before']:.0f} → {r['buckets_after']:.0f} "
            f"| {r['build_before']:.0f} | {r['build_after']:.0f} "
            f"| {r['ref_before']:.0f} | {r['ref_after']:.0f} "
            f"| {r['sdpa_before']:.0f} | {r['sdpa_after']:.0f} | {r['max_abs_diff']:.1e} |"
        )


if __name__ == "__main__":
    main()
