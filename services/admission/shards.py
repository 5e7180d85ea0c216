"""The engine shards as this admission sees them (pure: no NATS, no clock of its own).

A shard is one scheduler and one worker with their own KV. Its scheduler announces it
(``ShardAnnounce``: shard id, scheduler instance, prefix producer, KV geometry) when it starts
and when asked, and reports its load (``SchedulerLoad``) several times a second. A report is
applied only if it comes from the instance that announced the shard and is newer than the
last one; anything else is refused with a reason the shell logs:

- malformed: no usable shard id;
- unknown: no announcement from that (shard, scheduler instance) yet, or one refused
  (a block size other than the one this admission hashes prompts with);
- stale: not newer than the last report applied, or older than ``max_report_age_s``.

A shard is routable while its reports are fresh; healthy while it also has a worker and is
not draining. It is lost when its reports stop for ``lost_s`` of time this admission was
connected; a new scheduler instance announcing the same shard means the old one is gone.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from messages.internal import SchedulerLoad, ShardAnnounce
from messages.kv_transfer import KVBlockFormat
from services.common.sparse_prefill import SparseDefaults
from services.runtime import subjects


class Refusal(enum.StrEnum):
    MALFORMED = "malformed"
    UNKNOWN = "unknown shard"
    STALE = "stale"


@dataclass
class _Unseen:
    """What this admission sent a shard since the report it last applied was taken."""

    # (seq, prompt tokens, expected prefill tokens, sent at)
    entries: list[tuple[int, int, int, float]] = field(default_factory=list)

    def add(self, seq: int, tokens: int, prefill: int, now: float) -> None:
        self.entries.append((seq, tokens, prefill, now))

    def drop_seen(self, last_seq: int) -> None:
        if self.entries and self.entries[0][0] <= last_seq:
            self.entries = [e for e in self.entries if e[0] > last_seq]

    def expire(self, now: float, expiry_s: float) -> None:
        if self.entries and now - self.entries[0][3] > expiry_s:
            self.entries = [e for e in self.entries if now - e[3] <= expiry_s]

    def totals(self) -> tuple[int, int, int]:
        return (
            len(self.entries),
            sum(e[1] for e in self.entries),
            sum(e[2] for e in self.entries),
        )


@dataclass
class Shard:
    shard_id: str
    scheduler_id: str
    producer_id: str
    block_size: int
    announced_at: float
    prefix_caching: bool = False
    report: SchedulerLoad | None = None
    report_at: float = float("-inf")
    no_worker_since: float | None = None  # reports say its worker is gone, since when
    unseen: _Unseen = field(default_factory=_Unseen)
    # disaggregation: "prefill", "decode" or "both"; its block format (roles must agree)
    role: str = "both"
    block_format: KVBlockFormat | None = None
    # its token-sparse prefill defaults (None: it cannot run it, or did not say): how it
    # keys a request's prompt blocks (``prefix_keys.py``)
    sparse_defaults: SparseDefaults | None = None
    # its KV codec: part of its prefix block hashes (``prefix_keys.py``)
    kv_cache_dtype: str = "auto"

    def fresh(self, now: float, fresh_s: float) -> bool:
        return now - self.report_at <= fresh_s

    @property
    def healthy_report(self) -> bool:
        r = self.report
        return r is not None and r.has_worker and not r.draining


@dataclass(frozen=True)
class ShardLoad:
    """One shard's load for the router: its last report plus what was sent since."""

    shard_id: str
    producer_id: str
    num_running: int
    num_waiting: int
    waiting_tokens: int  # queued prompt tokens (backpressure)
    waiting_prefill_tokens: int  # of those, what its prefix cache does not hold (routing)
    active_blocks: int
    num_free_blocks: int
    step_time_s: float


@dataclass(frozen=True)
class ShardTableConfig:
    lost_s: float = 10.0  # reports stopped this long (connected time): the shard is gone
    fresh_s: float = 2.0  # a shard is routable while its last report is this recent
    max_report_age_s: float = 30.0  # a report this much older than our clock is stale
    unseen_expiry_s: float = 10.0  # a send no report acknowledged after this long was lost


