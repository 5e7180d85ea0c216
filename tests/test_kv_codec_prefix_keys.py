"""A prefix block's key includes the KV codec: blocks are never shared across codecs, and
admission keys a shard's lookups the way that shard's scheduler keys its blocks."""

from __future__ import annotations

import pytest

from messages.internal import ShardAnnounce
from messages.prefix import cacheable_prefix_blocks, prompt_block_hashes
from messages.sampling import SamplingParams
from services.admission.prefix_keys import PrefixKeys
from services.admission.shards import ShardTable
from services.common.config import ModelLimits, SchedulerConfig
from services.common.sparse_prefill import prefix_block_hashes
from services.scheduler.core.scheduler import Scheduler

pytestmark = pytest.mark.unit

BS = 4
LIMITS = ModelLimits(
    total_ut_steps=4, vocab_size=500, max_position_embeddings=4096, eos_token_ids=(0,)
)
PROMPT = list(range(1, 30))


def _scheduler(codec: str) -> Scheduler:
    config = SchedulerConfig(
        block_size=BS, num_blocks=256, enable_prefix_caching=True, kv_cache_dtype=codec
    )
    return Scheduler(config, LIMITS)


def test_codec_changes_every_block_hash_and_auto_keeps_the_old_ones() -> None:
    auto = prefix_block_hashes(PROMPT, BS, None)
    assert auto == prompt_block_hashes(PROMPT, BS)  # existing indexes stay valid
    fp8 = prefix_block_hashes(PROMPT, BS, None, kv_cache_dtype="fp8")
    int4 = prefix_block_hashes(PROMPT, BS, None, kv_cache_dtype="int4-delta")
    assert len(auto) == len(fp8) == len(int4) > 0
    assert not set(auto) & set(fp8) and not set(fp8) & set(int4) and not set(auto) & set(int4)


def test_a_scheduler_keys_blocks_by_its_codec() -> None:
    params = SamplingParams(max_tokens=1)
    auto = _scheduler("auto").add_request("a", PROMPT, params).block_hashes
    fp8 = _scheduler("fp8").add_request("b", PROMPT, params).block_hashes
    assert auto and fp8 and not set(auto) & set(fp8)


def test_admission_keys_each_shard_by_its_announced_codec() -> None:
    table = ShardTable("adm", block_size=BS)
    schedulers = {"0": _scheduler("auto"), "1": _scheduler("fp8")}
    for sid, s in schedulers.items():
        announce = ShardAnnounce(
            shard_id=sid,
            scheduler_id=f"s{sid}",
            producer_id=f"p{sid}",
            block_size=BS,
            enable_prefix_caching=True,
            kv_cache_dtype=s.config.kv_cache_dtype,
        )
        assert table.announce(announce, 0.0) == (None, None)
    params = SamplingParams(max_tokens=1)
    keys = PrefixKeys.of(PROMPT, BS, params, None, table.shards.values())
    usable = cacheable_prefix_blocks(len(PROMPT), BS)
    for sid, s in schedulers.items():
        request = s.add_request(f"r{sid}", PROMPT, params)
        assert keys.of_shard(sid) == request.block_hashes[:usable]
    assert len(list(keys.groups())) == 2  # one lookup per codec, never a shared one
