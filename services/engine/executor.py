"""The in-process executor: batches run on a ``ModelRunner`` in this process (or, for the
bench only, on the simulated device's ``SimRunner``).

A submitted batch runs when the core next asks for results, one batch per step, in seq
order: as on a real device, the batches after it are still in flight while the core
schedules the next one, so async scheduling is exercised exactly as over the bus.
"""

from __future__ import annotations

from collections import deque

from messages.batch import BatchResult
from services.scheduler.core.batch import ScheduledBatch
from services.worker.runner import ModelRunner
from services.worker.sim import SimRunner


class InProcessExecutor:
    def __init__(self, runner: ModelRunner | SimRunner) -> None:
        self.runner = runner
        self._queued: deque[ScheduledBatch] = deque()

    def submit(self, batch: ScheduledBatch) -> None:
        self._queued.append(batch)

    def take_results(self) -> list[BatchResult]:
        if not self._queued:
            return []
        batch = self._queued.popleft()
        try:
            return [self.runner.execute(batch.wire)]
        except Exception as exc:  # a failed batch ends its requests, never the engine
            return [BatchResult(seq=batch.seq, error=f"{type(exc).__name__}: {exc}")]
