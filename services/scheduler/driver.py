"""The scheduler service's pure part: ``SchedulerDriver`` (no NATS, testable alone).

It runs the one step loop (``EngineCore``) with the NATS executor, and keeps what only a
service has: each request's stream (the client's reply subject, admission's tracking
subject), the bound worker and its epoch, deadlines, and the load report. Every method
returns the deliveries to publish; the NATS shell is ``service.py``.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from messages.api import ErrorEvent, FinishedEvent, StreamEvent
from messages.batch import Phase
from messages.errors import ErrorCode, RequestError
from messages.internal import (
    AdmittedRequest,
    RelayedEvent,
    RequestNotice,
    SchedulerLoad,
    WorkerResult,
)
from messages.prefix import PrefixEventBatch
from services.common.config import ModelLimits, SchedulerConfig
from services.common.tokenizer import TextCodec
from services.runtime import subjects
from services.runtime.logging import get_logger, log_content_enabled, request_fields
from services.scheduler.batch import ScheduledBatch
from services.scheduler.engine_core import EngineCore
from services.scheduler.nats_executor import NatsExecutor
from services.scheduler.scheduler import Scheduler
from services.scheduler.telemetry import SchedulerTelemetry
from services.scheduler.tombstones import ANY, AbortTombstones

Delivery = tuple[str, StreamEvent]  # (client reply subject, event)
# which try of a request a stream serves: (admission id, admission seq); fencing names it
StreamKey = tuple[str, int]
Notice = tuple[str, RequestNotice]  # (admission tracking subject, notice)
# recent batch round trips (submit -> result) weigh this much in the load report's step time
_STEP_TIME_WEIGHT = 0.2
# an admission instance silent this long is dropped from the load reports (admission's own
# record of unconfirmed submissions expires after 10 s: unseen_expiry_s)
ADMISSION_FORGET_S = 600.0


@dataclass
class _Stream:
    reply: str
    trace_id: str
    started: float
    track: str = ""  # admission's tracking subject ("" = nobody tracks it)
    no: int = 0  # names the stream in its "gone" reply subject
    tenant: str = ""  # only this tenant may abort it or retry it
    admission_id: str = ""  # the admission that may end it if we are lost (fencing)
    admission_seq: int = 0  # the try it serves (a retry re-attaching moves it); tags relays
    # admission's relay subject: events go there (admission passes them on to the client)
    relay: str = ""

    @property
    def key(self) -> StreamKey:
        return (self.admission_id, self.admission_seq)


class SchedulerDriver:
    """``EngineCore`` over NATS + client streams; every method returns deliveries."""

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
        # per admission instance, the newest admission seq it submitted here (reported, so
        # it knows what arrived), and when: an admission that sent nothing for
        # ADMISSION_FORGET_S is forgotten (restarts make new ones; reports must not grow)
        self.last_admission_seq: dict[str, int] = {}
        self._admission_heard: dict[str, float] = {}
        self.notices: list[Notice] = []
        # relay subject -> events for that admission, in the order they happened
        self.relayed: dict[str, list[RelayedEvent]] = {}
        self._relay_admission: dict[str, str] = {}  # relay subject -> its admission
        self.num_worker_losses = 0
        self.num_resumed = 0
        self.simulated = False  # the bound worker is a ``--device sim`` worker
        self.has_worker = True  # the service says whether a worker is usable
        self.step_time_s = 0.0
        # the latest applied result's round trip (batch sent -> result here), if timed
        self.last_round_trip_s: float | None = None
        self._report_seq = 0
        self._stream_nos = 0
        self.tombstones = AbortTombstones(abort_keep_s)
        # streams that ended lately, by request id: what their held events belong to
        self._ended_keys: OrderedDict[str, StreamKey] = OrderedDict()
        self.executor = NatsExecutor(config, instance)
        self._new_core()
        self.telemetry = SchedulerTelemetry(
            lambda: self.scheduler,
            total_ut_steps=limits.total_ut_steps,
            prefix_caching=config.enable_prefix_caching,
            shard=shard_id,
        )

    def _new_core(self) -> None:
        # every new core starts a new prefix-log epoch, so the prefix cache drops what the
        # previous one published
        self.core = EngineCore(
            self.config,
            self.limits,
            self.executor,
            producer_id=self.producer_id,
            codec=self.codec,
            on_batch=self._on_batch,
            log=self.log,
        )
        if self.config.enable_prefix_caching:
            self.scheduler.prefix_log.announce()
        self.streams: dict[str, _Stream] = {}
        self.by_no: dict[int, str] = {}

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

    # ------------------------------------------------------------------ requests
    def add(self, req: AdmittedRequest, track: str = "", traceparent: str = "") -> list[Delivery]:
        """Queues an admitted request. ``track`` is admission's tracking subject: it hears
        "accepted" now and "done" when the stream's terminal event is published (a relayed
        stream's terminal event reaches admission on the relay itself). ``traceparent`` is
        admission's span (the parent of ours)."""
        if req.admission_id:
            seen = self.last_admission_seq.get(req.admission_id, 0)
            self.last_admission_seq[req.admission_id] = max(seen, req.admission_seq)
            self._admission_heard[req.admission_id] = time.monotonic()
        fields = request_fields(req.request_id, req.trace_id)
        if req.shard_id and req.shard_id != self.shard_id:
            self.log.warning("request for another shard refused", shard=req.shard_id, **fields)
            return self._refuse(
                req, track, ErrorCode.INTERNAL, f"sent to shard {self.shard_id}, not {req.shard_id}"
            )
        live = self.streams.get(req.request_id)
        if live is not None and live.tenant != req.tenant:
            return self._refuse(
                req, track, ErrorCode.INVALID_REQUEST, f"request_id {req.request_id!r} is in use"
            )
        if live is not None:
            # a client's retry of a live request (same request_id): no second generation;
            # the stream goes on to the retry's reply subject and tracking subject
            if live.track and live.track != track:
                # the admission it came through first closes its entry without a word
                self._notice(live.track, req.request_id, "done")
            live.reply, live.track = req.reply_subject, track
            live.admission_id, live.admission_seq = req.admission_id, req.admission_seq
            if req.relay_subject:
                # the retry came through another admission: it learns what the stream has
                # produced so far, then relays from here on
                live.relay = req.relay_subject
                self._resync(req.request_id, live)
            self._notice(track, req.request_id, "accepted")
            self.log.info("request re-attached", **fields)
            if self.tombstones.take(req.tenant, req.request_id, time.monotonic(), live.key):
                return self._abort_live(req.request_id)  # the retry's abort came first
            return []
        try_ = (req.admission_id, req.admission_seq)
        if self.tombstones.take(req.tenant, req.request_id, time.monotonic(), try_):
            # its abort came first: it ends now, without running (as asked, even if we drain)
            self.log.info("request aborted before it arrived", **fields)
            self._notice(track, req.request_id, "accepted")
            return self._end_unstarted(
                req, track, _aborted(req.request_id, len(req.prompt_token_ids))
            )
        if self.draining:
            return self._refuse(req, track, ErrorCode.UNAVAILABLE, "scheduler is shutting down")
        known = (
            (req.resume_token_ids, req.resume_exit_depths)
            if req.resume_token_ids or req.resume_exit_depths
            else None
        )
        try:
            done = self.core.add_request(
                req.request_id,
                req.prompt_token_ids,
                req.params,
                trace_id=req.trace_id,
                known_outputs=known,
            )
        except RequestError as exc:
            self.log.info("request refused", code=str(exc.code), reason=exc.message[:200], **fields)
            return self._refuse(req, track, exc.code, exc.message)
        except Exception as exc:  # a scheduler bug must not take the service down
            self.log.exception("add_request failed", **fields)
            return self._refuse(req, track, ErrorCode.INTERNAL, f"scheduler error: {exc!r}")
        self._stream_nos += 1
        self.streams[req.request_id] = _Stream(
            req.reply_subject,
            req.trace_id,
            time.monotonic(),
            track,
            self._stream_nos,
            tenant=req.tenant,
            admission_id=req.admission_id,
            admission_seq=req.admission_seq,
            relay=req.relay_subject,
        )
        self.by_no[self._stream_nos] = req.request_id
        self.telemetry.on_added(req, traceparent)
        self._notice(track, req.request_id, "accepted")
        extra: dict[str, Any] = {}
        if log_content_enabled():
            extra["prompt_token_ids"] = req.prompt_token_ids
        if known is not None:
            self.num_resumed += 1
            extra["resumed_tokens"] = len(req.resume_token_ids)
        self.log.info(
            "request added",
            num_prompt_tokens=len(req.prompt_token_ids),
            max_tokens=req.params.max_tokens,
            **extra,
            **fields,
        )
        return self._route(done)

    def _refuse(
        self, req: AdmittedRequest, track: str, code: ErrorCode, message: str
    ) -> list[Delivery]:
        return self._end_unstarted(req, track, error_event(req.request_id, code, message))

    def _end_unstarted(
        self, req: AdmittedRequest, track: str, event: StreamEvent
    ) -> list[Delivery]:
        """The terminal event of a request that never ran: through its relay (admission
        passes it on and so learns it ended), else to the client, and "done" to admission
        (with a copy of a finished event, kept to answer a retry). Metrics count it like any
        other ending (a refusal by its error code, an early abort as finished "abort")."""
        self.telemetry.on_events([event], self.core.inflight)
        self._remember_ended(req.request_id, (req.admission_id, req.admission_seq))
        if req.relay_subject:
            self._relay(
                req.relay_subject,
                req.admission_id,
                RelayedEvent(seq=req.admission_seq, event=event),
            )
            return []
        finished = event if isinstance(event, FinishedEvent) else None
        self._notice(track, req.request_id, "done", finished)
        return [(req.reply_subject, event)]

    def _resync(self, request_id: str, stream: _Stream) -> None:
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return
        self._relay(
            stream.relay,
            stream.admission_id,
            RelayedEvent(
                seq=stream.admission_seq,
                known_token_ids=list(request.output_token_ids),
                known_exit_depths=list(request.output_exit_depths),
            ),
        )

    def _relay(self, subject: str, admission_id: str, item: RelayedEvent) -> None:
        self.relayed.setdefault(subject, []).append(item)
        self._relay_admission[subject] = admission_id

    def take_relayed(self) -> dict[str, list[RelayedEvent]]:
        out, self.relayed = self.relayed, {}
        self._relay_admission = {}
        return out

    def drop_relayed(self, keys: set[StreamKey]) -> set[StreamKey]:
        """Removes the not yet sent relayed events of these tries (fencing: admission ended
        them); returns the tries that had some."""
        found: set[StreamKey] = set()
        for subject, items in self.relayed.items():
            admission_id = self._relay_admission[subject]
            kept = [item for item in items if (admission_id, item.seq) not in keys]
            if len(kept) < len(items):
                found |= {(admission_id, item.seq) for item in items} & keys
                self.relayed[subject] = kept
        return found

    def fail_request(self, request_id: str, code: ErrorCode, message: str) -> list[Delivery]:
        """Ends one live request with an error event, freeing its KV."""
        return self._fail([request_id], code, message)

    def client_gone(self, stream_no: int) -> bool:
        """nats-server reported nobody listens on the stream's reply subject any more (the
        client closed its connection or unsubscribed): abort it and free its KV. Nothing is
        sent to the client; admission hears "done". False if the stream already ended."""
        rid = self.by_no.get(stream_no)
        stream = self.streams.get(rid) if rid is not None else None
        if rid is None or stream is None or stream.no != stream_no:
            return False
        self.log.warning("client gone; request aborted", **request_fields(rid, stream.trace_id))
        self._fail([rid], ErrorCode.UNAVAILABLE, "client went away")
        return True

    def expire(
        self,
        now: float,
        *,
        max_request_s: float,
        no_worker_since: float | None,
        worker_wait_s: float,
    ) -> list[Delivery]:
        """Deadlines: a request older than ``max_request_s`` ends with ``timeout``; while no
        worker is up, one that waited ``worker_wait_s`` for it ends with ``unavailable``."""
        out: list[Delivery] = []
        too_old = [rid for rid, s in self.streams.items() if now - s.started > max_request_s]
        if too_old:
            out += self._fail(
                too_old, ErrorCode.TIMEOUT, f"request exceeded its {max_request_s:.0f}s lifetime"
            )
        if no_worker_since is not None:
            starved = [
                rid
                for rid, s in self.streams.items()
                if now - max(s.started, no_worker_since) > worker_wait_s
            ]
            if starved:
                out += self._fail(
                    starved,
                    ErrorCode.UNAVAILABLE,
                    f"no worker has been available for {worker_wait_s:.0f}s",
                )
        return out

    def abort(
        self,
        request_id: str,
        requester_reply: str = "",
        tenant: str = "",
        *,
        admission_id: str = "",
        admission_seq: int = 0,
        broadcast: bool = False,
    ) -> list[Delivery]:
        """Ends a live request of ``tenant`` with ``finish_reason: abort``. ``admission_seq``
        > 0 aborts only the try ``(admission_id, admission_seq)`` (a request admission moved
        away from here, or the copy admission knows of). An abort for a request that is not
        here (yet) is remembered for a few seconds (``tombstones``) and honoured if the
        request arrives; the requester hears ``not_found`` now, unless the abort was a
        ``broadcast`` to every shard, or it named a try that has not been here while no
        other copy runs here (its submit is behind it: the requester hears the abort
        confirmed). The requester's reply carries no outputs: those go to the request's own
        stream only."""
        aimed = (admission_id, admission_seq) if admission_seq else ANY
        live = self.streams.get(request_id)
        stream = live if live is not None and aimed in (ANY, live.key) else None
        if stream is None or stream.tenant != tenant:
            self.tombstones.add(tenant, request_id, time.monotonic(), aimed)
            if not requester_reply or broadcast:
                return []
            coming = live is None and self._ended_keys.get(request_id) != aimed
            if aimed != ANY and coming:
                return [(requester_reply, _aborted(request_id, 0))]
            message = f"unknown request id {request_id!r}"
            return [(requester_reply, error_event(request_id, ErrorCode.NOT_FOUND, message))]
        return self._abort_live(request_id, requester_reply, broadcast)

    def _abort_live(
        self, request_id: str, requester_reply: str = "", broadcast: bool = False
    ) -> list[Delivery]:
        try:
            events = self.core.abort_request(request_id)
        except RequestError as exc:
            if not requester_reply or broadcast:
                return []
            return [(requester_reply, error_event(request_id, exc.code, exc.message))]
        out = self._route(events)
        if requester_reply:
            out.append((requester_reply, _aborted(request_id, 0)))
        return out

    def stream_key(self, request_id: str) -> StreamKey | None:
        """The try a live or lately ended stream serves."""
        stream = self.streams.get(request_id)
        return stream.key if stream is not None else self._ended_keys.get(request_id)

    def tries(self) -> set[StreamKey]:
        """The tries held here: live streams admitted by an admission, and those with
        relayed events not yet sent."""
        live = {s.key for s in self.streams.values() if s.admission_id}
        return live | {
            (self._relay_admission[subject], item.seq)
            for subject, items in self.relayed.items()
            for item in items
        }

    def drop_fenced(self, keys: set[StreamKey]) -> list[str]:
        """Admission ended these tries while we were cut off or stalled (fencing): they end
        here without another event or notice (their clients already have their terminal
        event). Returns the keys of those that were live."""
        dropped: list[StreamKey] = []
        for rid, stream in list(self.streams.items()):
            if stream.key not in keys:
                continue
            del self.streams[rid]
            self.by_no.pop(stream.no, None)
            # its events are dropped; telemetry still closes its timing and span
            events = self.core.fail_requests([rid], ErrorCode.UNAVAILABLE, "fenced")
            self.telemetry.on_events(events, self.core.inflight)
            dropped.append(stream.key)
            self.log.warning("request fenced: admission ended it", **request_fields(rid, ""))
        return dropped

    # ------------------------------------------------------------------ the loop
    def step(self, *, schedule: bool = True) -> list[Delivery]:
        """One ``EngineCore`` step: results applied in seq order, then (``schedule``, i.e.
        a worker is bound and the bus is up) new batches into ``executor.outbox``."""
        return self._route(self.core.step(schedule=schedule))

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
            w = _STEP_TIME_WEIGHT if self.step_time_s else 1.0
            self.step_time_s = (1 - w) * self.step_time_s + w * took
        self.simulated = wr.simulated
        return True

    def reset(self, code: ErrorCode, message: str) -> list[Delivery]:
        """Gives up on everything (shutdown after the drain timeout): every stream ends with
        an error and a fresh scheduler starts a new epoch."""
        out: list[Delivery] = []
        events: list[StreamEvent] = []
        for rid, stream in list(self.streams.items()):
            event = error_event(rid, code, message)
            events.append(event)
            self._deliver(stream, event, out)
            self._ended(rid)
        self.telemetry.on_events(events, self.core.inflight)
        self.log.error("scheduler reset", reason=message, failed=len(events), epoch=self.epoch)
        self.executor.new_epoch()
        self._new_core()
        return out

    def take_notices(self) -> list[Notice]:
        out, self.notices = self.notices, []
        return out

    def take_prefix_events(self) -> list[PrefixEventBatch]:
        """Prefix-event envelopes to publish, in event_seq order: every one the log emitted,
        also those the core emits on its own (AllBlocksCleared after a worker loss)."""
        self.scheduler.take_prefix_events()
        return self.scheduler.prefix_log.take_emitted()

    def oldest_inflight_age(self, now: float) -> float:
        return self.executor.age_of(self.core.oldest_inflight_seq(), now)

    def forget_idle_admissions(self, now: float) -> None:
        """Admission instances that submitted nothing for ``ADMISSION_FORGET_S``: gone, or
        idle (their own record of what is unconfirmed expires well before)."""
        idle = [a for a, at in self._admission_heard.items() if now - at > ADMISSION_FORGET_S]
        for admission in idle:
            del self._admission_heard[admission]
            self.last_admission_seq.pop(admission, None)

    def load(self) -> SchedulerLoad:
        s = self.scheduler
        self.forget_idle_admissions(time.monotonic())
        waiting = [r for r in s.requests.values() if r.phase == Phase.WAITING]
        self._report_seq += 1
        kv = s.kv
        return SchedulerLoad(
            scheduler_id=self.instance,
            num_waiting=len(waiting),
            num_waiting_tokens=sum(r.num_prompt_tokens for r in waiting),
            num_running=len(s.running),
            last_admission_seq=dict(self.last_admission_seq),
            time=time.time(),
            shard_id=self.shard_id,
            producer_id=self.producer_id,
            report_seq=self._report_seq,
            num_blocks=kv.num_blocks,
            num_free_blocks=kv.num_free_blocks,
            num_active_blocks=(kv.num_blocks - kv.num_free_blocks) // kv.num_planes,
            num_waiting_prefill_tokens=s.num_prefill_tokens_due(),
            step_time_s=self.step_time_s,
            has_worker=self.has_worker,
            draining=self.draining,
            simulated=self.simulated,
        )

    def gone_subject(self, request_id: str) -> str:
        """Reply subject for this stream's events ("" if the stream is not live)."""
        stream = self.streams.get(request_id)
        return subjects.stream_gone(self.instance, stream.no) if stream else ""

    def _on_batch(self, batch: ScheduledBatch) -> None:
        self.telemetry.on_batch(batch, self.scheduler)

    # ------------------------------------------------------------------ streams
    def _notice(
        self, track: str, request_id: str, state: str, finished: FinishedEvent | None = None
    ) -> None:
        if track:
            notice = RequestNotice(
                request_id=request_id, scheduler_id=self.instance, state=state, finished=finished
            )
            self.notices.append((track, notice))

    def _ended(self, request_id: str, finished: FinishedEvent | None = None) -> _Stream | None:
        """Drops a stream whose terminal event is being delivered; admission hears "done"
        (with a copy of a ``finished`` event, which it keeps to answer a client's retry)."""
        stream = self.streams.pop(request_id, None)
        if stream is not None:
            self.by_no.pop(stream.no, None)
            if not stream.relay:  # a relayed terminal event tells admission itself
                self._notice(stream.track, request_id, "done", finished)
            self._remember_ended(request_id, stream.key)
        return stream

    def _remember_ended(self, request_id: str, key: StreamKey) -> None:
        self._ended_keys[request_id] = key
        self._ended_keys.move_to_end(request_id)
        while len(self._ended_keys) > 10_000:
            self._ended_keys.popitem(last=False)

    def _route(self, events: Iterable[StreamEvent]) -> list[Delivery]:
        out: list[Delivery] = []
        routed: list[StreamEvent] = []
        for event in events:
            stream = self.streams.get(event.request_id)
            if stream is None:
                continue
            if isinstance(event, FinishedEvent):
                event.shard = self.shard_id
                event.simulated = self.simulated
                self._ended(event.request_id, event)
                extra: dict[str, Any] = {}
                if log_content_enabled():
                    extra.update(token_ids=event.token_ids, text=event.text)
                self.log.info(
                    "request finished",
                    finish_reason=event.finish_reason,
                    num_tokens=len(event.token_ids),
                    latency_s=round(time.monotonic() - stream.started, 4),
                    **extra,
                    **request_fields(event.request_id, stream.trace_id),
                )
            elif isinstance(event, ErrorEvent):
                self._ended(event.request_id)
                self.log.warning(
                    "request failed",
                    code=event.code,
                    reason=event.message[:300],
                    **request_fields(event.request_id, stream.trace_id),
                )
            routed.append(event)
            self._deliver(stream, event, out)
        self.telemetry.on_events(routed, self.core.inflight)
        return out

    def _fail(self, request_ids: Iterable[str], code: ErrorCode, message: str) -> list[Delivery]:
        """Ends these requests with one error event each, freeing their KV. A stream whose
        request is no longer in the scheduler still gets its error."""
        ids = list(request_ids)
        out = self._route(self.core.fail_requests(ids, code, message))
        for rid in ids:
            stream = self._ended(rid)
            if stream is not None:
                event = error_event(rid, code, message)
                self.telemetry.on_events([event], self.core.inflight)
                self._deliver(stream, event, out)
        return out

    def _deliver(self, stream: _Stream, event: StreamEvent, out: list[Delivery]) -> None:
        """To the relay (admission passes it on) or straight to the client's reply."""
        if stream.relay:
            self._relay(
                stream.relay,
                stream.admission_id,
                RelayedEvent(seq=stream.admission_seq, event=event),
            )
        else:
            out.append((stream.reply, event))


def _aborted(request_id: str, num_prompt_tokens: int) -> FinishedEvent:
    return FinishedEvent(
        request_id=request_id,
        finish_reason="abort",
        token_ids=[],
        exit_depths=[],
        num_prompt_tokens=num_prompt_tokens,
    )


def error_event(request_id: str, code: ErrorCode | str, message: str) -> ErrorEvent:
    return ErrorEvent(request_id=request_id, code=str(code), message=message)
