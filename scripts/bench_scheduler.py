"""Benchmark: cost of schedule() + update_after_submission + update_from_output per step.

Closed loop at a fixed concurrency with WCPB on and a stand-in worker (decode rows exit at a
random depth, coda rows sample a fixed token), so only scheduler time is measured.

    .venv/bin/python scripts/bench_scheduler.py [--steps 2000] [--concurrency 16 64 256]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from messages.api import FinishedEvent
from messages.batch import BatchResult, RowKind, RowResult
from messages.sampling import SamplingParams
from services.common.config import ModelLimits, SchedulerConfig
from services.scheduler.batch import ScheduledBatch
from services.scheduler.scheduler import Scheduler

D = 4
LIMITS = ModelLimits(
    total_ut_steps=D, vocab_size=32000, max_position_embeddings=8192, eos_token_ids=(0,)
)


def fake_result(batch: ScheduledBatch, rng: random.Random) -> BatchResult:
    rows = []
    for i, task in enumerate(batch.tasks):
        if task.kind == RowKind.DECODE:
            exits = task.depth + 1 >= D or rng.random() < 0.4
            rows.append(
                RowResult(
                    row_index=i,
                    exited=exits,
                    exit_loops=task.depth + 1,
                    remaining=0.5,
                    token_id=rng.randrange(1, 32000),
                )
            )
        else:
            rows.append(RowResult(row_index=i, token_id=5 if task.compute_logits else -1))
    return BatchResult(seq=batch.seq, rows=rows)


def run(concurrency: int, steps: int, seed: int = 0) -> dict[str, float]:
    rng = random.Random(seed)
    config = SchedulerConfig(
        max_num_seqs=concurrency,
        max_num_batched_tokens=4096,
        prefill_chunk_size=64,
        wavefront_chunked_prefill=True,
        block_size=16,
        num_blocks=concurrency * 64 * D,
        refill=True,
    )
    s = Scheduler(config, LIMITS)
    counter = 0

    def add() -> None:
        nonlocal counter
        prompt = [rng.randrange(1, 32000) for _ in range(rng.randint(32, 256))]
        s.add_request(
            f"r{counter}",
            prompt,
            SamplingParams(max_tokens=rng.randint(16, 128), temperature=0.0, ignore_eos=True),
        )
        counter += 1

    for _ in range(concurrency):
        add()
    timings: list[float] = []
    rows: list[int] = []
    for _ in range(steps):
        t0 = time.perf_counter()
        batch = s.schedule()
        if batch is None:
            break
        s.update_after_submission(batch)
        t1 = time.perf_counter()
        result = fake_result(batch, rng)  # the worker's time is not the scheduler's
        t2 = time.perf_counter()
        events = s.update_from_output(batch, result)
        t3 = time.perf_counter()
        timings.append((t1 - t0) + (t3 - t2))
        rows.append(len(batch.tasks))
        for event in events:
            if isinstance(event, FinishedEvent):
                add()
    timings.sort()
    return {
        "concurrency": concurrency,
        "steps": len(timings),
        "mean_us": statistics.fmean(timings) * 1e6,
        "p50_us": timings[len(timings) // 2] * 1e6,
        "p99_us": timings[int(len(timings) * 0.99)] * 1e6,
        "rows_per_step": statistics.fmean(rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64, 256])
    args = parser.parse_args()
    results = [run(c, args.steps) for c in args.concurrency]
    print("| concurrency | steps | mean µs/step | p50 µs | p99 µs | rows/step | µs/row |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['concurrency']} | {r['steps']} | {r['mean_us']:.0f} | {r['p50_us']:.0f} | "
            f"{r['p99_us']:.0f} | {r['rows_per_step']:.1f} | "
            f"{r['mean_us'] / r['rows_per_step']:.2f} |"
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
