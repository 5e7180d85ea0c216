"""Prefix-cache actor: a thin shell around ``PrefixIndex``.

In: ``rlt.v1.prefix.events`` (msgpack ``PrefixEventBatch`` from each scheduler, applied
strictly in ``event_seq`` order by the index) and ``rlt.v1.prefix.lookup`` requests
(msgpack ``PrefixLookup`` -> ``PrefixLookupReply``). Out: ``ReplayRequest`` to
``rlt.v1.prefix.replay.<producer>`` when the index sees a gap, re-asked on a timer because
the request or its answer can be lost. Lookups never fail: anything wrong answers "no hit".
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import msgspec
from nats.aio.msg import Msg

from services.runtime import subjects
from services.runtime.bus import HEADER_REQUEST_ID, HEADER_TRACE_ID, decode_msgpack, encode_msgpack
from services.runtime.logging import EVENT_SEQ, request_fields
from services.runtime.service import Endpoint, Service

_NO_HIT = encode_msgpack({})  # decodes as a PrefixLookupReply with every default (no hit)


class PrefixCacheService(Service):
    name = "prefix-cache"
    description = "global prefix index: which producer caches which block hashes"

    def __init__(self, nats_url: str, *, replay_interval_s: float = 1.0, **kwargs: Any) -> None:
        super().__init__(nats_url, **kwargs)
        self.replay_interval_s = replay_interval_s
        self.index: Any = None  # PrefixIndex, or None when the core is not available
        self.num_lookups = 0
        self.num_hits = 0

    async def setup(self) -> None:
        try:  # imported lazily: the service still answers "no hit" without the core
            from services.prefix_cache.core import PrefixIndex
        except ImportError as exc:
            self.log.warning("prefix index unavailable; every lookup is a miss", error=repr(exc))
            return
        self.index = PrefixIndex()

    def endpoints(self) -> Sequence[Endpoint]:
        return (
            Endpoint("events", subjects.PREFIX_EVENTS, self._on_events),
            Endpoint("lookup", subjects.PREFIX_LOOKUP, self._on_lookup),
        )

    async def on_ready(self) -> None:
        if self.index is not None:
            self.spawn(self._reask_replays(), "replays")

    def health_details(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "index": self.index is not None,
            "lookups": self.num_lookups,
            "hits": self.num_hits,
        }
        if self.index is not None:
            # {producer: cached blocks}: shows a restarted scheduler's old blocks are gone
            out["cached_blocks"] = {pid: len(b) for pid, b in self.index.snapshot().items()}
        return out

    async def _on_events(self, msg: Msg) -> None:
        if self.index is None:
            return
        from messages.prefix import PrefixEventBatch

        try:
            batch = decode_msgpack(msg.data, PrefixEventBatch)
        except msgspec.DecodeError as exc:
            self.log.error("undecodable prefix events", error=str(exc))
            return
        outcome = self.index.apply(batch)
        if getattr(outcome, "new_epoch", False):
            self.log.info(
                "producer epoch changed; its blocks dropped",
                producer=batch.producer_id,
                epoch=batch.epoch,
            )
        replay = getattr(outcome, "replay", None)
        if replay is not None:
            await self._ask_replay(replay)
        self.log.debug(
            "prefix events",
            producer=batch.producer_id,
            applied=getattr(outcome, "applied_seqs", None),
            **{EVENT_SEQ: batch.event_seq},
        )

    async def _on_lookup(self, msg: Msg) -> None:
        if not msg.reply:
            return
        self.num_lookups += 1
        headers = msg.headers or {}
        fields = request_fields(
            headers.get(HEADER_REQUEST_ID, ""), headers.get(HEADER_TRACE_ID, "")
        )
        reply = _NO_HIT
        if self.index is not None:
            from messages.prefix import PrefixLookup

            try:
                lookup = decode_msgpack(msg.data, PrefixLookup)
                fields = request_fields(
                    lookup.request_id or fields["request_id"],
                    lookup.trace_id or fields.get("trace_id", ""),
                )
                answer = self.index.lookup(lookup.block_hashes)
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
                self.log.warning("prefix lookup failed", error=repr(exc), **fields)
        else:
            self.log.info("prefix lookup", hit_blocks=0, index=False, **fields)
        await self.nc.publish(msg.reply, reply)

    async def _ask_replay(self, replay: Any) -> None:
        self.log.info(
            "asking for replay",
            producer=replay.producer_id,
            epoch=replay.epoch,
            from_seq=replay.from_seq,
        )
        await self.nc.publish(subjects.prefix_replay(replay.producer_id), encode_msgpack(replay))

    async def _reask_replays(self) -> None:
        while True:
            await asyncio.sleep(self.replay_interval_s)
            for replay in self.index.pending_replays():
                await self._ask_replay(replay)
