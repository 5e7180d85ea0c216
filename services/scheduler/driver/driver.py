"""The scheduler service's pure part: ``SchedulerDriver`` (no NATS, testable alone).

It runs the one step loop (``EngineCore``) with the NATS executor, and keeps what only a
service has: each request's stream (``streams.py``: admission's relay and tracking
subjects; what submits and aborts do to them is ``submissions.py``), the bound worker and
its epoch, deadlines, and the load report (``load_report.py``). Every call that
others must hear about returns one ``StepOutput`` (``step_output.py``) with everything to
send since the last one: worker batches, relayed events, abort answers, notices, prefix
events. Calls that return none (``bind``, ``worker_lost``, ``on_result``, ``drop_fenced``)
leave what they cause for the next one. The NATS shell is ``service.py``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from messages.api import StreamEvent
from messages.errors import ErrorCode
from messages.internal import (
    SchedulerLoad,
    WorkerHeartbeat,
    WorkerResult,
)
from messages.kv_transfer import KVHandoff, KVPullResult
from messages.prefix import PrefixEventBatch
from services.common.config import ModelLimits, SchedulerConfig
from services.common.tokenizer import TextCodec
from services.runtime import subjects
from services.runtime.logging import get_logger, request_fields
from services.scheduler.core.batch import ScheduledBatch
from services.scheduler.core.scheduler import Scheduler
from services.scheduler.driver.handover import Handover
from services.scheduler.driver.liveness import LossDetector
from services.scheduler.driver.load_report import LoadReport, scheduler_health
from services.scheduler.driver.nats_executor import NatsExecutor
from services.scheduler.driver.step_output import StepOutput, StreamKey
from services.scheduler.driver.streams import Streams, error_event
from services.scheduler.driver.submissions import Submissions
from services.scheduler.driver.telemetry import SchedulerTelemetry
from services.scheduler.driver.tombstones import AbortTombstones
from services.scheduler.engine_core import EngineCore


class SchedulerDriver(Submissions):
    """``EngineCore`` over NATS + the streams admission relays; calls return a StepOutput."""

    def __init__(
        self,
        config: SchedulerConfig,
        limits: ModelLimits,
        codec: TextCodec | None = None,
        *,
        instance: str = "local",
        producer_id: str | None = None,
        shard_id: str = subjects.DEFAULT_SHARD,
        log: Any = None,
        abort_keep_s: float = 10.0,
        kv_handoff_hold_s: float = 30.0,
        kv_transfer_timeout_s: float = 10.0,
    ) -> None:
        self.config = config
        self.limits = limits
        self.codec = codec
        self.instance = instance
        self.shard_id = shard_id
        # the prefix-event producer name outlives this process (RLT_SCHEDULER_NAME): a
        # restarted scheduler announces a newer epoch under the same name, and the prefix
        # cache drops everything the old one published
        self.producer_id = producer_id or instance
        self.log = log or get_logger("scheduler")
        self.draining = False
        self.load_report = LoadReport(instance, shard_id, self.producer_id)
        self.num_worker_losses = 0
        self.num_resumed = 0
        self.simulated = False  # the bound worker is a ``--device sim`` worker
        self.has_worker = True  # the service says whether a worker is usable
        # the latest applied result's round trip (batch sent -> result here), if timed
        self.last_round_trip_s: float | None = None
        self.tombstones = AbortTombstones(abort_keep_s)
        # what the calls since the last StepOutput produced (batches and prefix events are
        # taken from the executor and the scheduler when it is handed out)
        self._out = StepOutput()
        self.executor = NatsExecutor(config, instance)
        self.streams = Streams()
        # disaggregation: how long a handoff is held without a release, a pull may take
        self.kv_handoff_hold_s = kv_handoff_hold_s
        self.kv_transfer_timeout_s = kv_transfer_timeout_s
        self._new_core()
        self.telemetry = SchedulerTelemetry(
            lambda: self.scheduler,
            total_ut_steps=limits.total_ut_steps,
            prefix_caching=config.enable_prefix_caching,
            shard=shard_id,
        )
        self.handover = Handover(self)  # disaggregation: handoffs and pulls

    def _new_core(self) -> None:
        self.core = EngineCore(
            self.config,
            self.limits,
            self.executor,
            producer_id=self.producer_id,
            codec=self.codec,
            on_batch=self._on_batch,
            log=self.log,
        )
        # every new core is a new prefix-log epoch whose first envelope clears the cache, so
        # the prefix cache drops what the previous one published even before we cache anything
        self.scheduler.kv.reset_prefix_cache()
        handoffs = self.scheduler.handoffs
        handoffs.scheduler_id = self.instance  # whom decode shards ask
        handoffs.hold_s = self.kv_handoff_hold_s
        self.scheduler.pulls.timeout_s = self.kv_transfer_timeout_s
        self.streams.live.clear()

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def inflight(self) -> deque[ScheduledBatch]:
        return self.core.inflight

    @property
    def epoch(self) -> str:
        return self.executor.epoch

    @property
    def worker_id(self) -> str | None:
        return self.executor.worker_id

    @property
    def idle(self) -> bool:
        return not self.streams and not self.core.inflight

    # ------------------------------------------------------------------ workers
    def bind(self, worker_id: str) -> None:
        """Sends this epoch's batches to ``worker_id``. Switching after batches went to
        another worker means that worker's device state is out of reach: recompute."""
        if self.executor.worker_id == worker_id:
            return
        if self.executor.has_sent:
            self.worker_lost(f"switching to worker {worker_id}")
        self.executor.worker_id = worker_id
        self.log.info("worker bound", worker=worker_id, epoch=self.epoch)

    def worker_lost(self, reason: str) -> list[str]:
        """The bound worker's device state is gone or unreachable (dead, hung, draining, a
        batch or result lost). New epoch; every running request returns to the queue with its
        outputs kept and is recomputed on the next worker, so clients see a delay, not an
        error, and the outputs equal an uninterrupted run. Results still arriving from the
        old epoch are ignored, so nothing is applied twice. Returns the recomputed ids."""
        lost_worker, lost_batches = self.worker_id, [b.seq for b in self.core.inflight]
        self.executor.new_epoch()
        affected = self.core.reset_after_executor_loss()
        self.num_worker_losses += 1
        self.log.warning(
            "worker lost; requests will be recomputed",
            reason=reason,
            worker=lost_worker,
            inflight_batches=lost_batches,
            recomputed=len(affected),
            epoch=self.epoch,
        )
        return affected

    def check_worker(self, hb: WorkerHeartbeat, loss: LossDetector, now: float) -> None:
        """A heartbeat: if it is the bound worker's and proves a batch or a result of ours
        lost, the worker's state is out of step with ours (``worker_lost``)."""
        if hb.worker_id != self.worker_id:
            return
        inflight = [b.seq for b in self.core.inflight]
        reason = loss.check(hb, self.epoch, inflight, self.executor.sent_at, now)
        if reason is not None:
            self.worker_lost(reason)

    # ------------------------------------------------------------------ streams
    def stream_key(self, request_id: str) -> StreamKey | None:
        """The try a live or lately ended stream serves."""
        return self.streams.key(request_id)

    def tries(self) -> set[StreamKey]:
        """The tries of the live streams an admission admitted."""
        return self.streams.tries()

    def drop_fenced(self, keys: set[StreamKey]) -> list[StreamKey]:
        """Admission ended these tries while we were cut off or stalled (fencing): they end
        here without another event or notice (their clients already have their terminal
        event). Returns the keys of those that were live."""
        dropped: list[StreamKey] = []
        for rid, stream in list(self.streams.live.items()):
            if stream.key not in keys:
                continue
            self.streams.end(rid)
            # its events are dropped; telemetry still closes its timing and span
            events = self.core.fail_requests([rid], ErrorCode.UNAVAILABLE, "fenced")
            self.telemetry.on_events(events, self.core.inflight)
            dropped.append(stream.key)
            self.log.warning("request fenced: admission ended it", **request_fields(rid, ""))
        return dropped

    def fail_request(self, request_id: str, code: ErrorCode, message: str) -> StepOutput:
        """Ends one live request with an error event, freeing its KV."""
        self._fail([request_id], code, message)
        return self._take()

    def expire(
        self,
        now: float,
        *,
        max_request_s: float,
        no_worker_since: float | None,
        worker_wait_s: float,
    ) -> StepOutput:
        """Deadlines: a request older than ``max_request_s`` ends with ``timeout``; while no
        worker is up, one that waited ``worker_wait_s`` for it ends with ``unavailable``."""
        live = self.streams.live
        too_old = [rid for rid, s in live.items() if now - s.started > max_request_s]
        if too_old:
            message = f"request exceeded its {max_request_s:.0f}s lifetime"
            self._fail(too_old, ErrorCode.TIMEOUT, message)
        if no_worker_since is not None:
            starved = [
                rid
                for rid, s in live.items()
                if now - max(s.started, no_worker_since) > worker_wait_s
            ]
            if starved:
                message = f"no worker has been available for {worker_wait_s:.0f}s"
                self._fail(starved, ErrorCode.UNAVAILABLE, message)
        return self._take()

    # ------------------------------------------------------------------ the loop
    def step(self, *, schedule: bool = True) -> StepOutput:
        """One ``EngineCore`` step: results applied in seq order, then (``schedule``, i.e.
        a worker is bound and the bus is up) new batches for the worker."""
        self._route(self.core.step(schedule=schedule))
        self.handover.hand_off_due(time.monotonic())
        return self._take()

    # ------------------------------------------------------------------ disaggregation
    def kv_pulled(self, result: KVPullResult) -> KVHandoff | None:
        """A pull's outcome from our worker; returns the handoff to release at its prefill
        scheduler (then ``kv_confirmed`` with the answer, if the pull succeeded)."""
        return self.handover.pulled(result)

    def kv_confirmed(self, transfer_id: str, request_id: str, held: bool) -> StepOutput:
        self.handover.confirmed(transfer_id, request_id, held)
        return self._take()

    def release_handoff(self, handoff_id: str) -> bool:
        """A decode shard is done with one of our handoffs: True if it was still held."""
        return self.handover.release(handoff_id)

    def expire_transfers(self, now: float) -> StepOutput:
        """Handoffs held too long, pulls whose result never came."""
        self.handover.expire(now)
        return self._take()

    def on_result(self, wr: WorkerResult) -> bool:
        """A worker result; False if it is not this epoch's, from the bound worker, for a
        batch in flight (stale, duplicate or foreign: ignored)."""
        sent_at = self.executor.sent_at.get(wr.result.seq)
        if not (self.core.is_inflight(wr.result.seq) and self.executor.deliver(wr)):
            return False
        took = None if sent_at is None else time.monotonic() - sent_at
        self.last_round_trip_s = took
        self.telemetry.on_result(wr, took)
        if took is not None:
            self.load_report.round_trip(took)
        self.simulated = wr.simulated
        return True

    def reset(self, code: ErrorCode, message: str) -> StepOutput:
        """Gives up on everything (shutdown after the drain timeout): every stream ends with
        an error and a fresh scheduler starts a new epoch."""
        events: list[StreamEvent] = []
        for rid, stream in list(self.streams.live.items()):
            event = error_event(rid, code, message)
            events.append(event)
            self._relay(stream, event)
            self.streams.end(rid)
        self.telemetry.on_events(events, self.core.inflight)
        self.log.error("scheduler reset", reason=message, failed=len(events), epoch=self.epoch)
        self.scheduler.pulls.clear()  # nobody will read their handoffs: released now
        self._out.kv_releases += self.scheduler.take_unused_handoffs()
        self.executor.new_epoch()
        self._new_core()
        return self._take()

    def rebase_prefix(self) -> PrefixEventBatch:
        """A new prefix epoch whose first envelope is the whole cache (the publisher lost
        envelopes). Events not yet taken are inside that snapshot already."""
        s = self.scheduler
        s.kv.take_prefix_events()
        return s.prefix_log.rebase(s.kv.snapshot_prefix_events())

    def oldest_inflight_age(self, now: float) -> float:
        return self.executor.age_of(self.core.oldest_inflight_seq(), now)

    # ------------------------------------------------------------------ reports
    def load(self) -> SchedulerLoad:
        return self.load_report.report(
            self.scheduler,
            has_worker=self.has_worker,
            draining=self.draining,
            simulated=self.simulated,
        )

    def health(self) -> dict[str, Any]:
        """The driver's part of the service's health reply."""
        return {
            "epoch": self.epoch,
            "worker": self.worker_id,
            "simulated": self.simulated,
            "resumed_requests": self.num_resumed,
            "worker_losses": self.num_worker_losses,
            "streams": len(self.streams),
            "inflight_batches": len(self.inflight),
            "abort_tombstones": len(self.tombstones),
            "prefix_producer": self.producer_id,
            **self.handover.health(),
            **scheduler_health(self.scheduler),
        }

    def _on_batch(self, batch: ScheduledBatch) -> None:
        self.telemetry.on_batch(batch, self.scheduler)

    # ------------------------------------------------------------------ output
    def take(self) -> StepOutput:
        """What calls that return nothing left behind (a worker loss's prefix events): for
        the last publish before a shutdown."""
        return self._take()

    def _take(self) -> StepOutput:
        """Everything to send since the last call: one output, one publish."""
        out, self._out = self._out, StepOutput()
        out.batches = self.executor.take_outbox()
        # the KV manager's events are the one buffer: wrapped into an envelope only here
        envelope = self.scheduler.take_prefix_events()
        if envelope is not None:
            out.prefix_events.append(envelope)
        out.kv_releases += self.scheduler.take_unused_handoffs()
        return out

    def _fail(self, request_ids: Iterable[str], code: ErrorCode, message: str) -> None:
        """Ends these requests with one error event each, freeing their KV. A stream whose
        request is no longer in the scheduler still gets its error."""
        ids = list(request_ids)
        self._route(self.core.fail_requests(ids, code, message))
        for rid in ids:
            stream = self.streams.end(rid)
            if stream is not None:
                event = error_event(rid, code, message)
                self.telemetry.on_events([event], self.core.inflight)
                self._relay(stream, event)
