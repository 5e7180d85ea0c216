"""The prefix index's side of the event stream: a durable pull consumer, read in order, and
the snapshots that let a restarted index replay only the tail.

Position: the index remembers the last stream sequence it applied (``index.stream_seq``, also
in every snapshot). The consumer is durable (named after the index replica, replicated like
the stream, so it outlives a NATS node), but the in-memory index is only as new as what it
loaded, so at start the consumer is (re)created at ``stream_seq + 1``. Messages are acked in
batches (AckPolicy.ALL); ``nats consumer info RLT_PREFIX_EVENTS <name>`` shows the lag.

Holes in the stream sequence: a message that went missing on the way (a NATS node died with
it in flight) is still in the stream, so the consumer is recreated where the index stands and
reads it again. Messages no longer in the stream (aged out or pushed out by the size limit
before the index read them, or the stream was recreated empty) cannot be replayed: the index
drops every producer's blocks (``forget_all``) and goes on; producers repopulate it.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.js import api as js_api
from nats.js import errors as js_errors

from messages.prefix import PrefixEventBatch, PrefixIndexSnapshot
from services.prefix_cache.core import PrefixIndex
from services.runtime import jetstream
from services.runtime.bus import decode_msgpack, encode_msgpack

_FETCH_BATCH = 512
_ENVELOPES = msgspec.msgpack.Decoder(list[PrefixEventBatch])


class _Resync(Exception):
    """The stream sequence jumped: find out why and restart the consumer."""

    def __init__(self, after: int, to: int) -> None:
        super().__init__(f"stream seq jumped from {after} to {to}")
        self.jump = (after, to)


class EventReader:
    def __init__(self, nc: NATS, index: PrefixIndex, name: str, log: Any) -> None:
        self.nc = nc
        self.index = index
        self.durable = f"rlt-prefix-index-{name}"
        self.log = log
        self.num_messages = 0  # stream messages applied since this process started
        self.num_envelopes = 0
        self.num_undecodable = 0
        self.num_resyncs = 0
        self.num_lost = 0  # times the stream had lost messages the index had not read
        self.caught_up = asyncio.Event()  # the index has read what the stream held at start
        self._stream_created: Any = None
        self._target = 0  # the stream's last seq when we started reading
        self._last_jump: tuple[int, int] | None = None

    async def run(self) -> None:
        while True:
            try:
                await self._read()
            except asyncio.CancelledError:
                raise
            except _Resync as resync:
                self.num_resyncs += 1
                self._after_jump(*resync.jump)
            except Exception as exc:  # node loss, consumer gone, reconnecting: start over
                self.log.warning("event stream read failed; resuming", error=repr(exc)[:200])
                await asyncio.sleep(0.5)

    async def _read(self) -> None:
        js = self.nc.jetstream()
        await jetstream.ensure_event_stream(self.nc, log=self.log)
        info = await js.stream_info(jetstream.EVENT_STREAM)
        self._check_position(info)
        start = self.index.stream_seq + 1
        self._target = info.state.last_seq
        if self.index.stream_seq >= self._target:
            self.caught_up.set()
        sub = await self._consumer(js, start)
        try:
            while True:
                try:
                    msgs = await sub.fetch(_FETCH_BATCH, timeout=1.0)
                except (nats.errors.TimeoutError, TimeoutError):
                    msgs = []
                if not msgs:
                    self.caught_up.set()  # nothing more right now
                    continue
                self._apply(msgs)
                await msgs[-1].ack()  # AckPolicy.ALL: everything up to it
                if self.index.stream_seq >= self._target:
                    self.caught_up.set()
        finally:
            await sub.unsubscribe()

    def _check_position(self, info: js_api.StreamInfo) -> None:
        """Drops what the index cannot vouch for when the stream lost what it had not read."""
        state, index = info.state, self.index
        recreated = (
            self._stream_created is not None and info.created != self._stream_created
        ) or state.last_seq < index.stream_seq
        self._stream_created = info.created
        if recreated:
            self._lost("the event stream was recreated")
            index.stream_seq = 0
        elif index.stream_seq and state.first_seq > index.stream_seq + 1:
            self._lost(f"stream messages {index.stream_seq + 1}..{state.first_seq - 1} aged out")
            index.stream_seq = state.first_seq - 1

    def _after_jump(self, after: int, to: int) -> None:
        """A consumer restarted at ``after + 1`` that jumps again to ``to``: those messages
        are gone from the middle of the stream (deleted, or lost by JetStream), and no
        restart will bring them; what the index cannot vouch for is dropped, and reading
        goes on from ``to``."""
        if self._last_jump == (after, to):
            self._lost(f"stream messages {after + 1}..{to - 1} are gone")
            self.index.stream_seq = to - 1
            self._last_jump = None
        else:
            self._last_jump = (after, to)

    def _lost(self, why: str) -> None:
        self.num_lost += 1
        self.log.warning("prefix events lost; every producer's blocks dropped", reason=why)
        self.index.forget_all()

    async def _consumer(self, js: Any, start: int) -> Any:
        with contextlib.suppress(js_errors.NotFoundError):
            await js.delete_consumer(jetstream.EVENT_STREAM, self.durable)
        config = js_api.ConsumerConfig(
            durable_name=self.durable,
            description="rlt prefix index",
            deliver_policy=js_api.DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=start,
            ack_policy=js_api.AckPolicy.ALL,
            max_ack_pending=10 * _FETCH_BATCH,
            inactive_threshold=24 * 3600.0,  # a replica renamed for good does not leak one
        )
        await js.add_consumer(jetstream.EVENT_STREAM, config)
        return await js.pull_subscribe_bind(durable=self.durable, stream=jetstream.EVENT_STREAM)

    def _apply(self, msgs: list[Any]) -> None:
        index = self.index
        for msg in msgs:
            seq = msg.metadata.sequence.stream
            if seq <= index.stream_seq:
                continue  # delivered again after a resync
            if seq > index.stream_seq + 1:
                raise _Resync(index.stream_seq, seq)
            try:
                envelopes = _ENVELOPES.decode(msg.data)
            except msgspec.DecodeError as exc:  # not ours (or fuzz): skip, never stop reading
                self.num_undecodable += 1
                self.log.error("undecodable prefix events", error=str(exc)[:200], seq=seq)
                envelopes = []
            for envelope in envelopes:
                outcome = index.apply(envelope)
                if outcome.new_epoch:
                    self.log.info(
                        "producer epoch changed; its blocks dropped",
                        producer=envelope.producer_id,
                        epoch=envelope.epoch,
                    )
                if outcome.gap:
                    self.log.warning(
                        "prefix events missing; the producer's blocks dropped",
                        producer=envelope.producer_id,
                        event_seq=envelope.event_seq,
                    )
            index.stream_seq = seq
            self.num_messages += 1
            self.num_envelopes += len(envelopes)


class SnapshotStore:
    """The index's snapshots in the JetStream object store, one object per index replica."""

    def __init__(self, nc: NATS, name: str, log: Any) -> None:
        self.nc = nc
        self.object_name = f"snapshot-{name}"
        self.log = log
        self._written_mark: tuple[int, int] | None = None  # (stream_seq, local changes)
        self.num_written = 0
        self._store: Any = None

    async def _bucket(self) -> Any:
        if self._store is None:
            self._store = await jetstream.snapshot_store(self.nc, log=self.log)
        return self._store

    async def load(self) -> PrefixIndexSnapshot | None:
        store = await self._bucket()
        try:
            result = await store.get(self.object_name)
        except js_errors.NotFoundError:
            return None
        try:
            snapshot = decode_msgpack(result.data or b"", PrefixIndexSnapshot)
        except msgspec.DecodeError as exc:  # a snapshot we cannot read: start from the stream
            self.log.error("unreadable index snapshot ignored", error=str(exc)[:200])
            return None
        self._written_mark = (snapshot.stream_seq, 0)  # what an index restored from it says
        return snapshot

    @property
    def written_seq(self) -> int:
        """The stream seq of the stored snapshot (-1: none known)."""
        return self._written_mark[0] if self._written_mark is not None else -1

    def forget_written(self) -> None:
        """The stored snapshot is not what the index holds (it could not be read)."""
        self._written_mark = None

    async def save(self, index: PrefixIndex) -> bool:
        """Writes a snapshot if the index changed since the last one."""
        mark = (index.stream_seq, index.num_local_changes)
        if mark == self._written_mark:
            return False
        snapshot = index.to_snapshot()  # synchronous: a consistent cut of the index
        store = await self._bucket()
        await store.put(self.object_name, encode_msgpack(snapshot))
        self._written_mark = mark
        self.num_written += 1
        return True
