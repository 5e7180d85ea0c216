"""Counts what the model runner does, without touching the runner's code.

``StatsProbe`` reads a runner's own ``RunnerStats`` instead: for the simulated device, which
has no model to shadow, and (``counters_between``) for a worker process's health reply.

The probe shadows ``ModelRunner.execute`` with an instance attribute for the duration of a
run (batches, decode batches, time executing; called by attribute lookup, so the same probe
works for the in-process engine and for the pipeline's worker service), and reads core
passes and their rows from the runner's own stats (a replayed CUDA graph calls no Python).
"""

from __future__ import annotations

import time

from messages.batch import Batch, BatchKind, BatchResult, RowKind
from services.bench.metrics import EngineCounters
from services.worker.runner import ModelRunner
from services.worker.sim import SimRunner


class RunnerProbe:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.model = runner.model
        self.counters = EngineCounters()
        self._passes_at_start = runner.num_core_passes
        self._rows_at_start = runner.stats.core_rows

    def __enter__(self) -> RunnerProbe:
        execute = self.runner.execute
        c = self.counters

        def counted_execute(batch: Batch) -> BatchResult:
            t0 = time.perf_counter()
            try:
                return execute(batch)
            finally:
                c.execute_s += time.perf_counter() - t0
                c.batches += 1
                # a follow-on row (async) is a decode row the worker resolves
                if batch.kind == BatchKind.RECURRENT and any(
                    r.kind in (RowKind.DECODE, RowKind.FOLLOW_ON, RowKind.SPECULATIVE)
                    for r in batch.rows
                ):
                    c.decode_batches += 1

        self.runner.execute = counted_execute  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        # dropping the instance attributes uncovers the class's methods again
        self.runner.__dict__.pop("execute", None)
        passes = self.runner.num_core_passes - self._passes_at_start
        self.counters.core_passes = passes
        self.counters.core_rows = self.runner.stats.core_rows - self._rows_at_start
        self.counters.runner_core_passes = passes


class StatsProbe:
    """The counters of a run, from the runner's ``RunnerStats`` before and after it."""

    def __init__(self, runner: ModelRunner | SimRunner) -> None:
        self.runner = runner
        self.counters = EngineCounters()
        self._before: dict[str, float] = {}

    def __enter__(self) -> StatsProbe:
        self._before = self.runner.stats.snapshot()
        return self

    def __exit__(self, *exc: object) -> None:
        self.counters = counters_between(self._before, self.runner.stats.snapshot())


def counters_between(before: dict[str, float], after: dict[str, float]) -> EngineCounters:
    """What a worker process did between two ``RunnerStats`` snapshots."""
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    return EngineCounters(
        batches=int(delta.get("batches", 0)),
        decode_batches=int(delta.get("decode_batches", 0)),
        execute_s=float(delta.get("execute_s", 0.0)),
        core_passes=int(delta.get("core_passes", 0)),
        core_rows=int(delta.get("core_rows", 0)),
        runner_core_passes=int(delta.get("core_passes", 0)),
    )
