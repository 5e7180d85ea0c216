"""Sends what the driver returns (``StepOutput``) over NATS, in one place: batches to the
bound worker (msgpack, in parts when large), abort answers to their requesters (JSON),
notices to admission's tracking subjects, stream events to admission's relay subject (one
``RelayBatch`` per admission), prefix events to the JetStream publisher. What is about our
streams waits while the fence holds it (``fencing.py``).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import msgspec
from nats.aio.client import Client as NATS

from messages.api import StreamEvent, TokenEvent
from messages.errors import ErrorCode
from messages.internal import RelayBatch, RelayedEvent, WorkerBatch
from messages.kv_transfer import KVHandoff, KVRelease
from services.runtime import subjects
from services.runtime.bus import encode_json, encode_msgpack, fits, publish_chunked
from services.runtime.logging import BATCH_SEQ
from services.scheduler.driver.driver import SchedulerDriver
from services.scheduler.driver.step_output import Relay, StepOutput, StreamKey
from services.scheduler.driver.streams import error_event
from services.scheduler.fencing import Fence, Held
from services.scheduler.prefix_publisher import PrefixPublisher


@dataclass
class StepTimings:
    """Where the scheduler service's time goes per step, summed since start (seconds): the
    bench reads them from the health reply to break the bus overhead down."""

    steps: int = 0  # steps that built or applied something
    step_s: float = 0.0  # EngineCore.step: apply results, schedule, submit
    encode_s: float = 0.0  # msgpack of the batches for the worker
    publish_s: float = 0.0  # handing the batches to the NATS client
    deliver_s: float = 0.0  # relayed events, notices, abort answers: encode + publish
    results: int = 0
    round_trip_s: float = 0.0  # batch sent -> its result received
    worker_s: float = 0.0  # of which the worker held it (received -> result sent)

    def snapshot(self) -> dict[str, float]:
        return dict(self.__dict__)


def for_client(event: StreamEvent) -> StreamEvent:
    """The event with the id the client sent (a tenant's ids are scoped inside)."""
    public = subjects.public_request_id(event.request_id)
    if public == event.request_id:
        return event
    return msgspec.structs.replace(event, request_id=public)


class OutputPublisher:
    def __init__(
        self,
        nc: NATS,
        driver: SchedulerDriver,
        fence: Fence,
        *,
        prefix_publisher: PrefixPublisher | None,
        timings: StepTimings,
        log: Any,
        shard_id: str,
        scheduler_id: str,
    ) -> None:
        self.nc = nc
        self.driver = driver
        self.fence = fence
        self.prefix_publisher = prefix_publisher
        self.timings = timings
        self.log = log
        self.shard_id = shard_id
        self.scheduler_id = scheduler_id
        # outputs go out whole, in the order the driver handed them out (a handler's and the
        # loop's may meet at an await): a stream's events never overtake each other
        self._order = asyncio.Lock()

    async def publish(self, out: StepOutput) -> float:
        """Sends one output of the driver: batches first (the worker is the critical path,
        clients can wait a moment), then abort answers, notices and relayed events. Returns
        the seconds the client-bound part took."""
        # before anything awaits: the envelopes reach the publisher in event_seq order
        self._submit_prefix(out)
        async with self._order:
            return await self._send_output(out)

    def _submit_prefix(self, out: StepOutput) -> None:
        if out.prefix_events and self.prefix_publisher is not None:
            # queued for the JetStream publisher, which keeps event_seq order
            self.prefix_publisher.submit(out.prefix_events)

    async def _send_output(self, out: StepOutput) -> float:
        d = self.driver
        for wb in out.batches:
            await self._publish_batch(wb)
        for handoff in out.kv_releases:
            await self._release_unused(handoff)
        t0 = time.perf_counter()
        for subject, event in out.deliveries:
            data = encode_json(for_client(event))
            await self._send_message(subject, data, key=d.stream_key(event.request_id))
        for subject, notice in out.notices:
            # the try it is about (its tracking subject names it), not the stream's current
            # one: a hand-over "done" to a retry's first admission is about the old try
            key = subjects.track_try(subject) or d.stream_key(notice.request_id)
            await self._send_message(subject, encode_msgpack(notice), key=key)
        await self._send_relays(out.relays)
        return time.perf_counter() - t0

    async def _release_unused(self, handoff: KVHandoff) -> None:
        """Tells a prefill scheduler we will not read a handoff: it frees the blocks now
        (no answer needed; without this message they go after its hold time)."""
        release = KVRelease(handoff_id=handoff.handoff_id, request_id=handoff.request_id)
        try:
            await self.nc.publish(
                subjects.sched_kv_release(handoff.scheduler_id), encode_msgpack(release)
            )
        except Exception as exc:  # its hold time frees them anyway
            self.log.warning("handoff release not sent", error=repr(exc)[:200])

    async def _send_message(
        self, subject: str, data: bytes, reply: str = "", key: StreamKey | None = None
    ) -> None:
        if self.fence.holding():
            self.fence.held.append(Held(subject, data, reply, key))
            return
        try:
            await self.nc.publish(subject, data, reply=reply)
        except Exception as exc:  # e.g. a bad client reply subject: only that stream suffers
            self.log.warning("delivery failed", error=repr(exc)[:200], subject=subject[:100])

    async def release_held(self) -> None:
        """What the fence held, in order (what is still fenced was dropped from it)."""
        async with self._order:
            held, self.fence.held = self.fence.held, []
            if held:
                self.log.info("sending messages held during the outage", count=len(held))
            for message in held:
                await self._send_message(*message)
            await self._send_relays([])

    async def _publish_batch(self, wb: WorkerBatch) -> None:
        d = self.driver
        if wb.epoch != d.epoch:
            return  # its worker was lost while earlier batches went out: it is replanned
        batch = wb.batch
        self.log.debug(
            "batch sent", kind=str(batch.kind), rows=len(batch.rows), **{BATCH_SEQ: batch.seq}
        )
        try:
            t0 = time.perf_counter()
            data = encode_msgpack(wb)
            t1 = time.perf_counter()
            # a batch bigger than max_payload (many new prompts) travels in parts
            await publish_chunked(
                self.nc,
                subjects.worker_batch(wb.worker_id),
                data,
                reply=subjects.worker_result(wb.epoch),
            )
            self.timings.encode_s += t1 - t0
            self.timings.publish_s += time.perf_counter() - t1
        except Exception as exc:  # e.g. the bus dropped and the outbound buffer is full
            if wb.epoch == d.epoch:
                d.worker_lost(f"batch {batch.seq} could not be sent: {exc!r}")

    async def _send_relays(self, relays: list[Relay]) -> None:
        """One message per admission with these events of the streams it relays."""
        fence = self.fence
        if fence.holding():
            fence.held_relays += relays  # unencoded, so a fence check can drop a try's own
            return
        if fence.held_relays:  # those held before go first
            relays, fence.held_relays = fence.held_relays + relays, []
        by_subject: dict[str, list[RelayedEvent]] = {}
        for relay in relays:
            by_subject.setdefault(relay.subject, []).append(relay.item)
        failed = StepOutput()  # what ending a request whose event is too big produced
        messages = [
            (subject, data)
            for subject, items in by_subject.items()
            for data in self._relay_messages(items, failed)
        ]
        self._submit_prefix(failed)  # (taken from the driver just now)
        for subject, data in messages:
            await self._send_message(subject, data)
        if failed:
            await self._send_output(failed)

    def _relay_messages(self, items: list[RelayedEvent], failed: StepOutput) -> list[bytes]:
        """``items`` as RelayBatch messages under the bus's max_payload: split when many,
        and an event too big on its own ends its request with a clear error instead."""

        def encode(part: list[RelayedEvent]) -> bytes:
            return encode_msgpack(
                RelayBatch(shard_id=self.shard_id, scheduler_id=self.scheduler_id, events=part)
            )

        items = [self._fits_client(item, failed) for item in items]
        data = encode(items)
        if fits(self.nc, len(data)):
            return [data]
        if len(items) > 1:
            half = len(items) // 2
            first = self._relay_messages(items[:half], failed)
            return first + self._relay_messages(items[half:], failed)
        (item,) = items
        event = item.event
        if event is None:
            return []  # a resync too big to send: the stream goes on without it
        too_large = self._too_large(event, len(data), failed)
        return [encode([RelayedEvent(seq=item.seq, event=too_large)])]

    def _fits_client(self, item: RelayedEvent, failed: StepOutput) -> RelayedEvent:
        """Admission sends each event on as JSON, larger than here: a first token event with
        the prompt's log-probabilities (the one event that size can surprise) is measured
        as the client will get it."""
        event = item.event
        if not isinstance(event, TokenEvent) or event.prompt_logprobs is None:
            return item
        size = len(encode_json(event))
        if fits(self.nc, size):
            return item
        return RelayedEvent(seq=item.seq, event=self._too_large(event, size, failed))

    def _too_large(self, event: StreamEvent, size: int, failed: StepOutput) -> StreamEvent:
        """The error that replaces an event over NATS max_payload; a live request ends."""
        lower = "prompt_logprobs" if isinstance(event, TokenEvent) else "max_tokens"
        message = (
            f"the {type(event).__name__} of {size} bytes exceeds the NATS max_payload of "
            f"{self.nc.max_payload} bytes; lower {lower} or raise max_payload"
        )
        self.log.error("event too large", size=size, request_id=event.request_id)
        failed.extend(self.driver.fail_request(event.request_id, ErrorCode.INTERNAL, message))
        return error_event(event.request_id, ErrorCode.INTERNAL, message)