class ShardTable:
    def __init__(
        self, admission_id: str, block_size: int, config: ShardTableConfig | None = None
    ) -> None:
        self.admission_id = admission_id
        self.block_size = block_size
        self.config = config or ShardTableConfig()
        self.shards: dict[str, Shard] = {}
        self.refused: dict[tuple[str, str], str] = {}  # (shard, instance) -> why refused

    def __len__(self) -> int:
        return len(self.shards)

    # ------------------------------------------------------------------ membership
    def announce(self, a: ShardAnnounce, now: float) -> tuple[str | None, str | None]:
        """Applies an announcement; returns (refusal reason or None, scheduler instance it
        replaces or None: that instance's requests are gone)."""
        try:
            subjects.check_shard_id(a.shard_id)
        except ValueError as exc:
            return str(exc), None
        if not a.scheduler_id:
            return "no scheduler instance", None
        key = (a.shard_id, a.scheduler_id)
        if a.block_size != self.block_size:
            why = (
                f"block size {a.block_size} differs from this admission's {self.block_size} "
                "(prefix hashes would never match; start both with the same --block-size)"
            )
            self.refused[key] = why
            return why, None
        why = self._format_mismatch(a)
        if why is not None:
            self.refused[key] = why
            return why, None
        self.refused.pop(key, None)
        current = self.shards.get(a.shard_id)
        if current is not None and current.scheduler_id == a.scheduler_id:
            current.producer_id = a.producer_id or current.producer_id
            current.role, current.block_format = a.role, a.block_format
            current.sparse_defaults = _sparse_defaults(a)
            current.kv_cache_dtype = a.kv_cache_dtype
            return None, None
        replaced = current.scheduler_id if current is not None else None
        self.shards[a.shard_id] = Shard(
            a.shard_id,
            a.scheduler_id,
            a.producer_id,
            a.block_size,
            announced_at=now,
            prefix_caching=a.enable_prefix_caching,
            role=a.role,
            block_format=a.block_format,
            sparse_defaults=_sparse_defaults(a),
            kv_cache_dtype=a.kv_cache_dtype,
        )
        return None, replaced

    def _format_mismatch(self, a: ShardAnnounce) -> str | None:
        """Prefill and decode shards hand requests over by block: a shard of either role
        whose block format differs from another's is refused, naming what differs."""
        if a.role == "both":
            return None
        if a.block_format is None:
            return f"a {a.role} shard must announce its KV block format"
        for other in self.shards.values():
            if other.shard_id == a.shard_id or other.role == "both":
                continue
            if other.block_format is None:
                continue
            diff = a.block_format.mismatch(other.block_format)
            if diff is not None:
                return (
                    f"KV block format differs from {other.role} shard {other.shard_id}'s "
                    f"({diff}): prefill and decode shards need the same --block-size, "
                    "--kv-layout, --kv-cache-dtype and model depth"
                )
        return None

    def apply(self, r: SchedulerLoad, now: float, wall_now: float) -> Refusal | None:
        """Applies a load report, or says why it was refused."""
        if not r.shard_id or not r.scheduler_id:
            return Refusal.MALFORMED
        try:
            subjects.check_shard_id(r.shard_id)
        except ValueError:
            return Refusal.MALFORMED
        shard = self.shards.get(r.shard_id)
        if shard is None or shard.scheduler_id != r.scheduler_id:
            return Refusal.UNKNOWN
        last = shard.report
        if last is not None and r.report_seq <= last.report_seq:
            return Refusal.STALE
        if r.time and wall_now - r.time > self.config.max_report_age_s:
            return Refusal.STALE
        shard.report, shard.report_at = r, now
        if r.has_worker:
            shard.no_worker_since = None
        elif shard.no_worker_since is None:
            shard.no_worker_since = now
        if r.producer_id:
            shard.producer_id = r.producer_id
        shard.unseen.drop_seen(r.last_admission_seq.get(self.admission_id, 0))
        return None

    def silent(self, now: float, connected_since: float) -> list[Shard]:
        """The shards whose reports stopped (time we were cut off from the bus does not
        count against them). Silence alone may be a stall: the caller confirms the loss."""
        return [
            s
            for s in self.shards.values()
            if now - max(s.report_at, s.announced_at, connected_since) > self.config.lost_s
        ]

    def remove(self, shard_id: str) -> None:
        self.shards.pop(shard_id, None)

    # ------------------------------------------------------------------ routing
    def sent(
        self, shard_id: str, seq: int, prompt_tokens: int, now: float, prefill: int | None = None
    ) -> None:
        """A request went to ``shard_id``: it waits there until a report says otherwise;
        ``prefill`` is the part of its prompt the shard is expected to compute."""
        shard = self.shards.get(shard_id)
        if shard is not None:
            todo = prompt_tokens if prefill is None else prefill
            shard.unseen.add(seq, prompt_tokens, todo, now)

    def routable(self, now: float) -> list[Shard]:
        """Healthy shards (fresh reports, a worker, not draining); if there are none, the
        fresh ones without a worker (their requests wait for one, as on a single shard)."""
        fresh = [s for s in self.shards.values() if s.fresh(now, self.config.fresh_s) and s.report]
        healthy = [s for s in fresh if s.healthy_report]
        if healthy:
            return healthy
        return [s for s in fresh if s.report is not None and not s.report.draining]

    def without_worker(self, now: float, grace_s: float) -> list[Shard]:
        """Shards whose reports have said "no worker" for ``grace_s`` or longer."""
        return [
            s
            for s in self.shards.values()
            if s.no_worker_since is not None and now - s.no_worker_since >= grace_s
        ]

    def healthy(self, now: float, exclude: str = "") -> list[Shard]:
        return [
            s
            for s in self.shards.values()
            if s.shard_id != exclude and s.fresh(now, self.config.fresh_s) and s.healthy_report
        ]

    def decode_targets(self, now: float, exclude: str = "") -> list[Shard]:
        """Healthy decode shards (where a prefill shard's requests go after their first
        token)."""
        return [s for s in self.healthy(now, exclude=exclude) if s.role == "decode"]

    def hands_off(self, shard_id: str, now: float) -> bool:
        """Whether a request sent to ``shard_id`` should leave it after its first token: a
        prefill shard, while some decode shard is healthy."""
        shard = self.shards.get(shard_id)
        return shard is not None and shard.role == "prefill" and bool(self.decode_targets(now))

    def load(self, shard: Shard, now: float) -> ShardLoad:
        shard.unseen.expire(now, self.config.unseen_expiry_s)
        n, tokens, prefill = shard.unseen.totals()
        r = shard.report or SchedulerLoad(scheduler_id=shard.scheduler_id)
        return ShardLoad(
            shard_id=shard.shard_id,
            producer_id=shard.producer_id,
            num_running=r.num_running,
            num_waiting=r.num_waiting + n,
            waiting_tokens=r.num_waiting_tokens + tokens,
            waiting_prefill_tokens=r.num_waiting_prefill_tokens + prefill,
            active_blocks=r.num_active_blocks,
            num_free_blocks=r.num_free_blocks,
            step_time_s=r.step_time_s,
        )

    def waiting(self, now: float) -> tuple[int, int]:
        """Requests and prompt tokens waiting over every shard (the health reply's view)."""
        n = tokens = 0
        for shard in self.shards.values():
            load = self.load(shard, now)
            n += load.num_waiting
            tokens += load.waiting_tokens
        return n, tokens

    def health(self, now: float) -> dict[str, dict[str, Any]]:
        """Each shard as the health reply shows it, by shard id."""
        healthy = self.healthy(now)
        return {s.shard_id: self._health(s, s in healthy, now) for s in self.shards.values()}

    def _health(self, shard: Shard, healthy: bool, now: float) -> dict[str, Any]:
        load = self.load(shard, now)
        return {
            "scheduler": shard.scheduler_id,
            "producer": shard.producer_id,
            "healthy": healthy,
            "running": load.num_running,
            "waiting": load.num_waiting,
            "active_blocks": load.active_blocks,
            "free_blocks": load.num_free_blocks,
            "step_time_s": load.step_time_s,
            "report_age_s": round(now - shard.report_at, 3) if shard.report else None,
            "role": shard.role,
        }


def _sparse_defaults(a: ShardAnnounce) -> SparseDefaults | None:
    if a.sparse_prefill is None:
        return None
    return SparseDefaults.offered(a.sparse_prefill, a.sparse_prefill_default)
