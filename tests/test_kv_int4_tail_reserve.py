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


def test_a_growth_past_the_reserve_is_logged_and_shown(toy_checkpoint) -> None:
    """The pool's growth (token-sparse prefill can hold more open than the reserve) is memory
    the geometry check did not count: a warning per growth, and the worker's gauges."""
    import numpy as np
    import structlog
    import torch

    from services.worker.kv_int4.store import Int4Store
    from services.worker.runner_host import RunnerHost
    from services.worker.telemetry import WorkerTelemetry

    store = Int4Store(1, 16, 4, 1, 8, torch.float32, torch.device("cpu"), tails=2)
    telemetry = WorkerTelemetry()
    telemetry.watch_int4_tails(store.tail_stats)
    with structlog.testing.capture_logs() as logs:
        store.open(np.arange(2))
        assert not logs
        store.open(np.arange(2, 5))  # 2 -> 4 -> 8
    grew = [e for e in logs if e["event"] == "int4_tail_pool_grew"]
    assert [(e["log_level"], e["tails"], e["reserved"]) for e in grew] == [
        ("warning", 4, 2),
        ("warning", 8, 2),
    ]
    store.close([0])
    value = telemetry.registry.get_sample_value
    assert value("rlt:kv_int4_open_tail_blocks") == 4
    assert value("rlt:kv_int4_tail_pool_blocks") == 8
    assert value("rlt:kv_int4_tail_reserve_blocks") == 2
    stats = store.tail_stats()
    assert (stats.peak_open_blocks, stats.growths) == (5, 2)

    limits = BatchLimits(max_num_seqs=2, max_num_batched_tokens=8)
    host = RunnerHost(
        toy_checkpoint, "cpu", torch.float32, kv_cache_dtype=INT4_DELTA, batch_limits=limits
    )
    host.load()
    assert host.int4_tails() is None  # no runner yet
    host.make_runner(256, 4, "last_exited")
    tails = host.int4_tails()
    assert tails is not None and tails.open_blocks == 0
    assert tails.pool_blocks == tails.reserved_blocks == open_blocks_bound(4, 4, limits)


def test_the_worker_reports_its_tails_in_health_and_metrics(toy_checkpoint) -> None:
    from services.worker.service import WorkerService

    config = SchedulerConfig(
        block_size=4,
        num_blocks=256,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        kv_cache_dtype=INT4_DELTA,
    )
    worker = WorkerService("nats://127.0.0.1:1", toy_checkpoint, config)  # never connects
    worker.runner_host.load()
    worker.runner_host.make_runner(256, 4, "last_exited")
    reserve = open_blocks_bound(4, 4, config.batch_limits)
    assert worker.health_details()["kv_int4_tails"] == {
        "open_blocks": 0,
        "peak_open_blocks": 0,
        "pool_blocks": reserve,
        "reserved_blocks": reserve,
        "growths": 0,
    }
    value = worker.telemetry.registry.get_sample_value
    assert value("rlt:kv_int4_tail_pool_blocks") == value("rlt:kv_int4_tail_reserve_blocks")
    plain = WorkerService("nats://127.0.0.1:1", toy_checkpoint, SchedulerConfig(num_blocks=16))
    assert "kv_int4_tails" not in plain.health_details()
    assert plain.telemetry.registry.get_sample_value("rlt:kv_int4_tail_pool_blocks") is None
