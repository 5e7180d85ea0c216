"""Scheduler actor: runs ``Scheduler`` over NATS.

``SchedulerDriver`` is the pure part (no NATS, testable alone): it owns the scheduler core,
the batches in flight, the results buffered until they can be applied in seq order, and
each request's stream (reply subject, incremental detokenizer). ``SchedulerService`` is the
shell: it feeds admitted requests, aborts and worker results into the driver, publishes
batches to the worker (msgpack) and stream events to each client's reply subject (JSON).

The loop is the in-process engine's ``step`` spread over the bus: schedule and submit up to
the in-flight limit (1, or ``max_inflight_batches`` with async scheduling), applying
``update_after_submission`` as each batch is published; apply results strictly in seq order
with ``update_from_output``.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from nats.aio.msg import Msg
from tokenizers import Tokenizer

from messages.api import ErrorEvent, FinishedEvent, StreamEvent, TokenEvent
from messages.batch import BatchResult
from messages.errors import ErrorCode, RequestError
from messages.internal import (
    AbortForward,
    AdmittedRequest,
    SchedulerLoad,
    WorkerBatch,
    WorkerResult,
)
from messages.prefix import PrefixEventBatch, ReplayRequest
from services.runtime import subjects
from services.runtime.bus import decode_msgpack, encode_json, encode_msgpack, is_no_responders
from services.runtime.checkpoint import load_model_limits, load_tokenizer
from services.runtime.logging import BATCH_SEQ, get_logger, request_fields
from services.runtime.service import Endpoint, Service
from services.scheduler.batch import ScheduledBatch
from services.scheduler.config import ModelLimits, SchedulerConfig
from services.scheduler.request import RequestPhase
from services.scheduler.scheduler import Scheduler

Delivery = tuple[str, StreamEvent]  # (client reply subject, event)


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


class SchedulerDriver:
    """Scheduler core + streams + in-flight batches; every method returns deliveries."""

    def __init__(
        self,
        config: SchedulerConfig,
        limits: ModelLimits,
        tokenizer: Tokenizer | None = None,
        *,
        instance: str = "local",
        log: Any = None,
    ) -> None:
        self.config = config
        self.limits = limits
        self.tokenizer = tokenizer
        self.instance = instance
        self.log = log or get_logger("scheduler")
        self.max_inflight = config.max_inflight_batches if config.async_scheduling else 1
        self.generation = 0
        self.draining = False
        self.last_admission_seq: dict[str, int] = {}
        self._new_epoch()

    def _new_epoch(self) -> None:
        # the scheduler instance is the prefix-event producer; every new Scheduler starts a
        # new prefix-log epoch, so the prefix cache drops what the previous one published
        self.scheduler = Scheduler(self.config, self.limits, producer_id=self.instance)
        self._prefix_out: list[PrefixEventBatch] = []
        if self.config.enable_prefix_caching:
            self._prefix_out.append(self.scheduler.prefix_log.announce())
        self.epoch = f"{self.instance}.{self.generation}"
        self.streams: dict[str, _Stream] = {}
        self.inflight: deque[ScheduledBatch] = deque()
        self.sent_at: dict[int, float] = {}
        self._results: dict[int, BatchResult] = {}
        self._failed_batches: set[int] = set()

    @property
    def idle(self) -> bool:
        return not self.streams and not self.inflight

    # ------------------------------------------------------------------ requests
    def add(self, req: AdmittedRequest) -> list[Delivery]:
        if req.admission_id:
            seen = self.last_admission_seq.get(req.admission_id, 0)
            self.last_admission_seq[req.admission_id] = max(seen, req.admission_seq)
        fields = request_fields(req.request_id, req.trace_id)
        if self.draining:
            return [
                (
                    req.reply_subject,
                    _error(req.request_id, ErrorCode.UNAVAILABLE, "scheduler is shutting down"),
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
            return [(req.reply_subject, _error(req.request_id, exc.code, exc.message))]
        except Exception as exc:  # a scheduler bug must not take the service down
            self.log.exception("add_request failed", **fields)
            return [
                (
                    req.reply_subject,
                    _error(req.request_id, ErrorCode.INTERNAL, f"scheduler error: {exc!r}"),
                )
            ]
        detok = IncrementalDetokenizer(self.tokenizer) if self.tokenizer else None
        self.streams[req.request_id] = _Stream(
            req.reply_subject, req.trace_id, detok, time.monotonic()
        )
        self.log.info(
            "request added",
            num_prompt_tokens=len(req.prompt_token_ids),
            max_tokens=req.params.max_tokens,
            **fields,
        )
        return []

    def abort(self, request_id: str, requester_reply: str = "") -> list[Delivery]:
        try:
            events = self.scheduler.abort_request(request_id)
        except RequestError as exc:
            if not requester_reply:
                return []
            return [(requester_reply, _error(request_id, exc.code, exc.message))]
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
            # once built, a batch must reach the worker: it carries the KV/request deltas
            batches.append(batch)
            self.inflight.append(batch)
            self.sent_at[batch.seq] = time.monotonic()
            try:
                out += self._route(self.scheduler.update_after_submission(batch))
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
        """Worker gone or a batch lost: fail everything and start a new epoch, so a worker
        (re)joining starts from a clean state and batch seq 0."""
        out = [(s.reply, _error(rid, code, message)) for rid, s in self.streams.items()]
        self.log.error("scheduler reset", reason=message, failed=len(out), epoch=self.epoch)
        self.generation += 1
        self._new_epoch()
        return out

    def take_prefix_events(self) -> list[PrefixEventBatch]:
        """Prefix-event envelopes to publish, in event_seq order."""
        out, self._prefix_out = self._prefix_out, []
        batch = self.scheduler.take_prefix_events()
        if batch is not None:
            out.append(batch)
        return out

    def answer_replay(self, request: ReplayRequest) -> list[PrefixEventBatch]:
        """Re-sends what the prefix cache missed (or a snapshot rebase if it is too old)."""
        return self.scheduler.prefix_log.answer(request, self.scheduler.kv.snapshot_prefix_events)

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
                del self.streams[event.request_id]
                if self.tokenizer is not None:
                    event.text = self.tokenizer.decode(event.token_ids, skip_special_tokens=True)
                self.log.info(
                    "request finished",
                    finish_reason=event.finish_reason,
                    num_tokens=len(event.token_ids),
                    latency_s=round(time.monotonic() - stream.started, 4),
                    **request_fields(event.request_id, stream.trace_id),
                )
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
            stream = self.streams.pop(rid, None)
            if stream is not None:
                self.log.warning(
                    "request failed",
                    code=str(code),
                    reason=message[:300],
                    **request_fields(rid, stream.trace_id),
                )
                out.append((stream.reply, _error(rid, code, message)))
        return out


def _error(request_id: str, code: ErrorCode | str, message: str) -> ErrorEvent:
    return ErrorEvent(request_id=request_id, code=str(code), message=message)


def _request_ids(batch: ScheduledBatch) -> list[str]:
    return list(dict.fromkeys(t.request.request_id for t in batch.tasks))


class SchedulerService(Service):
    name = "scheduler"
    description = "request state, batch selection, progress and logical KV"

    def __init__(
        self,
        nats_url: str,
        checkpoint: str | Path,
        config: SchedulerConfig,
        *,
        batch_timeout_s: float = 300.0,
        load_interval_s: float = 0.25,
        **kwargs: Any,
    ) -> None:
        super().__init__(nats_url, **kwargs)
        self.checkpoint = Path(checkpoint)
        self.config = config
        self.batch_timeout_s = batch_timeout_s
        self.load_interval_s = load_interval_s
        self.driver: SchedulerDriver | None = None
        self._wake = asyncio.Event()
        self._last_load = 0.0

    async def setup(self) -> None:
        self.driver = SchedulerDriver(
            self.config,
            load_model_limits(self.checkpoint),
            load_tokenizer(self.checkpoint),
            instance=self.instance_id,
            log=self.log,
        )

    @property
    def scheduler(self) -> Scheduler:
        assert self.driver is not None
        return self.driver.scheduler

    def endpoints(self) -> Sequence[Endpoint]:
        return (
            Endpoint("submit", subjects.SCHED_SUBMIT, self._on_submit),
            Endpoint("abort", subjects.SCHED_ABORT, self._on_abort),
            Endpoint("load", subjects.SCHED_LOAD_GET, self._on_load_get),
            Endpoint("replay", subjects.prefix_replay(self.instance_id), self._on_replay),
            # plain subscription: it must receive the "no responders" status of our batch
            # publishes (no worker running), which nats-server never gives a queue subscriber
            Endpoint(
                "results",
                subjects.worker_results_of(self.instance_id),
                self._on_result,
                micro=False,
            ),
        )

    async def on_ready(self) -> None:
        self.spawn(self._loop(), "loop")
        self.spawn(self._housekeeping(), "housekeeping")

    async def drain(self, timeout: float) -> None:
        assert self.driver is not None
        self.driver.draining = True
        deadline = time.monotonic() + timeout
        while not self.driver.idle and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if not self.driver.idle:
            await self._deliver(
                self.driver.reset(
                    ErrorCode.UNAVAILABLE, "scheduler shut down before the request finished"
                )
            )

    def health_details(self) -> dict[str, Any]:
        if self.driver is None:
            return {}
        s = self.driver.scheduler
        return {
            "epoch": self.driver.epoch,
            "live_requests": len(s.requests),
            "running": len(s.running),
            "inflight_batches": len(self.driver.inflight),
            "batches": s.stats.num_batches,
            "free_kv_blocks": s.kv.num_free_blocks,
        }

    # ------------------------------------------------------------------ handlers
    async def _on_submit(self, msg: Msg) -> None:
        assert self.driver is not None
        try:
            req = decode_msgpack(msg.data, AdmittedRequest)
        except msgspec.DecodeError as exc:  # version skew with admission: nowhere to answer
            self.log.error("undecodable submit", error=str(exc))
            return
        await self._deliver(self.driver.add(req))
        self._wake.set()

    async def _on_abort(self, msg: Msg) -> None:
        assert self.driver is not None
        try:
            abort = decode_msgpack(msg.data, AbortForward)
        except msgspec.DecodeError as exc:
            self.log.error("undecodable abort", error=str(exc))
            return
        self.log.info("abort received", **request_fields(abort.request_id, abort.trace_id))
        await self._deliver(self.driver.abort(abort.request_id, abort.reply_subject))
        self._wake.set()

    async def _on_replay(self, msg: Msg) -> None:
        assert self.driver is not None
        try:
            request = decode_msgpack(msg.data, ReplayRequest)
        except msgspec.DecodeError as exc:
            self.log.error("undecodable replay request", error=str(exc))
            return
        batches = self.driver.answer_replay(request)
        self.log.info("prefix replay", from_seq=request.from_seq, envelopes=len(batches))
        await self._publish_prefix(batches)

    async def _publish_prefix(self, batches: list[PrefixEventBatch]) -> None:
        for batch in batches:
            await self.nc.publish(subjects.PREFIX_EVENTS, encode_msgpack(batch))

    async def _on_load_get(self, msg: Msg) -> None:
        assert self.driver is not None
        if msg.reply:
            await self.nc.publish(msg.reply, encode_msgpack(self.driver.load()))

    async def _on_result(self, msg: Msg) -> None:
        assert self.driver is not None
        epoch = msg.subject[len(subjects.WORKER_RESULT) + 1 :]
        if epoch != self.driver.epoch:
            return  # a result or status from before a reset
        if is_no_responders(msg):
            await self._deliver(
                self.driver.reset(
                    ErrorCode.UNAVAILABLE, f"no worker is serving {subjects.WORKER_BATCH}"
                )
            )
            self._wake.set()
            return
        try:
            wr = decode_msgpack(msg.data, WorkerResult)
        except msgspec.DecodeError as exc:
            self.log.error("undecodable worker result", error=str(exc))
            return
        if wr.epoch == self.driver.epoch and self.driver.on_result(wr.result):
            self._wake.set()

    # ------------------------------------------------------------------ loop
    async def _loop(self) -> None:
        driver = self.driver
        assert driver is not None
        while True:
            self._wake.clear()
            applied, out = driver.apply_results()
            batches, more = driver.schedule()
            # batches first: the worker is the critical path, clients can wait a moment
            for batch in batches:
                await self._publish_batch(batch)
            await self._deliver(out)
            await self._deliver(more)
            await self._publish_prefix(driver.take_prefix_events())
            if applied or batches:
                await self._maybe_publish_load()
                continue
            await self._wake.wait()

    async def _publish_batch(self, batch: ScheduledBatch) -> None:
        assert self.driver is not None
        cfg = self.config
        wb = WorkerBatch(
            epoch=self.driver.epoch,
            batch=batch.wire,
            num_blocks=cfg.num_blocks,
            block_size=cfg.block_size,
            kv_layout=str(cfg.kv_layout),
        )
        self.log.debug(
            "batch sent", phase=str(batch.phase), rows=len(batch.tasks), **{BATCH_SEQ: batch.seq}
        )
        await self.nc.publish(
            subjects.WORKER_BATCH,
            encode_msgpack(wb),
            reply=subjects.worker_result(self.driver.epoch),
        )

    async def _deliver(self, deliveries: list[Delivery]) -> None:
        for subject, event in deliveries:
            try:
                await self.nc.publish(subject, encode_json(event))
            except Exception as exc:  # e.g. a client that vanished with a bad inbox
                self.log.warning("delivery failed", error=repr(exc), request_id=event.request_id)

    async def _maybe_publish_load(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_load < 0.02:
            return
        assert self.driver is not None
        self._last_load = now
        await self.nc.publish(subjects.SCHED_LOAD, encode_msgpack(self.driver.load()))

    async def _housekeeping(self) -> None:
        """Periodic load reports, and the watchdog for batches that never come back."""
        assert self.driver is not None
        last_repub = time.monotonic()
        while True:
            await asyncio.sleep(self.load_interval_s)
            await self._maybe_publish_load(force=True)
            if self.config.enable_prefix_caching and time.monotonic() - last_repub > 1.0:
                last_repub = time.monotonic()
                # re-publishing the newest envelope lets a consumer that missed the tail
                # notice the gap (it drops it as a duplicate otherwise)
                latest = self.driver.scheduler.prefix_log.latest()
                await self._publish_prefix([latest] if latest is not None else [])
            age = self.driver.oldest_inflight_age(time.monotonic())
            if age > self.batch_timeout_s:
                seq = self.driver.inflight[0].seq
                await self._deliver(
                    self.driver.reset(
                        ErrorCode.UNAVAILABLE, f"worker did not answer batch {seq} in {age:.0f}s"
                    )
                )
                self._wake.set()
