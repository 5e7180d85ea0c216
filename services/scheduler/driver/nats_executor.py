"""The executor over NATS: batches go to ONE bound worker service, results come back.

Pure bookkeeping (no NATS calls here): ``submit`` wraps a batch for the bound worker and
queues it in ``outbox`` for the service to publish; the service hands worker results to
``deliver``, which keeps only those of this epoch from the bound worker. An epoch is new for
every scheduler incarnation and after every worker loss: the worker resets its mirrored
state when it sees one, and results of older epochs are ignored, so nothing is applied
twice.
"""

from __future__ import annotations

import time

from messages.batch import BatchResult
from messages.internal import WorkerBatch, WorkerResult
from services.common.config import SchedulerConfig
from services.scheduler.core.batch import ScheduledBatch


class NatsExecutor:
    def __init__(self, config: SchedulerConfig, instance: str) -> None:
        self.config = config
        self.instance = instance
        self.epoch_number = -1
        self.new_epoch()

    def new_epoch(self) -> None:
        """A fresh epoch towards the worker; nothing of the old one is kept."""
        self.epoch_number += 1
        self.epoch = f"{self.instance}.{self.epoch_number}"
        self.worker_id: str | None = None  # the worker this epoch's batches go to
        self.epoch_start_seq: int | None = None  # seq of this epoch's first batch
        self.sent_at: dict[int, float] = {}
        self.outbox: list[WorkerBatch] = []
        self._inbox: list[BatchResult] = []

    @property
    def has_sent(self) -> bool:
        """Whether this epoch's worker already holds state (a batch went to it)."""
        return self.epoch_start_seq is not None

    def submit(self, batch: ScheduledBatch) -> None:
        assert self.worker_id is not None, "submit without a bound worker"
        if self.epoch_start_seq is None:
            self.epoch_start_seq = batch.seq
        self.sent_at[batch.seq] = time.monotonic()
        cfg = self.config
        self.outbox.append(
            WorkerBatch(
                epoch=self.epoch,
                batch=batch.wire,
                num_blocks=cfg.num_blocks,
                block_size=cfg.block_size,
                kv_layout=str(cfg.kv_layout),
                epoch_start_seq=self.epoch_start_seq,
                worker_id=self.worker_id,
            )
        )

    def take_outbox(self) -> list[WorkerBatch]:
        out, self.outbox = self.outbox, []
        return out

    def deliver(self, wr: WorkerResult) -> bool:
        """Keeps a result of this epoch from the bound worker; False if it is not one."""
        if wr.epoch != self.epoch or wr.worker_id != self.worker_id:
            return False
        self.sent_at.pop(wr.result.seq, None)
        self._inbox.append(wr.result)
        return True

    def take_results(self) -> list[BatchResult]:
        out, self._inbox = self._inbox, []
        return out

    def age_of(self, seq: int | None, now: float) -> float:
        """How long ago batch ``seq`` was sent (0 for none)."""
        if seq is None:
            return 0.0
        return now - self.sent_at.get(seq, now)
