"""Prefix-cache actor: a thin shell around ``PrefixIndex``.

In: the JetStream stream ``RLT_PREFIX_EVENTS`` (msgpack lists of ``PrefixEventBatch``, one
subject per scheduler), read in order by a durable consumer (``stream.py``), and
``rlt.v1.prefix.lookup`` requests (msgpack ``PrefixLookup`` -> ``PrefixLookupReply``).
Every ``RLT_PREFIX_SNAPSHOT_S`` (2 s) the index is written to the object store
``RLT_PREFIX_INDEX`` if it moved; a restarted index loads that snapshot and replays only the
stream after it, so it never asks a producer for anything. Lookups never fail: anything
wrong answers "no hit".
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence
from typing import Any

import msgspec
from nats.aio.msg import Msg

from messages.internal import SchedulerLoad
from messages.prefix import PrefixLookup, blocks_digest
from services.common.config import scheduler_lost_s
from services.prefix_cache.core import PrefixIndex
from services.prefix_cache.liveness import ProducerLiveness
from services.prefix_cache.stream import EventReader, SnapshotStore
from services.runtime import jetstream, subjects
from services.runtime.bus import HEADER_REQUEST_ID, HEADER_TRACE_ID, decode_msgpack, encode_msgpack
from services.runtime.logging import request_fields
from services.runtime.service import Endpoint, Service

_NO_HIT = encode_msgpack({})  # decodes as a PrefixLookupReply with every default (no hit)


class PrefixCacheService(Service):
    name = "prefix-cache"
    description = "global prefix index: which producer caches which block hashes"

    def __init__(
        self,
        nats_url: str,
        *,
        snapshot_interval_s: float | None = None,
        index_name: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(nats_url, **kwargs)
        env = os.environ
        self.snapshot_interval_s = snapshot_interval_s or float(
            env.get("RLT_PREFIX_SNAPSHOT_S", "2.0")
        )
        # one name per index replica: it names the durable consumer and the snapshot object
        self.index_name = index_name or env.get("RLT_PREFIX_CACHE_NAME") or "prefix-cache"
        subjects.prefix_events(self.index_name)  # refuses a name that is no subject token
        self.index = PrefixIndex()
        self.reader: EventReader | None = None
        self.snapshots: SnapshotStore | None = None
        self.restored_seq = 0  # stream seq of the snapshot loaded at start (0: none)
        self.load_s = 0.0
        self.num_lookups = 0
        self.num_hits = 0
        # a shard whose scheduler's reports stopped: its blocks leave the index
        self.liveness = ProducerLiveness(scheduler_lost_s())
        self.dropped_producers: list[str] = []

    async def setup(self) -> None:
        started = time.monotonic()
        self.snapshots = SnapshotStore(self.nc, self.index_name, self.log)
        snapshot = await jetstream.retry_transient(self.snapshots.load, 60.0, self.log, "snapshot")
        if snapshot is not None:
            try:
                self.index = PrefixIndex.from_snapshot(snapshot)
                self.restored_seq = snapshot.stream_seq
            except ValueError as exc:  # a corrupt snapshot: start empty, replay the stream
                self.log.error("prefix index snapshot unreadable; starting empty", error=str(exc))
                self.snapshots.forget_written()  # the next save replaces it
        self.load_s = time.monotonic() - started
        self.log.info(
            "prefix index loaded",
            snapshot_seq=self.restored_seq,
            blocks=self.index.num_blocks(),
            load_s=round(self.load_s, 3),
        )
        self.reader = EventReader(self.nc, self.index, self.index_name, self.log)

    def endpoints(self) -> Sequence[Endpoint]:
        return (
            Endpoint("lookup", subjects.PREFIX_LOOKUP, self._on_lookup),
            # every replica hears every report: a queue group of its own
            Endpoint(
                "load",
                subjects.SCHED_LOAD,
                self._on_load,
                queue_group=f"rlt-prefix-cache-{self.instance_id}",
            ),
        )

    async def on_ready(self) -> None:
        assert self.reader is not None
        self.spawn(self.reader.run(), "events")
        self.spawn(self._snapshot_loop(), "snapshots")
        self.spawn(self._drop_silent_producers(), "producers")

    async def drain(self, timeout: float) -> None:
        await self._save_snapshot()

    def health_details(self) -> dict[str, Any]:
        cached = self.index.cached_blocks()
        out: dict[str, Any] = {
            "index": True,
            "lookups": self.num_lookups,
            "hits": self.num_hits,
            # {producer: cached blocks}: shows a restarted scheduler's old blocks are gone
            "cached_blocks": {pid: len(b) for pid, b in cached.items()},
            # {producer: fingerprint}: equal to that scheduler's own "prefix_digest"
            "digests": {pid: blocks_digest(b) for pid, b in cached.items()},
            "stream_seq": self.index.stream_seq,
            "snapshot_loaded_seq": self.restored_seq,
            "snapshot_load_s": round(self.load_s, 4),
            "gaps": self.index.num_gaps,
            "dropped_producers": list(self.dropped_producers[-20:]),
        }
        if self.reader is not None:
            r = self.reader
            out.update(
                caught_up=r.caught_up.is_set(),
                replayed_messages=r.num_messages,
                replayed_envelopes=r.num_envelopes,
                undecodable=r.num_undecodable,
                resyncs=r.num_resyncs,
                lost=r.num_lost,
            )
        if self.snapshots is not None:
            out["snapshots_written"] = self.snapshots.num_written
            out["snapshot_seq"] = self.snapshots.written_seq
        return out

    # ------------------------------------------------------------------ producers
    async def _on_load(self, msg: Msg) -> None:
        try:
            report = decode_msgpack(msg.data, SchedulerLoad)
        except msgspec.DecodeError:
            return  # admission logs bad reports; the index only needs the good ones
        self.liveness.heard(report.producer_id, time.monotonic())
        if self.index.revive(report.producer_id):
            self.log.info("dropped producer reports again", producer=report.producer_id)

    async def _drop_silent_producers(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            if not self.bus_connected:
                continue
            # every producer in the index must report, however it got there
            self.liveness.watch(self.index.producers(), time.monotonic())
            for pid in self.liveness.gone(time.monotonic(), self.bus_connected_since):
                blocks = len(self.index.cached_blocks().get(pid, ()))
                self.index.drop_producer(pid)
                self.dropped_producers.append(pid)
                self.log.warning(
                    "producer's reports stopped; its blocks dropped", producer=pid, blocks=blocks
                )

    # ------------------------------------------------------------------ snapshots
    async def _snapshot_loop(self) -> None:
        while True:
            await asyncio.sleep(self.snapshot_interval_s)
            await self._save_snapshot()

    async def _save_snapshot(self) -> None:
        if self.snapshots is None or not self.bus_connected:
            return
        try:
            started = time.monotonic()
            if await self.snapshots.save(self.index):
                self.log.debug(
                    "index snapshot written",
                    stream_seq=self.snapshots.written_seq,
                    took_s=round(time.monotonic() - started, 4),
                )
        except Exception as exc:  # the next period tries again; the stream still has it all
            self.log.warning("index snapshot failed", error=repr(exc)[:200])

    # ------------------------------------------------------------------ lookups
    async def _on_lookup(self, msg: Msg) -> None:
        if not msg.reply:
            return
        self.num_lookups += 1
        headers = msg.headers or {}
        fields = request_fields(  # copied into logs: bounded
            headers.get(HEADER_REQUEST_ID, "")[:256], headers.get(HEADER_TRACE_ID, "")[:64]
        )
        reply = _NO_HIT
        try:
            lookup = decode_msgpack(msg.data, PrefixLookup)
            fields = request_fields(
                lookup.request_id[:256] or fields["request_id"],
                lookup.trace_id[:64] or fields.get("trace_id", ""),
            )
            answer = self.index.lookup(lookup.block_hashes, lookup.per_producer)
            reply = encode_msgpack(answer)
            if answer.num_blocks:
                self.num_hits += 1
            self.log.info(
                "prefix lookup",
                num_blocks=len(lookup.block_hashes),
                hit_blocks=answer.num_blocks,
                producer=answer.producer_id,
                **fields,
            )
        except Exception as exc:  # a bad lookup is a miss, never an error
            self.log.warning("prefix lookup failed", error=repr(exc)[:200], **fields)
        await self.nc.publish(msg.reply, reply)
