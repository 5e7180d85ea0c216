"""A prompt's block hashes as each candidate shard keys them, for the prefix index (pure).

A shard hashes a dense request's prompt blocks by their tokens alone; under token-sparse
prefill the key includes the window and retention, and only blocks before the prompt's last
window are hashed (``services/common/sparse_prefill.py``, ``prefix_block_hashes``). Which of
the two a request gets depends on the shard's defaults (``ShardAnnounce``) unless the request
carries the setting its first shard resolved. Shards with the same defaults share one list,
so a deployment whose shards have the same flags asks the index once, as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from messages.errors import RequestError
from messages.prefix import cacheable_prefix_blocks
from messages.sampling import PrefillSetting, SamplingParams
from services.admission.shards import Shard
from services.common.sparse_prefill import (
    SparseSchedule,
    prefix_block_hashes,
    resolve_sparse_prefill,
)

# what a shard's prompt block hashes depend on: its sparse setting and its KV codec
_Key = tuple[SparseSchedule | None, str]


def shard_schedule(
    shard: Shard, params: SamplingParams, carried: PrefillSetting | None
) -> SparseSchedule | None:
    """The token-sparse prefill ``shard`` would run the request under (None: dense), as its
    scheduler resolves it; None too where it would refuse the request (nothing is cached)."""
    defaults = shard.sparse_defaults
    try:
        if carried is not None:
            sparse = carried.sparse_prefill
            return None if sparse is None else SparseSchedule.from_wire(sparse)
        if defaults is None or defaults.retention is None:
            return None  # it cannot run the option, or did not say how
        return resolve_sparse_prefill(params, defaults, len(defaults.retention), split_prefill=True)
    except (RequestError, ValueError):
        return None


@dataclass
class PrefixKeys:
    """``hashes[key]``: the prompt's claimable block hashes under a (sparse setting, KV
    codec) key; ``schedule_of[shard_id]``: the key each candidate shard would use."""

    block_size: int
    hashes: dict[_Key, list[int]] = field(default_factory=dict)
    schedule_of: dict[str, _Key] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        prompt: list[int],
        block_size: int,
        params: SamplingParams,
        carried: PrefillSetting | None,
        shards: Iterable[Shard],
    ) -> PrefixKeys:
        keys = cls(block_size)
        usable = cacheable_prefix_blocks(len(prompt), block_size)
        for shard in shards:
            schedule = shard_schedule(shard, params, carried)
            key = (schedule, shard.kv_cache_dtype)
            keys.schedule_of[shard.shard_id] = key
            if key not in keys.hashes:
                hashes = prefix_block_hashes(
                    prompt, block_size, schedule, kv_cache_dtype=shard.kv_cache_dtype
                )
                keys.hashes[key] = hashes[:usable]
        return keys

    def groups(self) -> Iterator[tuple[list[int], set[str]]]:
        """(hashes, the shards that key the prompt so), for every non-empty list."""
        for key, hashes in self.hashes.items():
            if hashes:
                yield hashes, {s for s, mine in self.schedule_of.items() if mine == key}

    def of_shard(self, shard_id: str) -> list[int]:
        return self.hashes.get(self.schedule_of.get(shard_id), [])

    def claimable(self, shard_id: str, blocks: int) -> int:
        """Of ``blocks`` cached leading blocks, what the shard's scheduler would claim (a
        token-sparse hit ends at a window boundary)."""
        key = self.schedule_of.get(shard_id)
        schedule = None if key is None else key[0]
        return blocks if schedule is None else schedule.whole_window_blocks(blocks, self.block_size)
