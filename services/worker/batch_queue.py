"""A worker's batches on their way to the job runner, and their results on the way back.

A batch that arrives before its predecessors waits here; batches go to the job runner
(``compute.py``) strictly in seq order, each behind a fresh runner when a new epoch or KV
geometry asks for one (``runner_host.py``), and on the event loop when expected short. A
KV geometry the device cannot hold fails its batch, answered in seq order. What a batch
returned lands in ``results`` for the service to publish; a batch of an epoch that ended
meanwhile is dropped. No NATS here: the service feeds it and publishes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from messages.batch import Batch, BatchResult
from messages.internal import WorkerBatch
from services.worker.compute import ExecuteTimeEstimate, JobRunner
from services.worker.runner_host import RunnerHost

Geometry = tuple[int, int, str]  # (num_blocks, block_size, kv_layout)


@dataclass
class BatchRun:
    """One batch on its way through the compute thread."""

    wb: WorkerBatch
    reply: str
    arrived: float  # perf_counter when it was received
    passes: list[tuple[int, int]] | None = None  # (rows, tokens) per core pass, once run
    token_loops: int = 0  # sum over rows of tokens x loops: what its time scales with


@dataclass
class _Reset:
    """A fresh ModelRunner (new epoch or KV geometry) before the next batch runs."""

    geometry: Geometry


class BatchQueue:
    """Batches onto the one job runner in seq order, with the runner resets they need."""

    def __init__(
        self,
        runner_host: RunnerHost,
        inline_max_s: float,
        log: Any,
        before_execute: Callable[[Any, WorkerBatch], None] | None = None,
    ) -> None:
        """``inline_max_s``: batches expected to run under this run on the event loop (0:
        never); ``log``: the service's logger; ``before_execute(runner, batch)``: called
        just before a batch runs, every earlier batch done (it starts the batch's KV
        pulls)."""
        self.runner_host = runner_host
        self.before_execute = before_execute
        self.inline_max_s = inline_max_s
        self.log = log
        self.execute_time = ExecuteTimeEstimate()
        self.compute: JobRunner | None = None
        self.epoch: str | None = None
        self.next_submit = 0  # next seq to queue for the job runner
        self.pending: dict[int, BatchRun] = {}  # arrived early: waits for its predecessors
        self.results: asyncio.Queue[tuple[BatchRun, BatchResult, float]] = asyncio.Queue()
        self._geometry: Geometry = (0, 0, "")
        self._last_reset: _Reset | None = None  # the newest reset queued
        self._needs_reset = False
        self._runner_fresh = True  # no batch queued since the runner was (re)built
        self.num_inline_batches = 0  # batches that ran on the event loop (compute.py)

    def start(self, geometry: Geometry, name: str) -> None:
        """Once the first runner is built for ``geometry``; on the event loop."""
        # set here and when a reset is queued, never by the reset itself: a reset finishing
        # on the thread must not undo the geometry of one queued after it
        self._geometry = geometry
        self.compute = JobRunner(asyncio.get_running_loop(), self._computed, name=name)
        self.compute.start()

    def stop(self) -> None:
        """Stops the compute thread (blocking: call it off the event loop)."""
        if self.compute is not None:
            self.compute.stop()

    @property
    def idle(self) -> bool:
        return self.compute is None or self.compute.idle

    @property
    def busy_since(self) -> float:
        """Monotonic start of the job running now; 0 when idle."""
        return self.compute.running_since if self.compute is not None else 0.0

    @property
    def queued(self) -> int:
        return self.compute.queued if self.compute is not None else 0

    @property
    def missing_seq(self) -> int:
        """The batch this idle queue waits for (-1 when busy or waiting for nothing)."""
        waiting = self.idle and self.epoch is not None and self.next_submit not in self.pending
        return self.next_submit if waiting else -1

    def new_epoch(self, epoch: str, first_seq: int) -> None:
        """The device state starts over at ``first_seq``: what is buffered is dropped, jobs
        of the old epoch still queued are skipped, and a fresh runner comes first."""
        self.epoch = epoch
        self.next_submit = first_seq
        self.pending.clear()
        self._needs_reset = True

    def is_duplicate(self, seq: int) -> bool:
        return seq < self.next_submit or seq in self.pending

    def add(self, run: BatchRun) -> None:
        self.pending[run.wb.batch.seq] = run
        self.release()

    def release(self) -> None:
        """Queues, in seq order, every batch whose predecessors are queued: the job runner
        then runs them back to back."""
        assert self.compute is not None
        while (run := self.pending.pop(self.next_submit, None)) is not None:
            self.next_submit += 1
            geometry = self._geometry_of(run.wb)
            # whether the runner the next job will find has run a batch: known here, in
            # queue order (the runner itself may be mid-batch on the thread)
            used = not self._runner_fresh
            if (self._needs_reset and used) or geometry != self._geometry:
                try:
                    self.runner_host.check_geometry(*geometry)
                except Exception as exc:  # refused: this batch fails, the worker goes on
                    # answered in seq order, behind the batches queued before it
                    refusal = BatchResult(seq=run.wb.batch.seq, error=_describe(exc))
                    self.compute.submit(run, lambda r=refusal: r, inline=True)
                    continue
                self._geometry = geometry  # what the queued reset will build
                reset = self._last_reset = _Reset(geometry)
                self.compute.submit(
                    reset, lambda r=reset: self.runner_host.make_runner(*r.geometry)
                )
            self._needs_reset = False
            self._runner_fresh = False
            if self.inline_max_s > 0:  # only the inline choice reads the estimate
                run.token_loops = _token_loops(run.wb.batch)
            inline = self._inline(run)
            self.num_inline_batches += inline
            self.compute.submit(run, lambda r=run: self._execute(r), inline=inline)

    def _inline(self, run: BatchRun) -> bool:
        """Whether the batch may run on the event loop: expected to be short (unknown until
        a few batches ran on the thread), and not one that may wait for a grammar to
        compile (seconds, with xgrammar's import: no heartbeat would go out meanwhile)."""
        if self.inline_max_s <= 0:
            return False
        batch = run.wb.batch
        if any(new.sampling.structured_output is not None for new in batch.new_requests):
            return False
        grammars = self.runner_host.grammars
        if grammars is not None and grammars.compiling:
            return False
        expected = self.execute_time.estimate(run.token_loops)
        return expected is not None and expected <= self.inline_max_s

    def _execute(self, run: BatchRun) -> BatchResult | None:
        """On the compute thread or the loop. None: the batch's epoch is over, nothing ran."""
        if run.wb.epoch != self.epoch:
            return None
        runner = self.runner_host.runner
        if runner is None:  # its KV reset failed (logged): the next batch retries it
            return BatchResult(seq=run.wb.batch.seq, error="no model runner: the KV reset failed")
        try:
            if self.before_execute is not None:
                self.before_execute(runner, run.wb)
            result = runner.execute(run.wb.batch)
        except Exception as exc:
            return BatchResult(seq=run.wb.batch.seq, error=_describe(exc))
        run.passes = runner.last_batch_passes  # a new list each batch: no copy
        return result

    def _computed(self, job: BatchRun | _Reset, outcome: Any, elapsed: float) -> None:
        """On the event loop: a job ended (on the compute thread or the loop)."""
        if isinstance(job, _Reset):
            if isinstance(outcome, BaseException):
                self.log.error("runner reset failed", error=_describe(outcome))
                if job is self._last_reset:
                    # the next batch queued finds no geometry built: it checks and resets
                    # again (a reset queued after this one owns the geometry otherwise)
                    self._geometry = (0, 0, "")
            return
        if isinstance(outcome, BaseException):  # not even an error result: a worker bug
            outcome = BatchResult(seq=job.wb.batch.seq, error=_describe(outcome))
        if outcome is None or job.wb.epoch != self.epoch:
            return  # the scheduler restarted while this ran; its result is moot
        if outcome.error is None and self.inline_max_s > 0:
            self.execute_time.observe(job.token_loops, elapsed)
        self.results.put_nowait((job, outcome, elapsed))

    def _geometry_of(self, wb: WorkerBatch) -> Geometry:
        if wb.num_blocks and wb.block_size and wb.kv_layout:
            return wb.num_blocks, wb.block_size, wb.kv_layout
        return self._geometry


def _token_loops(batch: Batch) -> int:
    return sum(row.token_count * max(row.num_loops, 1) for row in batch.rows)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
