"""int4-delta's tail reserve (``kernels.kv_codec.tail_reserve_blocks``): one tail per
``TAIL_SHARE`` block ids, or what the scheduler's batches can hold open, whichever is more;
the worker's pool starts there and, without token-sparse prefill, never grows past it."""

from __future__ import annotations

import pytest

from kernels.kv_codec import (
    DEFAULT_BATCH_LIMITS,
    INT4_DELTA,
    TAIL_SHARE,
    BatchLimits,
    open_blocks_bound,
    tail_reserve_blocks,
)
from messages.api import FinishedEvent
from messages.sampling import SamplingParams
from services.common.config import SchedulerConfig
from services.common.fit import blocks_in_memory
from services.engine.engine import LLMEngine

pytestmark = pytest.mark.unit


def _touched(offset: int, tokens: int, bs: int) -> int:
    """Blocks a request holds open in one plane after writing ``tokens`` positions from
    ``offset`` into its partial block (0: it has none; then nothing written, nothing held)."""
    if tokens == 0:
        return 1 if offset else 0
    return (offset + tokens - 1) // bs - offset // bs + 1


def _worst_open(seqs: int, tokens: int, bs: int) -> int:
    """The most blocks open in one plane over every way ``seqs`` requests, each at any
    offset in its partial block, can share a batch of ``tokens`` positions."""
    best = [max(_touched(o, t, bs) for o in range(bs)) for t in range(tokens + 1)]
    most = [0] * (tokens + 1)  # most[b]: the most open with b tokens spent so far
    for _ in range(seqs):
        most = [max(most[b - t] + best[t] for t in range(b + 1)) for b in range(tokens + 1)]
    return most[tokens]


@pytest.mark.parametrize("bs", [2, 3, 4, 8])
def test_the_open_bound_is_the_worst_case_of_any_batch(bs: int) -> None:
    for seqs in range(1, 5):
        for tokens in range(1, 24):
            limits = BatchLimits(seqs, tokens)
            assert open_blocks_bound(1, bs, limits) == _worst_open(seqs, tokens, bs)
            assert open_blocks_bound(3, bs, limits) == 3 * _worst_open(seqs, tokens, bs)


def test_the_reserve_is_the_share_or_the_open_bound_whichever_is_more() -> None:
    limits = BatchLimits(max_num_seqs=8, max_num_batched_tokens=256)
    bound = open_blocks_bound(4, 16, limits)
    assert bound == 4 * (8 + 8 + (256 - 16) // 16)
    # many block ids, few requests: the share
    assert tail_reserve_blocks(INT4_DELTA, 100_000, bound) == -(-100_000 // TAIL_SHARE)
    # many requests, short contexts: every running request's partial block in every plane
    many = open_blocks_bound(4, 16, BatchLimits(max_num_seqs=256, max_num_batched_tokens=2048))
    assert many == 4 * (256 + 256 + (2048 - 512) // 16) > -(-16_384 // TAIL_SHARE)
    assert tail_reserve_blocks(INT4_DELTA, 16_384, many) == many
    assert tail_reserve_blocks(INT4_DELTA, 100, many) == 100  # never more than a tail per id
    assert tail_reserve_blocks("fp8", 16_384, many) == 0


def test_memory_holds_the_blocks_beside_the_larger_reserve() -> None:
    block, tail, memory = 10, 30, 100_000
    for bound in (0, 50, 2_000):
        n = blocks_in_memory(memory, block, tail, bound)
        assert n * block + tail_reserve_blocks(INT4_DELTA, n, bound) * tail <= memory
        more = n + 1
        assert more * block + tail_reserve_blocks(INT4_DELTA, more, bound) * tail > memory
    assert blocks_in_memory(memory, block, tail, 2_000) < blocks_in_memory(memory, block, tail)


def test_the_config_hands_its_limits_on() -> None:
    assert SchedulerConfig().batch_limits == DEFAULT_BATCH_LIMITS
    config = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=40)
    assert config.batch_limits == BatchLimits(3, 40)


@pytest.mark.parametrize(
    "prefill",
    [
        {},  # wavefront
        {"split_prefill": True, "wavefront_chunked_prefill": False},
        {"split_prefill": False},  # atomic
    ],
)
def test_many_short_requests_never_grow_the_pool(toy_model, prefill: dict) -> None:
    """16 short requests at once, 4 planes, blocks of 4: more blocks are open at once than
    one tail per 32 block ids, never more than the reserve; some exit early."""
    config = SchedulerConfig(
        block_size=4,
        num_blocks=512,
        max_num_seqs=16,
        max_num_batched_tokens=48,
        prefill_chunk_size=12,
        kv_cache_dtype=INT4_DELTA,
        **prefill,
    )
    engine = LLMEngine(toy_model, config)
    store = engine.runner.int4.store
    planes = toy_model.cfg.total_ut_steps
    assert planes == 4
    reserve = open_blocks_bound(planes, 4, config.batch_limits)
    assert -(-513 // TAIL_SHARE) < 64 < reserve < 513
    assert store.pool_blocks == store.reserved_tails == reserve
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, exit_threshold=0.6)
    for i in range(20):
        prompt = [(7 * i + 13 * j) % 400 + 1 for j in range(5 + (i * 7) % 14)]
        engine.add_request(f"r{i}", prompt, params)
    finished = 0
    while engine.has_unfinished_requests():
        finished += sum(isinstance(e, FinishedEvent) for e in engine.step())
    assert finished == 20
    assert store.peak_open_blocks > -(-513 // TAIL_SHARE)  # the share alone would grow
    assert store.growths == 0 and store.pool_blocks == reserve
    # between batches a request holds at most its partial block per plane (the last ones
    # to finish are released with the next batch)
    assert 0 < store.open_blocks <= planes * len(engine.runner.requests)
