"""Helpers shared by test modules (no test module imports another)."""

from __future__ import annotations

from messages.api import StreamEvent
from messages.batch import BatchResult, RowKind, RowResult
from messages.internal import WorkerBatch, WorkerResult
from services.scheduler.batch import ScheduledBatch
from services.scheduler.step_output import StepOutput
from services.worker.runner import ModelRunner


def run_on(runner: ModelRunner, wb: WorkerBatch) -> WorkerResult:
    """What a worker service answers for ``wb``: the batch run on ``runner``."""
    return WorkerResult(epoch=wb.epoch, result=runner.execute(wb.batch), worker_id=wb.worker_id)


def fake_result(batch: ScheduledBatch, token: int = 7) -> BatchResult:
    """A worker stand-in: decode rows exit after their first loop, coda rows sample `token`."""
    rows = []
    for i, task in enumerate(batch.tasks):
        if task.kind == RowKind.DECODE:
            rows.append(
                RowResult(
                    row_index=i,
                    exited=True,
                    exit_loops=task.depth + 1,
                    token_id=token,
                    remaining=0.5,
                )
            )
        else:
            rows.append(RowResult(row_index=i, token_id=token if task.compute_logits else -1))
    return BatchResult(seq=batch.seq, rows=rows)


def relayed_events(out: StepOutput) -> list[StreamEvent]:
    """The stream events a scheduler driver's output relays to admission (a resync, which
    carries the outputs so far, has none)."""
    return [r.item.event for r in out.relays if r.item.event is not None]
