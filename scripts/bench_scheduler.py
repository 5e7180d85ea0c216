"""Benchmark: cost of schedule() + update_after_submission + update_from_output per step.

Closed loop at a fixed concurrency with WCPB on and a stand-in worker (decode rows exit at a
random depth, coda rows sample a fixed token), so only scheduler time is measured. The same
measurement, with its targets, is `rlt bench --only scheduler`.

    .venv/bin/python scripts/bench_scheduler.py [--steps 2000] [--concurrency 16 64 256 1024]
"""

from __future__ import annotations

import argparse

from services.bench.comparisons.scheduler_step import measure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64, 256, 1024])
    args = parser.parse_args()
    results = [measure(c, args.steps) for c in args.concurrency]
    print(
        "| concurrency | steps | mean µs/step | p50 µs | p99 µs | p99/mean | rows/step | µs/row |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['concurrency']} | {r['steps']} | {r['mean_us']:.0f} | {r['p50_us']:.0f} | "
            f"{r['p99_us']:.0f} | {r['p99_over_mean']:.2f} | {r['rows_per_step']:.1f} | "
            f"{r['us_per_row']:.2f} |"
        )
    base = results[0]
    for r in results[1:]:
        growth = r["mean_us"] / base["mean_us"]
        scale = r["concurrency"] / base["concurrency"]
        print(
            f"growth {base['concurrency']}->{r['concurrency']}: x{growth:.2f} "
            f"(linear would be x{scale:.0f})"
        )


if __name__ == "__main__":
    main()
