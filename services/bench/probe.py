"""Counts what the model runner does, without touching the runner's code.

The probe shadows two bound methods with instance attributes for the duration of a run:
``ModelRunner.execute`` (batches, decode batches, time executing) and ``OuroModel.core_loop``
(core passes and the rows in each). Both are called by attribute lookup, so the same probe
works for the in-process engine and for the pipeline's worker service.
"""

from __future__ import annotations

import time
from typing import Any

from messages.batch import Batch, BatchResult, Phase, RowKind
from services.bench.metrics import EngineCounters
from services.worker.runner import ModelRunner


class RunnerProbe:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.model = runner.model
        self.counters = EngineCounters()
        self._passes_at_start = runner.num_core_passes

    def __enter__(self) -> RunnerProbe:
        execute = self.runner.execute
        core_loop = self.model.core_loop
        c = self.counters

        def counted_execute(batch: Batch) -> BatchResult:
            t0 = time.perf_counter()
            try:
                return execute(batch)
            finally:
                c.execute_s += time.perf_counter() - t0
                c.batches += 1
                # a follow-on row (async) is a decode row the worker resolves
                if batch.phase == Phase.RECURRENT and any(
                    r.kind is RowKind.DECODE or r.kind is RowKind.FOLLOW_ON for r in batch.rows
                ):
                    c.decode_batches += 1

        def counted_core_loop(hidden: Any, *args: Any, **kwargs: Any) -> Any:
            c.core_passes += 1
            c.core_rows += int(hidden.shape[0])
            return core_loop(hidden, *args, **kwargs)

        self.runner.execute = counted_execute  # type: ignore[method-assign]
        self.model.core_loop = counted_core_loop  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        # dropping the instance attributes uncovers the class's methods again
        self.runner.__dict__.pop("execute", None)
        self.model.__dict__.pop("core_loop", None)
        self.counters.runner_core_passes = self.runner.num_core_passes - self._passes_at_start
