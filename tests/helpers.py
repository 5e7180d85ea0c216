"""Helpers shared by test modules (no test module imports another)."""

from __future__ import annotations

from messages.internal import WorkerBatch, WorkerResult
from services.worker.runner import ModelRunner


def run_on(runner: ModelRunner, wb: WorkerBatch) -> WorkerResult:
    """What a worker service answers for ``wb``: the batch run on ``runner``."""
    return WorkerResult(epoch=wb.epoch, result=runner.execute(wb.batch), worker_id=wb.worker_id)
