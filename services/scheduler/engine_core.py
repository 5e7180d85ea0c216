"""``EngineCore``: the one step loop, shared by every way rlt runs.

One step applies the results that came back, strictly in seq order, then schedules and
submits batches up to the in-flight limit (1 with sync scheduling, ``max_inflight_batches``
with async scheduling). Where a batch runs is the executor's business:

- in-process (``services/engine/executor.py``): the model runner in this process, used by
  ``rlt generate --offline``, ``rlt schedule-trace``, the bench and the tests;
- over NATS (``services/scheduler/driver/nats_executor.py``): the worker service, used by the
  scheduler service.

Failure policy, the same whatever the executor:
- a batch the worker could not run ends every live request in it with an ``internal``
  error (``Scheduler.fail_batch``: results of requests that already ended are stale);
- an exception in submission-time or output-time progress ends the batch's requests, and
  the batch's result is then not applied;
- an exception while selecting a batch ends every live request (the culprit is unknown);
- the executor losing its device state (a worker died) recomputes every running request.
Every ended request gets exactly one terminal event, and its KV is freed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from messages.api import StreamEvent
from messages.batch import BatchResult
from messages.errors import ErrorCode
from messages.kv_transfer import KVHandoff
from messages.sampling import PrefillSetting, SamplingParams
from services.common.config import ModelLimits, SchedulerConfig
from services.common.tokenizer import TextCodec
from services.runtime.logging import BATCH_SEQ, get_logger
from services.scheduler.core.batch import ScheduledBatch
from services.scheduler.core.intake import KnownOutputs
from services.scheduler.core.scheduler import Scheduler
from services.scheduler.output import OutputProcessor


class Executor(Protocol):
    """Runs batches in seq order somewhere and hands back their results."""

    def submit(self, batch: ScheduledBatch) -> None:
        """Takes a batch that was just built; it must reach the worker (it carries deltas)."""

    def take_results(self) -> list[BatchResult]:
        """Results that came back since the last call (any order; the core orders them)."""


class EngineCore:
    def __init__(
        self,
        config: SchedulerConfig,
        limits: ModelLimits,
        executor: Executor,
        *,
        producer_id: str = "scheduler-0",
        codec: TextCodec | None = None,
        on_batch: Callable[[ScheduledBatch], None] | None = None,
        log: Any = None,
    ) -> None:
        self.config = config
        self.limits = limits
        self.executor = executor
        self.producer_id = producer_id
        self.on_batch = on_batch
        self.log = log or get_logger("engine")
        self.max_inflight = config.max_inflight_batches if config.async_scheduling else 1
        self.scheduler = Scheduler(config, limits, producer_id=producer_id)
        self.inflight: deque[ScheduledBatch] = deque()
        self._results: dict[int, BatchResult] = {}
        self._failed: set[int] = set()  # batches whose requests already ended with an error
        self.outputs = OutputProcessor(codec)

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        trace_id: str = "",
        known_outputs: KnownOutputs | None = None,
        *,
        hand_off: bool = False,
        kv_source: KVHandoff | None = None,
        prefill_setting: PrefillSetting | None = None,
    ) -> list[StreamEvent]:
        """Queues a request; raises ``RequestError`` (and changes nothing) if it is refused.
        ``known_outputs`` (token ids, exit loops, depth budgets) resumes a request from
        another shard: they are replayed, not streamed, and the stream's text goes on from
        them. Returns the events of a resumed request that its known outputs already
        finish. ``hand_off`` / ``kv_source``: disaggregation; ``prefill_setting``: the one a
        resumed request keeps (``Scheduler.add_request``)."""
        self.scheduler.add_request(
            request_id,
            prompt_token_ids,
            params,
            trace_id=trace_id,
            known_outputs=known_outputs,
            hand_off=hand_off,
            kv_source=kv_source,
            prefill_setting=prefill_setting,
        )
        if not known_outputs or not known_outputs.token_ids:
            return []
        self.outputs.prime(request_id, known_outputs.token_ids)
        return self.outputs.process(self.scheduler.finish_if_complete(request_id))

    def abort_request(self, request_id: str) -> list[StreamEvent]:
        """Ends a live request with ``finish_reason: abort``; ``RequestError`` if unknown."""
        return self.outputs.process(self.scheduler.abort_request(request_id))

    def fail_requests(
        self, request_ids: Iterable[str], code: ErrorCode, message: str
    ) -> list[StreamEvent]:
        """Ends these live requests with one error event each, freeing their KV."""
        return self.outputs.process(self._fail(request_ids, code, message))

    def _fail(self, request_ids: Iterable[str], code: ErrorCode, message: str) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        for request_id in request_ids:
            events.extend(self.scheduler.fail_request(request_id, message, code))
        return events

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.inflight)

    # ------------------------------------------------------------------ the step
    def step(self, *, schedule: bool = True) -> list[StreamEvent]:
        """Applies what came back in seq order, then (``schedule``) fills the pipeline."""
        for result in self.executor.take_results():
            self.accept_result(result)
        events = self._apply_ready_results()
        if schedule:
            events += self._fill()
        return self.outputs.process(events)

    def accept_result(self, result: BatchResult) -> bool:
        """Buffers a result; False if it belongs to no batch in flight (stale or duplicate)."""
        if not self.is_inflight(result.seq):
            return False
        self._results[result.seq] = result
        return True

    def is_inflight(self, seq: int) -> bool:
        return bool(self.inflight) and self.inflight[0].seq <= seq <= self.inflight[-1].seq

    def _fill(self) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        while len(self.inflight) < self.max_inflight:
            try:
                batch = self.scheduler.schedule()
            except Exception as exc:
                self.log.exception("schedule failed")
                return events + self._fail(
                    list(self.scheduler.requests), ErrorCode.INTERNAL, f"scheduler error: {exc!r}"
                )
            for change in self.scheduler.take_depth_budget_changes():
                self.log.info(
                    "depth budget changed",
                    old=change.old,
                    new=change.new,
                    waiting=change.waiting,
                    running=change.running,
                    **{BATCH_SEQ: change.batch_seq},
                )
            if batch is None:
                break
            if self.on_batch is not None:
                self.on_batch(batch)
            self.inflight.append(batch)
            self.executor.submit(batch)
            try:
                self.scheduler.update_after_submission(batch)
            except Exception as exc:
                events += self._fail_batch_requests(batch, exc, "update_after_submission")
        return events

    def _apply_ready_results(self) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        while self.inflight and self.inflight[0].seq in self._results:
            batch = self.inflight.popleft()
            result = self._results.pop(batch.seq)
            if batch.seq in self._failed:
                self._failed.discard(batch.seq)
                continue
            if result.error is not None:
                self.log.error(
                    "worker failed batch", error=result.error[:500], **{BATCH_SEQ: batch.seq}
                )
                events += self.scheduler.fail_batch(
                    batch, f"worker failed batch {batch.seq}: {result.error}"
                )
                continue
            try:
                events += self.scheduler.update_from_output(batch, result)
            except Exception as exc:
                events += self._fail_batch_requests(batch, exc, "update_from_output")
        return events

    def _fail_batch_requests(
        self, batch: ScheduledBatch, exc: Exception, where: str
    ) -> list[StreamEvent]:
        self.log.exception(f"{where} failed", **{BATCH_SEQ: batch.seq})
        self._failed.add(batch.seq)
        return self.scheduler.fail_batch(batch, f"scheduler error on batch {batch.seq}: {exc!r}")

    # ------------------------------------------------------------------ executor loss
    def reset_after_executor_loss(self) -> list[str]:
        """The executor's device state is gone (the worker died or was replaced): batches in
        flight are forgotten, and every running request is recomputed from its recorded
        outputs on the next worker. Returns the ids of the recomputed requests."""
        self.inflight.clear()
        self._results.clear()
        self._failed.clear()
        return self.scheduler.reset_after_worker_loss()

    def oldest_inflight_seq(self) -> int | None:
        return self.inflight[0].seq if self.inflight else None
