"""The scheduler's own cost per step: ``schedule()`` + ``update_after_submission`` +
``update_from_output``, at a fixed number of running requests (``rlt bench --only
scheduler``, and ``scripts/bench_scheduler.py``).

Closed loop with WCPB on and a stand-in worker (decode rows exit at a random depth, coda
rows sample a fixed token), so only the scheduler's time is timed.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from messages.api import FinishedEvent
from messages.batch import BatchResult, RowKind, RowResult
from messages.sampling import SamplingParams
from services.common.config import ModelLimits, SchedulerConfig
from services.scheduler.core.batch import ScheduledBatch
from services.scheduler.core.scheduler import Scheduler

D = 4
LIMITS = ModelLimits(
    total_ut_steps=D, vocab_size=32000, max_position_embeddings=8192, eos_token_ids=(0,)
)
# the bar: at 256 running requests mean <= 250 us and p99 <= 500 us; at 1024 the p99
# within 4x the mean (no collector pauses, no O(n^2) scans)
TARGETS = {
    (256, "mean_us"): ("mean step <= 250 µs at 256 requests", None, 250.0),
    (256, "p99_us"): ("p99 step <= 500 µs at 256 requests", None, 500.0),
    (1024, "p99_over_mean"): ("p99 step <= 4x the mean at 1024 requests", None, 4.0),
}


def fake_result(batch: ScheduledBatch, rng: random.Random) -> BatchResult:
    rows = []
    for i, task in enumerate(batch.tasks):
        if task.kind is RowKind.DECODE:
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


def measure(concurrency: int, steps: int, seed: int = 0) -> dict[str, float]:
    """Steps of a closed loop at ``concurrency`` running requests; microseconds per step."""
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
    mean = statistics.fmean(timings) * 1e6
    p99 = timings[int(len(timings) * 0.99)] * 1e6
    return {
        "concurrency": concurrency,
        "steps": len(timings),
        "mean_us": mean,
        "p50_us": timings[len(timings) // 2] * 1e6,
        "p99_us": p99,
        "p99_over_mean": p99 / mean,
        "rows_per_step": statistics.fmean(rows),
        "us_per_row": mean / statistics.fmean(rows),
    }


def run_comparison(repeats: int, steps: int = 2000, seed: int = 0) -> dict[str, Any]:
    """A results entry shaped like the other comparisons' (runs, ratios with targets)."""
    runs = []
    for repeat in range(repeats):
        for concurrency in (256, 1024):
            runs.append(
                {"repeat": repeat, "concurrency": concurrency, **measure(concurrency, steps, seed)}
            )
    ratios = []
    for (concurrency, metric), (text, low, high) in TARGETS.items():
        per_repeat = [r[metric] for r in runs if r["concurrency"] == concurrency]
        median = statistics.median(per_repeat)
        reached = (low is None or median >= low) and (high is None or median <= high)
        ratios.append(
            {
                "workload": f"{concurrency} running",
                "metric": metric,
                "numerator": "scheduler",
                "denominator": None,
                "kind": "value",
                "label": text,
                "per_repeat": per_repeat,
                "min": min(per_repeat),
                "median": median,
                "max": max(per_repeat),
                "target": {"text": text, "low": low, "high": high},
                "reached": reached,
            }
        )
    return {
        "name": "scheduler",
        "kind": "microbench",
        "title": "Scheduler step",
        "question": (
            "What does one scheduler step (selection, submission-time and output-time "
            "progress) cost at 256 and 1024 running requests?"
        ),
        "notes": [
            f"{steps} steps per run, WCPB, a stand-in worker; wall time of schedule() + "
            "update_after_submission + update_from_output (the stand-in's time excluded).",
        ],
        "runs": runs,
        "ratios": ratios,
    }


def markdown(c: dict[str, Any]) -> list[str]:
    """The comparison's section of report.md."""
    lines = [f"## {c['title']}", "", c["question"], "", *(f"- {n}" for n in c["notes"]), ""]
    header = ["repeat", "running", "steps", "mean µs", "p50 µs", "p99 µs", "p99/mean", "µs/row"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in c["runs"]:
        lines.append(
            f"| {r['repeat']} | {r['concurrency']} | {r['steps']} | {r['mean_us']:.0f} | "
            f"{r['p50_us']:.0f} | {r['p99_us']:.0f} | {r['p99_over_mean']:.2f} | "
            f"{r['us_per_row']:.2f} |"
        )
    lines.append("")
    return lines
