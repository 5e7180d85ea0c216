"""Which shards exist, from what their schedulers say over NATS: announcements and load
reports applied to the ``ShardTable`` (pure), refusals logged without flooding the log, and
shards asked to announce themselves when one is missing."""

from __future__ import annotations

import time
from typing import Any

import msgspec

from messages.internal import SchedulerLoad, ShardAnnounce
from services.admission.shards import Refusal, ShardTable
from services.admission.tables import OpenRequests
from services.runtime import subjects
from services.runtime.bus import decode_msgpack
from services.runtime.service import Service

# the same refusal of the same shard's reports is logged at most once per this many seconds
_REFUSAL_LOG_S = 5.0
# shards are asked to announce themselves at most once per this many seconds
_DISCOVER_EVERY_S = 0.2


class ShardMembership:
    def __init__(self, actor: Service, shards: ShardTable, open_requests: OpenRequests) -> None:
        self._actor = actor
        self.shards = shards
        self._open = open_requests
        self.num_refused_reports = 0
        self._logged: dict[tuple[str, str], float] = {}
        self._last_discover = float("-inf")

    def announced(self, data: bytes) -> tuple[str, str] | None:
        """Applies an announcement; returns (shard, the scheduler instance it replaces) when
        a new instance took over a known shard: the old one's requests must move."""
        try:
            announce = decode_msgpack(data, ShardAnnounce)
        except msgspec.DecodeError as exc:
            self._log_refusal("?", "malformed announcement", error=str(exc)[:200])
            return None
        refused, replaced = self.shards.announce(announce, time.monotonic())
        if refused is not None:
            self._log_refusal(announce.shard_id, f"shard refused: {refused}")
            return None
        if replaced is None:
            self._actor.log.info(
                "shard announced", shard=announce.shard_id, scheduler=announce.scheduler_id
            )
            return None
        self._actor.log.warning(
            "shard restarted: its requests move",
            shard=announce.shard_id,
            old_scheduler=replaced,
            scheduler=announce.scheduler_id,
        )
        return announce.shard_id, replaced

    async def reported(self, data: bytes) -> None:
        """Applies a load report (it also says its scheduler is alive)."""
        try:
            report = decode_msgpack(data, SchedulerLoad)
        except msgspec.DecodeError as exc:
            self.num_refused_reports += 1
            self._log_refusal("?", "bad load report ignored (malformed)", error=str(exc)[:200])
            return
        now = time.monotonic()
        refused = self.shards.apply(report, now, time.time())
        if refused is not None:
            self.num_refused_reports += 1
            self._log_refusal(
                report.shard_id or "?",
                f"bad load report ignored ({refused})",
                scheduler=report.scheduler_id,
            )
            if refused is Refusal.UNKNOWN:
                await self.ask_shards()  # a shard we missed announces itself again
            return
        self._open.heard_from(report.scheduler_id, now)

    async def ask_shards(self) -> None:
        now = time.monotonic()
        if now - self._last_discover >= _DISCOVER_EVERY_S:
            self._last_discover = now
            await self._actor.nc.publish(subjects.SHARD_DISCOVER, b"")

    def _log_refusal(self, shard: str, what: str, **fields: Any) -> None:
        now = time.monotonic()
        if now - self._logged.get((shard, what), float("-inf")) >= _REFUSAL_LOG_S:
            self._logged[(shard, what)] = now
            self._actor.log.warning(what, shard=shard, **fields)
