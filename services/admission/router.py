"""Which shard runs a request (pure: no NATS).

Policies (``--router``):

- ``prefix`` (default): the cost of sending the request to shard s, in KV blocks, is

      cost(s) = overlap_weight * prefill_blocks(s) + decode_blocks(s)
      prefill_blocks(s) = P - overlap(s) + waiting(s) / block_size
      decode_blocks(s)  = active(s) + P - overlap(s) + request_weight * requests(s)

  where P is the prompt's length in blocks, overlap(s) the leading run of its blocks shard s
  caches (the prefix index's per-producer answer, or what this router sent there recently and
  the index does not show yet), waiting(s) the prefill queued there (the waiting prompts'
  tokens its cache does not hold), active(s) the KV blocks its running requests hold, and
  requests(s) how many run or wait there. decode_blocks is what the shard would hold with
  this request (the cached blocks it would share are there already, counted once however
  many requests read them) plus a block-equivalent per request (each is a decode row per
  step, whatever memory it shares). This is the shape of NVIDIA Dynamo's KV router (overlap
  blocks against prefill and decode load, its "potential" active blocks and its optional
  active-request term): a cached prefix saves prefill and memory, but a shard whose load
  exceeds another's by more than that no longer wins. Lowest cost wins; ties go to the fewer
  requests, then round robin. Defaults (overlap_weight 2, request_weight 2) are measured:
  docs/sharding.md.
- ``least-loaded``: the same cost with every overlap 0.
- ``round-robin``: shard ids in turn, whatever their load.

Without overlaps (the index is unreachable, or prefix caching is off) ``prefix`` routes by
load only. The chosen shard's scheduler stays the authority on hits: it claims what its own
block table holds.
"""

from __future__ import annotations

import enum
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from services.admission.shards import ShardLoad


class RoutePolicy(enum.StrEnum):
    PREFIX = "prefix"
    ROUND_ROBIN = "round-robin"
    LEAST_LOADED = "least-loaded"


@dataclass(frozen=True)
class Choice:
    shard_id: str
    overlap_blocks: int = 0  # what the router expects the shard to hold (a hint)
    cost: float = 0.0


class RecentRoutes:
    """Prefix blocks this router sent to a shard, before the index can show them (a block
    reaches the index only after its prompt's prefill finished there). Bounded; entries
    expire after ``ttl_s``. A second request with the same prefix then follows the first."""

    def __init__(self, ttl_s: float = 30.0, max_blocks: int = 200_000) -> None:
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[int, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def record(self, block_hashes: Sequence[int], shard_id: str, now: float) -> None:
        for h in block_hashes:
            self._blocks[h] = (shard_id, now)
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)

    def overlaps(self, block_hashes: Sequence[int], now: float) -> dict[str, int]:
        """{shard: leading blocks it was sent recently} (at most one shard per block)."""
        first = self._get(block_hashes[0], now) if block_hashes else None
        if first is None:
            return {}
        run = 1
        for h in block_hashes[1:]:
            if self._get(h, now) != first:
                break
            run += 1
        return {first: run}

    def forget_shard(self, shard_id: str) -> None:
        for h in [h for h, (s, _) in self._blocks.items() if s == shard_id]:
            del self._blocks[h]

    def _get(self, block_hash: int, now: float) -> str | None:
        entry = self._blocks.get(block_hash)
        if entry is None:
            return None
        if now - entry[1] > self.ttl_s:
            del self._blocks[block_hash]
            return None
        return entry[0]


class Router:
    def __init__(
        self,
        policy: RoutePolicy | str,
        block_size: int,
        overlap_weight: float = 2.0,
        request_weight: float = 2.0,
    ) -> None:
        self.policy = RoutePolicy(policy)
        self.block_size = block_size
        self.overlap_weight = overlap_weight
        self.request_weight = request_weight
        self._turn = 0

    @property
    def uses_overlap(self) -> bool:
        return self.policy is RoutePolicy.PREFIX

    def choose(
        self,
        shards: Sequence[ShardLoad],
        num_prompt_tokens: int,
        overlaps: dict[str, int] | None = None,
    ) -> Choice:
        """The shard for a request of ``num_prompt_tokens``; ``overlaps`` maps shard id ->
        cached leading blocks (None: load only)."""
        if not shards:
            raise ValueError("no shard to route to")
        ordered = sorted(shards, key=lambda s: s.shard_id)
        if self.policy is RoutePolicy.ROUND_ROBIN or len(ordered) == 1:
            pick = ordered[self._turn % len(ordered)]
            self._turn += 1
            return Choice(pick.shard_id, (overlaps or {}).get(pick.shard_id, 0))
        use = overlaps if self.policy is RoutePolicy.PREFIX and overlaps else {}
        prompt_blocks = math.ceil(num_prompt_tokens / self.block_size)
        best: tuple[float, int, int] | None = None
        choice = Choice(ordered[0].shard_id)
        for i, shard in enumerate(ordered):
            overlap = min(use.get(shard.shard_id, 0), prompt_blocks)
            cost = self.cost(shard, prompt_blocks, overlap)
            # ties: fewer requests there, then the one after the last pick (round robin)
            key = (cost, shard.num_running + shard.num_waiting, (i - self._turn) % len(ordered))
            if best is None or key < best:
                best, choice = key, Choice(shard.shard_id, overlap, cost)
        self._turn += 1
        return choice

    def cost(self, shard: ShardLoad, prompt_blocks: int, overlap_blocks: int) -> float:
        new_blocks = prompt_blocks - overlap_blocks
        prefill = new_blocks + shard.waiting_prefill_tokens / self.block_size
        requests = shard.num_running + shard.num_waiting
        decode = shard.active_blocks + new_blocks + self.request_weight * requests
        return self.overlap_weight * prefill + decode


class IndexGate:
    """Whether to ask the prefix index: after a failed lookup (unreachable, timed out) the
    router routes by load only and asks again after ``retry_s``. Pure; the caller logs the
    transitions this returns."""

    def __init__(self, retry_s: float = 1.0) -> None:
        self.retry_s = retry_s
        self.down_since: float | None = None
        self._retry_at = 0.0
        self.num_failures = 0

    def should_ask(self, now: float) -> bool:
        return self.down_since is None or now >= self._retry_at

    def failed(self, now: float) -> bool:
        """Records a failed lookup; True when the index just went down (log it)."""
        self.num_failures += 1
        self._retry_at = now + self.retry_s
        if self.down_since is None:
            self.down_since = now
            return True
        return False

    def succeeded(self) -> bool:
        """Records an answer; True when the index just came back (log it)."""
        was_down = self.down_since is not None
        self.down_since = None
        return was_down
