"""Fencing: no client hears from two sides (docs/services.md, "Fencing").

Admission ends a lost scheduler's requests with ``unavailable`` only once nats-server dropped
that scheduler's connection. So after any time cut off from NATS, or any stall of our own
(the loop stopped ticking), what we would send about our streams (relayed events, notices,
abort answers) is held until every admission we hold streams for answered a
``FenceQuery``: the tries it ended meanwhile are dropped without another event, the rest go
on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any, NamedTuple, Protocol

import msgspec
from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError

from messages.internal import FenceQuery, FenceUpdate
from services.runtime import subjects
from services.runtime.bus import decode_msgpack, encode_msgpack
from services.scheduler.driver.step_output import Relay, StreamKey

# a gap this long in our own 0.1 s watchdog tick means we were stalled (or starved): what we
# publish next may come after admission gave up on us, so we check first
_STALL_S = 1.0
# how long the fence check keeps asking an admission that does not answer
_FENCE_WAIT_S = 5.0


class Held(NamedTuple):
    """An encoded message held while we are dark, and the try it is about."""

    subject: str
    data: bytes
    reply: str
    key: StreamKey | None


class FenceHost(Protocol):
    """What the fence needs of the scheduler service."""

    instance_id: str
    log: Any
    bus_connected: bool
    bus_connected_since: float

    @property
    def nc(self) -> NATS: ...

    def spawn(self, coro: Awaitable[None], name: str) -> asyncio.Task[None]: ...

    def live_tries(self) -> set[StreamKey]:
        """The tries of the live streams."""
        ...

    def drop_fenced(self, keys: set[StreamKey]) -> list[StreamKey]:
        """Ends the live streams of these tries without a word; returns those that were."""
        ...

    async def release_held(self) -> None:
        """Sends what the fence held (it is done with them)."""
        ...


class Fence:
    def __init__(
        self, host: FenceHost, *, reconnect_grace_s: float, scheduler_lost_s: float
    ) -> None:
        self.host = host
        self.reconnect_grace_s = reconnect_grace_s
        # admission's RLT_SCHEDULER_LOST_S: after a dark spell shorter than this, no admission
        # can have ended our requests (used when an admission does not answer a fence query)
        self.scheduler_lost_s = scheduler_lost_s
        # what waits for the fence check, in the order it was to be sent
        self.held: list[Held] = []
        self.held_relays: list[Relay] = []
        # since when we may have been unreachable or stalled (None: not dark), the latest
        # cause, the check that ends a dark spell, and the watchdog's last tick
        self.dark_since: float | None = None
        self._dark_mark = 0.0  # the latest cause of going dark (grows with each new one)
        self._task: asyncio.Task[None] | None = None
        self._last_tick = time.monotonic()
        self.num_fenced = 0

    @property
    def dark(self) -> bool:
        return self.dark_since is not None

    def holding(self) -> bool:
        """Whether what we send about our streams must wait (cut off from the bus, or a
        fence check due)."""
        now = time.monotonic()
        if now - self._last_tick > _STALL_S:
            # our loop did not tick for a while: we may have been stalled past the point
            # where admission gave up on us, so nothing goes out until it says
            self.go_dark(self._last_tick, f"stalled {now - self._last_tick:.1f}s")
        return self.dark_since is not None or not self.host.nc.is_connected

    def start(self) -> None:
        """Starts the stall watchdog (set-up time, loading a checkpoint, is no stall)."""
        self._last_tick = time.monotonic()
        self.host.spawn(self._watchdog(), "watchdog")

    async def _watchdog(self) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(0.1)
            now = self._last_tick = time.monotonic()
            if now - before > _STALL_S:
                self.go_dark(before, f"stalled {now - before:.1f}s")

    def go_dark(self, since: float, why: str) -> None:
        """We may have been unreachable since ``since``: hold what we send about our
        streams until a fence check says which of them admission ended meanwhile."""
        # a new cause moves the mark (one stall is seen by many sends)
        self._dark_mark = max(self._dark_mark, since)
        if self.dark_since is None:
            self.dark_since = since
            self.host.log.warning("holding client events until admission confirms them", reason=why)
        if self._task is None or self._task.done():
            self._task = self.host.spawn(self._check(), "fence-check")

    async def _check(self) -> None:
        while True:
            mark = self._dark_mark
            await self._wait_back()
            dark_since = self.dark_since if self.dark_since is not None else time.monotonic()
            dark_s = time.monotonic() - dark_since
            held_then = self._fenceable()  # what the dark spell may have cost
            fenced, unanswered, lost_s = await self._ask_admissions()
            if mark != self._dark_mark:
                continue  # dark again meanwhile: ask again
            await self._end_dark(fenced, unanswered, dark_s, lost_s, held_then)
            if self.dark_since is not None or mark != self._dark_mark:
                await asyncio.sleep(0.05)  # (never a busy loop when nothing else awaits)
                continue  # dark again while we released the held events: this task asks
            return

    async def _wait_back(self) -> None:
        """Until we are on the bus and, after a reconnect, the clients had the grace period
        to reconnect too."""
        host = self.host
        while True:
            now = time.monotonic()
            since = host.bus_connected_since
            reconnected = self.dark_since is not None and since > self.dark_since
            if host.bus_connected and (not reconnected or now - since >= self.reconnect_grace_s):
                return
            await asyncio.sleep(0.05)

    async def _ask_admissions(self) -> tuple[set[StreamKey], set[str], float]:
        """Asks every admission we hold tries for (live streams, held messages and relayed
        events) which of them it ended. Returns the fenced tries, the admissions that never
        answered, and admission's lost time."""
        host = self.host
        pending = {aid for aid, _ in self._fenceable()}
        fenced: set[StreamKey] = set()
        lost_s = self.scheduler_lost_s
        deadline = time.monotonic() + _FENCE_WAIT_S
        while pending and time.monotonic() < deadline:
            # built at each round: admission may fence more of them while we ask
            held: dict[str, list[int]] = {}
            for aid, seq in self._fenceable():
                held.setdefault(aid, []).append(seq)
            for admission_id in list(pending):
                seqs = sorted(held.get(admission_id, ()))
                if not seqs:  # nothing of its left here (ended, or taken over by a retry)
                    pending.discard(admission_id)
                    continue
                query = FenceQuery(scheduler_id=host.instance_id, seqs=seqs)
                try:
                    msg = await host.nc.request(
                        subjects.admission_fence(admission_id), encode_msgpack(query), timeout=1.0
                    )
                    update = decode_msgpack(msg.data, FenceUpdate)
                except NoRespondersError:
                    continue  # not on the bus (now): ask again shortly
                except (TimeoutError, NatsError, msgspec.DecodeError) as exc:
                    host.log.warning("fence query failed", admission=admission_id, error=repr(exc))
                    continue
                pending.discard(admission_id)
                fenced.update((admission_id, seq) for _, seq in update.fenced)
                lost_s = min(lost_s, update.scheduler_lost_s)
            if pending:
                await asyncio.sleep(0.25)
        return fenced, pending, lost_s

    def _fenceable(self) -> set[StreamKey]:
        """The tries a fence can drop here: live streams, held messages and relays."""
        held = {m.key for m in self.held if m.key is not None}
        return self.host.live_tries() | held | {r.key for r in self.held_relays}

    async def _end_dark(
        self,
        fenced: set[StreamKey],
        unanswered: set[str],
        dark_s: float,
        lost_s: float,
        held_then: set[StreamKey],
    ) -> None:
        host = self.host
        drop = set(fenced)
        if unanswered and dark_s >= lost_s:
            # an admission that is gone may have ended these before it went: nobody can
            # say, so they end here without a word (a double fault; docs/services.md)
            # (only the tries held when the check began: later ones were never fenced)
            drop |= {key for key in held_then if key[0] in unanswered}
            host.log.error(
                "admissions unreachable after a long dark spell; their requests dropped",
                admissions=sorted(unanswered),
                dark_s=round(dark_s, 1),
            )
        self.drop(drop)
        self.dark_since = None
        await host.release_held()

    def drop(self, keys: set[StreamKey]) -> set[StreamKey]:
        """Ends these tries here without another word (admission ended them, and gave
        their clients their terminal event): their live streams, and what is held for them
        (a finished event of one that ended meanwhile included). Returns the tries that had
        something here."""
        live = set(self.host.drop_fenced(keys))
        ended = {m.key for m in self.held if m.key in keys}
        ended |= {r.key for r in self.held_relays if r.key in keys}
        self.held = [m for m in self.held if m.key not in keys]
        self.held_relays = [r for r in self.held_relays if r.key not in keys]
        self.num_fenced += len(live | ended)
        self.host.log.info(
            "fence check done",
            fenced=len(keys),
            live=len(live),
            held=len(self.held) + len(self.held_relays),
        )
        return live | ended
