"""Publishes a scheduler's prefix-event envelopes to the JetStream event stream.

Order is the contract: envelopes reach the stream in ``event_seq`` order, because each stream
message is acknowledged by JetStream before the next is sent. A message whose ack is lost is
sent again with the same ``Nats-Msg-Id``, which the stream stores once (within its duplicate
window); the index ignores a seq it has applied anyway. Under load, consecutive envelopes are
coalesced into one message (a msgpack list), so one ack round trip covers many steps.

The step loop never waits for JetStream: ``submit`` queues and returns. If the queue outgrows
``max_pending_bytes`` (the bus was gone for long), it is dropped and the producer rebases: a
new epoch whose first envelope is its whole cache, so consumers converge without what was lost.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.js import errors as js_errors

from messages.prefix import BlockRemoved, BlockStored, PrefixEvent, PrefixEventBatch
from services.runtime import jetstream, subjects
from services.runtime.bus import PAYLOAD_HEADROOM

_ENCODER = msgspec.msgpack.Encoder()
# msgpack spends at most 9 bytes on a 64-bit hash; the rest of an event takes at most this
_HASH_BYTES = 9
_EVENT_OVERHEAD = 128


# ---------------------------------------------------------------------- pure helpers
def _pieces(event: PrefixEvent, max_hashes: int) -> list[PrefixEvent]:
    """An event with more hashes than fit one message, cut into consecutive events."""
    if not isinstance(event, BlockStored | BlockRemoved) or len(event.block_hashes) <= max_hashes:
        return [event]
    hashes = event.block_hashes
    chunks = [hashes[i : i + max_hashes] for i in range(0, len(hashes), max_hashes)]
    if isinstance(event, BlockRemoved):
        return [BlockRemoved(block_hashes=c) for c in chunks]
    out: list[PrefixEvent] = []
    parent = event.parent_hash
    for chunk in chunks:  # the chain goes on: each piece's parent is the last hash before it
        out.append(
            BlockStored(
                block_hashes=chunk,
                parent_hash=parent,
                num_tokens_per_block=event.num_tokens_per_block,
                batch_seq=event.batch_seq,
            )
        )
        parent = chunk[-1]
    return out


def split_envelope(batch: PrefixEventBatch, max_bytes: int) -> list[PrefixEventBatch]:
    """``batch`` as parts that each encode to at most ``max_bytes`` (usually one part)."""
    if len(_ENCODER.encode(batch)) <= max_bytes:
        return [batch]
    # what the envelope around the events takes (its part numbers at their widest)
    shell = PrefixEventBatch(
        producer_id=batch.producer_id,
        epoch=batch.epoch,
        event_seq=batch.event_seq,
        part=2**32,
        num_parts=2**32,
    )
    budget = max_bytes - len(_ENCODER.encode(shell))
    max_hashes = max((budget - _EVENT_OVERHEAD) // _HASH_BYTES, 1)
    groups: list[list[PrefixEvent]] = [[]]
    used = 0
    for event in batch.events:
        for piece in _pieces(event, max_hashes):
            size = len(_ENCODER.encode(piece))
            if groups[-1] and used + size > budget:
                groups.append([])
                used = 0
            groups[-1].append(piece)
            used += size
    return [
        PrefixEventBatch(
            producer_id=batch.producer_id,
            epoch=batch.epoch,
            event_seq=batch.event_seq,
            events=group,
            part=i,
            num_parts=len(groups),
        )
        for i, group in enumerate(groups)
    ]


def message_id(first: PrefixEventBatch, last: PrefixEventBatch) -> str:
    """Nats-Msg-Id of a stream message: the same envelopes always get the same id."""
    return (
        f"{first.producer_id}:{first.epoch}:{first.event_seq}.{first.part}"
        f"-{last.event_seq}.{last.part}"
    )


@dataclass
class _Pending:
    envelope: PrefixEventBatch
    size: int


class PendingEnvelopes:
    """The queue of envelope parts not yet in the stream, coalesced into messages. Pure."""

    def __init__(self, max_message_bytes: int, max_pending_bytes: int) -> None:
        self.max_message_bytes = max_message_bytes
        self.max_pending_bytes = max_pending_bytes
        self._queue: deque[_Pending] = deque()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, batch: PrefixEventBatch) -> bool:
        """Queues ``batch``; False when the queue is over its bound (the caller rebases)."""
        for part in split_envelope(batch, self.max_message_bytes):
            size = len(_ENCODER.encode(part))
            self._queue.append(_Pending(part, size))
            self.bytes += size
        return self.bytes <= self.max_pending_bytes

    def clear(self) -> None:
        self._queue.clear()
        self.bytes = 0

    def head(self) -> tuple[list[PrefixEventBatch], bytes, str] | None:
        """The next message: as many queued parts as fit, its body and its Nats-Msg-Id."""
        if not self._queue:
            return None
        taken: list[PrefixEventBatch] = []
        used = 8  # the list header
        for item in self._queue:
            if taken and used + item.size > self.max_message_bytes:
                break
            taken.append(item.envelope)
            used += item.size
        return taken, _ENCODER.encode(taken), message_id(taken[0], taken[-1])

    def pop(self, count: int) -> None:
        for _ in range(count):
            self.bytes -= self._queue.popleft().size


# ---------------------------------------------------------------------- the NATS side
class PrefixPublisher:
    def __init__(
        self,
        nc: NATS,
        producer_id: str,
        *,
        rebase: Callable[[], PrefixEventBatch],
        log: Any,
        max_pending_bytes: int = 64 << 20,
        ack_timeout_s: float = 2.0,
    ) -> None:
        self.nc = nc
        self.subject = subjects.prefix_events(producer_id)
        self.rebase = rebase
        self.log = log
        self.ack_timeout_s = ack_timeout_s
        self.pending = PendingEnvelopes(nc.max_payload - PAYLOAD_HEADROOM, max_pending_bytes)
        self.num_messages = 0
        self.num_envelopes = 0
        self.num_retries = 0
        self.num_rebases = 0
        self.last_stream_seq = 0
        # the last rebase's epoch: batches of older epochs are inside its snapshot already
        self._floor = ""
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()

    def submit(self, batches: Iterable[PrefixEventBatch]) -> None:
        """Queues envelopes (in event_seq order) and returns at once."""
        for batch in batches:
            if batch.epoch < self._floor:  # (epochs sort by time: prefix_events.new_epoch)
                continue
            if not self.pending.add(batch):
                self._rebase(f"over {self.pending.max_pending_bytes} bytes wait for the stream")
        if len(self.pending):
            self._idle.clear()
            self._wake.set()

    def _rebase(self, why: str) -> None:
        self.pending.clear()
        self.num_rebases += 1  # (what was in flight before it is not the queue's head)
        snapshot = self.rebase()
        self._floor = snapshot.epoch
        self.log.warning("prefix events rebased", reason=why, epoch=snapshot.epoch)
        self.pending.add(snapshot)

    async def flush(self, timeout: float) -> bool:
        """Waits until everything queued is in the stream (graceful drain)."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def stats(self) -> dict[str, Any]:
        return {
            "published_messages": self.num_messages,
            "published_envelopes": self.num_envelopes,
            "pending_envelopes": len(self.pending),
            "retries": self.num_retries,
            "rebases": self.num_rebases,
            "stream_seq": self.last_stream_seq,
        }

    async def run(self) -> None:
        """The publishing loop (a service background task)."""
        await jetstream.retry_transient(
            lambda: jetstream.ensure_event_stream(self.nc, log=self.log), 60.0, self.log, "stream"
        )
        await self.publish_loop()

    async def publish_loop(self) -> None:
        """Publishes the queue's head until the queue is empty, then waits for more."""
        while True:
            head = self.pending.head()
            if head is None:
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            parts, body, msg_id = head
            rebases = self.num_rebases
            stored = await self._publish(body, msg_id)
            if rebases != self.num_rebases:
                # rebased while it was in flight: the queue holds the new epoch now (what
                # was sent belongs to the old one, which the index ignores)
                continue
            if not stored:
                self._rebase("the event stream refused a message")
                continue
            self.pending.pop(len(parts))
            self.num_messages += 1
            self.num_envelopes += sum(1 for p in parts if p.part == p.num_parts - 1)

    async def _publish(self, body: bytes, msg_id: str) -> bool:
        """Until JetStream has stored it (the same id on every try: stored once). False when
        the stream keeps refusing it (a config it cannot take): the caller rebases."""
        js = self.nc.jetstream()
        delay = 0.05
        failures = 0
        while True:
            while not self.nc.is_connected:  # a publish now would only pile up in the buffer
                await asyncio.sleep(0.05)
            try:
                ack = await js.publish(
                    self.subject,
                    body,
                    timeout=self.ack_timeout_s,
                    headers={"Nats-Msg-Id": msg_id},
                )
                self.last_stream_seq = ack.seq
                return True
            except (js_errors.NoStreamResponseError, js_errors.NotFoundError):
                # the stream is gone (a NATS restart without its store): make it again
                await self._ensure_stream()
            except js_errors.BadRequestError as exc:
                failures += 1
                self.log.error("event stream refused a message", error=repr(exc)[:200])
                if failures >= 5:
                    return False
            except (*jetstream.TRANSIENT, nats.errors.Error) as exc:
                failures += 1
                if failures in (1, 10) or failures % 100 == 0:
                    self.log.warning(
                        "prefix event publish failed; retrying",
                        error=repr(exc)[:200],
                        failures=failures,
                    )
            self.num_retries += 1
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def _ensure_stream(self) -> None:
        try:
            await jetstream.ensure_event_stream(self.nc, log=self.log)
        except Exception as exc:  # retried by the caller's loop
            self.log.warning("event stream unavailable", error=repr(exc)[:200])
