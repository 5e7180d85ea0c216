"""The scheduler service's pure core: ``SchedulerDriver`` (no NATS, testable alone).

It owns the scheduler core, the batches in flight, the results buffered until they can be
applied in seq order, and each request's stream (reply subject, incremental detokenizer).
The loop is the in-process engine's ``step`` spread over the bus: schedule and submit up to
the in-flight limit, applying ``update_after_submission`` as each batch is published; apply
results strictly in seq order with ``update_from_output``. The NATS shell is ``service.py``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

from messages.api import ErrorEvent, FinishedEvent, StreamEvent, TokenEvent
from messages.batch import BatchResult
from messages.errors import ErrorCode, RequestError
from messages.internal import (
    AdmittedRequest,
    RequestNotice,
    SchedulerLoad,
)
from messages.prefix import PrefixEventBatch
from services.common.config import ModelLimits, SchedulerConfig
from services.runtime import subjects
from services.runtime.logging import BATCH_SEQ, get_logger, log_content_enabled, request_fields
from services.scheduler.batch import ScheduledBatch
from services.scheduler.request import RequestPhase
from services.scheduler.scheduler import Scheduler

Delivery = tuple[str, StreamEvent]  # (client reply subject, event)
Notice = tuple[str, RequestNotice]  # (admission tracking subject, notice)


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas without re-decoding everything.

    Decodes a short window ``[prefix_offset:]`` and emits what it adds over
    ``[prefix_offset:read_offset]``; holds text back while it ends in an incomplete UTF-8
    sequence (U+FFFD), so multi-byte characters split over tokens arrive whole.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        full = decode(self.ids[self.prefix_offset :], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full[len(prefix) :]
        return ""


@dataclass
class _Stream:
    reply: str
    trace_id: str
    detok: IncrementalDetokenizer | None
    started: float
    track: str = ""  # admission's tracking subject ("" = nobody tracks it)
    no: int = 0  # names the stream in its "gone" reply subject


class SchedulerDriver:
    """Scheduler core + streams + in-flight batches; every method returns deliveries."""

    def __init__(
        self,
        config: SchedulerConfig,
        limits: ModelLimits,
        tokenizer: Tokenizer | None = None,
        *,
        instance: str = "local",
        producer_id: str | None = None,
        log: Any = None,
    ) -> None:
        self.config = config
        self.limits = limits
        self.tokenizer = tokenizer
        self.instance = instance
        # the prefix-event producer name outlives this process (RLT_SCHEDULER_NAME): a
        # restarted scheduler announces a newer epoch under the same name, and the prefix
        # cache drops everything the old one published
        self.producer_id = producer_id or instance
        self.log = log or get_logger("scheduler")
        self.max_inflight = config.max_inflight_batches if config.async_scheduling else 1
        self.generation = 0
        self.draining = False
        self.last_admission_seq: dict[str, int] = {}
        self.notices: list[Notice] = []
        self.num_worker_losses = 0
        self._stream_nos = 0
        self._new_epoch()

    def _new_epoch(self) -> None:
        # every new Scheduler starts a new prefix-log epoch, so the prefix cache drops what
        # the previous one published
        self.scheduler = Scheduler(self.config, self.limits, producer_id=self.producer_id)
        if self.config.enable_prefix_caching:
            self.scheduler.prefix_log.announce()
        self.streams: dict[str, _Stream] = {}
        self.by_no: dict[int, str] = {}
        self._new_worker_epoch()

    def _new_worker_epoch(self) -> None:
        """A fresh epoch towards the worker: batch results and statuses of older epochs are
        ignored, and the worker resets its device state when it sees the new epoch."""
        self.epoch = f"{self.instance}.{self.generation}"
        self.worker_id: str | None = None  # the worker this epoch's batches go to
        self.epoch_start_seq: int | None = None  # seq of this epoch's first batch
        self.inflight: deque[ScheduledBatch] = deque()
        self.sent_at: dict[int, float] = {}
        self._results: dict[int, BatchResult] = {}
        self._failed_batches: set[int] = set()

    @property
    def idle(self) -> bool:
        return not self.streams and not self.inflight

    # ------------------------------------------------------------------ workers
    def bind(self, worker_id: str) -> None:
        """Sends this epoch's batches to ``worker_id``. Switching after batches went to
        another worker means that worker's device state is out of reach: recompute."""
        if self.worker_id == worker_id:
            return
        if self.epoch_start_seq is not None:
            self.worker_lost(f"switching to worker {worker_id}")
        self.worker_id = worker_id
        self.log.info("worker bound", worker=worker_id, epoch=self.epoch)

    def worker_lost(self, reason: str) -> list[str]:
        """The bound worker's device state is gone or unreachable (dead, hung, draining, a
        batch or result lost). New epoch; every running request returns to the queue with its
        outputs kept and is recomputed on the next worker, so clients see a delay, not an
        error, and the outputs equal an uninterrupted run. Results still arriving from the
        old epoch are ignored, so nothing is applied twice. Returns the recomputed ids."""
        lost_worker, lost_batches = self.worker_id, [b.seq for b in self.inflight]
        self.generation += 1
        self._new_worker_epoch()
        affected = self.scheduler.reset_after_worker_loss()
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
    def add(self, req: AdmittedRequest, track: str = "") -> list[Delivery]:
        """Queues an admitted request. ``track`` is admission's tracking subject: it hears
        "accepted" now and "done" when the stream's terminal event is published."""
        if req.admission_id:
            seen = self.last_admission_seq.get(req.admission_id, 0)
            self.last_admission_seq[req.admission_id] = max(seen, req.admission_seq)
        fields = request_fields(req.request_id, req.trace_id)
        live = self.streams.get(req.request_id)
        if live is not None:
            # a client's retry of a live request (same request_id): no second generation;
            # the stream goes on to the retry's reply subject and tracking subject
            live.reply, live.track = req.reply_subject, track
            self._notice(track, req.request_id, "accepted")
            self.log.info("request re-attached", **fields)
            return []
        if self.draining:
            self._notice(track, req.request_id, "done")
            return [
                (
                    req.reply_subject,
                    error_event(
                        req.request_id, ErrorCode.UNAVAILABLE, "scheduler is shutting down"
                    ),
                )
            ]
        try:
            # the prefix hint (req.num_cached_tokens_hint) is not passed on: add_request has
            # no parameter for it yet, and the scheduler re-checks hits itself anyway
            self.scheduler.add_request(
                req.request_id, req.prompt_token_ids, req.params, trace_id=req.trace_id
            )
        except RequestError as exc:
            self.log.info("request refused", code=str(exc.code), reason=exc.message[:200], **fields)
            self._notice(track, req.request_id, "done")
            return [(req.reply_subject, error_event(req.request_id, exc.code, exc.message))]
        except Exception as exc:  # a scheduler bug must not take the service down
            self.log.exception("add_request failed", **fields)
            self._notice(track, req.request_id, "done")
            return [
                (
                    req.reply_subject,
                    error_event(req.request_id, ErrorCode.INTERNAL, f"scheduler error: {exc!r}"),
                )
            ]
        detok = IncrementalDetokenizer(self.tokenizer) if self.tokenizer else None
        self._stream_nos += 1
        self.streams[req.request_id] = _Stream(
            req.reply_subject, req.trace_id, detok, time.monotonic(), track, self._stream_nos
        )
        self.by_no[self._stream_nos] = req.request_id
        self._notice(track, req.request_id, "accepted")
        extra: dict[str, Any] = {}
        if log_content_enabled():
            extra["prompt_token_ids"] = req.prompt_token_ids
        self.log.info(
            "request added",
            num_prompt_tokens=len(req.prompt_token_ids),
            max_tokens=req.params.max_tokens,
            **extra,
            **fields,
        )
        return []

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

    def take_notices(self) -> list[Notice]:
        out, self.notices = self.notices, []
        return out

    def gone_subject(self, request_id: str) -> str:
        """Reply subject for this stream's events ("" if the stream is not live)."""
        stream = self.streams.get(request_id)
        return subjects.stream_gone(self.instance, stream.no) if stream else ""

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
            self._notice(stream.track, request_id, "done", finished)
        return stream

    def abort(self, request_id: str, requester_reply: str = "") -> list[Delivery]:
        try:
            events = self.scheduler.abort_request(request_id)
        except RequestError as exc:
            if not requester_reply:
                return []
            return [(requester_reply, error_event(request_id, exc.code, exc.message))]
        out = self._route(events)
        if requester_reply:
            # the abort requester gets the same terminal event as the stream
            out += [(requester_reply, e) for _, e in out if isinstance(e, FinishedEvent)]
        return out

    # ------------------------------------------------------------------ batches
    def schedule(self) -> tuple[list[ScheduledBatch], list[Delivery]]:
        """Builds batches up to the in-flight limit, applying submission-time progress."""
        batches: list[ScheduledBatch] = []
        out: list[Delivery] = []
        while len(self.inflight) < self.max_inflight:
            try:
                batch = self.scheduler.schedule()
            except Exception as exc:
                # cannot tell which request broke selection: fail every live request
                self.log.exception("schedule failed")
                out += self._fail(
                    list(self.scheduler.requests), ErrorCode.INTERNAL, f"scheduler error: {exc!r}"
                )
                break
            if batch is None:
                break
            if self.epoch_start_seq is None:
                self.epoch_start_seq = batch.seq
            # once built, a batch must reach the worker: it carries the KV/request deltas
            batches.append(batch)
            self.inflight.append(batch)
            self.sent_at[batch.seq] = time.monotonic()
            try:
                self.scheduler.update_after_submission(batch)
            except Exception as exc:
                self.log.exception("update_after_submission failed", **{BATCH_SEQ: batch.seq})
                self._failed_batches.add(batch.seq)
                out += self._fail(
                    _request_ids(batch),
                    ErrorCode.INTERNAL,
                    f"scheduler error on batch {batch.seq}: {exc!r}",
                )
        return batches, out

    def on_result(self, result: BatchResult) -> bool:
        """Buffers a result; False if it belongs to no batch in flight (stale/duplicate)."""
        if not self.inflight or not (self.inflight[0].seq <= result.seq <= self.inflight[-1].seq):
            return False
        self._results[result.seq] = result
        return True

    def apply_results(self) -> tuple[int, list[Delivery]]:
        """Applies buffered results strictly in seq order; returns (#applied, deliveries)."""
        applied = 0
        out: list[Delivery] = []
        while self.inflight and self.inflight[0].seq in self._results:
            batch = self.inflight.popleft()
            result = self._results.pop(batch.seq)
            self.sent_at.pop(batch.seq, None)
            applied += 1
            if batch.seq in self._failed_batches:
                self._failed_batches.discard(batch.seq)
                continue
            if result.error is not None:
                self.log.error(
                    "worker failed batch", error=result.error[:500], **{BATCH_SEQ: batch.seq}
                )
                out += self._fail(
                    _request_ids(batch),
                    ErrorCode.INTERNAL,
                    f"worker failed batch {batch.seq}: {result.error}",
                )
                continue
            try:
                out += self._route(self.scheduler.update_from_output(batch, result))
            except Exception as exc:
                self.log.exception("update_from_output failed", **{BATCH_SEQ: batch.seq})
                out += self._fail(
                    _request_ids(batch),
                    ErrorCode.INTERNAL,
                    f"scheduler error on batch {batch.seq}: {exc!r}",
                )
        return applied, out

    def reset(self, code: ErrorCode, message: str) -> list[Delivery]:
        """Gives up on everything (shutdown after the drain timeout): every stream ends with
        an error and a fresh scheduler starts a new epoch."""
        out = [(s.reply, error_event(rid, code, message)) for rid, s in self.streams.items()]
        for rid in list(self.streams):
            self._ended(rid)
        self.log.error("scheduler reset", reason=message, failed=len(out), epoch=self.epoch)
        self.generation += 1
        self._new_epoch()
        return out

    def take_prefix_events(self) -> list[PrefixEventBatch]:
        """Prefix-event envelopes to publish, in event_seq order: every one the log emitted,
        also those the core emits on its own (AllBlocksCleared after a worker loss)."""
        self.scheduler.take_prefix_events()
        return self.scheduler.prefix_log.take_emitted()

    def oldest_inflight_age(self, now: float) -> float:
        if not self.inflight:
            return 0.0
        return now - self.sent_at.get(self.inflight[0].seq, now)

    def load(self) -> SchedulerLoad:
        waiting = [r for r in self.scheduler.requests.values() if r.phase == RequestPhase.WAITING]
        return SchedulerLoad(
            scheduler_id=self.instance,
            num_waiting=len(waiting),
            num_waiting_tokens=sum(r.num_prompt_tokens for r in waiting),
            num_running=len(self.scheduler.running),
            last_admission_seq=dict(self.last_admission_seq),
            time=time.time(),
        )

    # ------------------------------------------------------------------ streams
    def _route(self, events: Iterable[StreamEvent]) -> list[Delivery]:
        out: list[Delivery] = []
        for event in events:
            stream = self.streams.get(event.request_id)
            if stream is None:
                continue
            if isinstance(event, TokenEvent):
                if stream.detok is not None:
                    event.text = stream.detok.push(event.token_id)
            elif isinstance(event, FinishedEvent):
                if self.tokenizer is not None:
                    event.text = self.tokenizer.decode(event.token_ids, skip_special_tokens=True)
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
            out.append((stream.reply, event))
        return out

    def _fail(self, request_ids: Iterable[str], code: ErrorCode, message: str) -> list[Delivery]:
        """Ends these requests with one error event each, freeing their KV."""
        out: list[Delivery] = []
        for rid in request_ids:
            if rid in self.scheduler.requests:
                try:
                    self.scheduler.abort_request(rid)  # its "abort" event is replaced below
                except Exception:
                    self.log.exception("abort after failure failed", request_id=rid)
            stream = self._ended(rid)
            if stream is not None:
                self.log.warning(
                    "request failed",
                    code=str(code),
                    reason=message[:300],
                    **request_fields(rid, stream.trace_id),
                )
                out.append((stream.reply, error_event(rid, code, message)))
        return out


def error_event(request_id: str, code: ErrorCode | str, message: str) -> ErrorEvent:
    return ErrorEvent(request_id=request_id, code=str(code), message=message)


def _request_ids(batch: ScheduledBatch) -> list[str]:
    return list(dict.fromkeys(t.request.request_id for t in batch.tasks))
