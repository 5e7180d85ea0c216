"""Prefix caching in the engine: reuse equals cold generation (the oracle), hits set the
prefill origin, publication follows the final-depth frontier and is ordered by batch seq."""

from __future__ import annotations

import pytest

from messages.batch import RowKind
from messages.prefix import BlockRemoved, BlockStored
from messages.sampling import SamplingParams
from services.common.config import SchedulerConfig
from services.engine.engine import LLMEngine
from tests.engine_harness import Arrival, assert_matches_oracle, oracle_result, run_workload

D = 4
BASE = [17, 4, 250, 31, 99, 8, 61, 120, 7, 300, 42, 11, 5, 19, 77, 23]  # 16 tokens
GREEDY = SamplingParams(
    max_tokens=5, temperature=0.0, min_loops=1, exit_threshold=0.7, ignore_eos=True
)

MODES = {
    "atomic": {},
    "split": {"split_prefill": True},
    "wcpb": {"wavefront_chunked_prefill": True},
}


@pytest.mark.oracle
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("mode", list(MODES))
def test_prefix_reuse_equals_cold_generation(toy_model, oracle, mode, async_scheduling):
    config = SchedulerConfig(
        block_size=4,
        num_blocks=256,
        prefill_chunk_size=3,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
        async_scheduling=async_scheduling,
        **MODES[mode],
    )
    first = Arrival("first", [*BASE, 2, 3], GREEDY, step=0)
    # arrives after `first` has finished its prompt: 4 full cached blocks, 16 tokens
    second = Arrival("second", [*BASE, 9, 9, 9], GREEDY, step=40)
    record = run_workload(toy_model, config, [first, second])
    assert record.finished["first"].num_cached_tokens == 0
    assert record.finished["second"].num_cached_tokens == 16
    second_rows = [
        t
        for b in record.batches
        for t in b.tasks
        if t.request.request_id == "second" and t.kind != RowKind.DECODE
    ]
    assert second_rows[0].token_start == 16  # hits x block_size
    compared = 0
    for a in (first, second):
        expected = oracle_result(oracle, a.prompt, a.params.resolve(D, 512), config)
        compared += assert_matches_oracle(record.finished[a.request_id], expected, f"{mode} {a}")
    assert compared > 0


@pytest.mark.unit
def test_lookup_never_covers_the_last_prompt_token(toy_model) -> None:
    config = SchedulerConfig(block_size=4, num_blocks=128, enable_prefix_caching=True)
    prompt = BASE[:8]  # exactly two full blocks
    record = run_workload(
        toy_model, config, [Arrival("a", prompt, GREEDY), Arrival("b", prompt, GREEDY, step=30)]
    )
    assert record.finished["b"].num_cached_tokens == 4  # block 2 holds the last token
    assert record.finished["b"].token_ids == record.finished["a"].token_ids


@pytest.mark.unit
def test_a_partial_last_block_is_never_published(toy_model) -> None:
    config = SchedulerConfig(block_size=4, num_blocks=128, enable_prefix_caching=True)
    engine = LLMEngine(toy_model, config)
    engine.add_request("a", BASE[:10], GREEDY)  # blocks [0,4) and [4,8) full, [8,10) partial
    stored: list[int] = []
    while engine.has_unfinished_requests():
        engine.step()
        envelope = engine.scheduler.take_prefix_events()
        for event in envelope.events if envelope else []:
            if isinstance(event, BlockStored):
                stored += event.block_hashes
    assert len(stored) == 2
    assert set(stored) == engine.scheduler.kv.cached_block_hashes()


@pytest.mark.unit
def test_blocks_are_readable_only_in_batches_after_the_one_that_wrote_them(toy_model):
    """Async WCPB: a later request sharing the prefix claims blocks while the writer is
    still in flight; every claimed block was written by an earlier batch."""
    config = SchedulerConfig(
        block_size=2,
        num_blocks=256,
        prefill_chunk_size=2,
        max_num_batched_tokens=6,
        wavefront_chunked_prefill=True,
        enable_prefix_caching=True,
        async_scheduling=True,
        max_inflight_batches=3,
    )
    checked = []

    def on_batch(batch):
        kv = engine.scheduler.kv
        for new in batch.wire.new_requests:
            table = kv.tables(new.request_id)
            request = engine.scheduler.requests[new.request_id]
            for i in range(request.num_cached_tokens // config.block_size):
                group = kv._groups[table[0][i]]
                assert group.batch_seq < batch.seq
                checked.append(group.batch_seq)

    engine = LLMEngine(toy_model, config, on_batch=on_batch)
    engine.add_request("writer", BASE, GREEDY)
    for step in range(60):
        if step % 6 == 0:
            engine.add_request(f"reader{step}", [*BASE[: 4 + step // 6 * 2], 1], GREEDY)
        engine.step()
    engine.run_until_done()
    assert checked, "no reader ever hit the cache"


@pytest.mark.oracle
def test_eviction_under_pressure_degrades_hits_never_outputs(toy_model, oracle) -> None:
    # room for about two requests: cached blocks of finished requests get evicted (LRU)
    config = SchedulerConfig(block_size=4, num_blocks=40, enable_prefix_caching=True)
    arrivals = [
        Arrival("a", [*BASE, 1], GREEDY, step=0),
        Arrival(
            "b", [300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311, 2], GREEDY, step=25
        ),
        Arrival(
            "c", [400, 401, 402, 403, 404, 405, 406, 407, 408, 409, 410, 411, 3], GREEDY, step=50
        ),
        Arrival("d", [*BASE, 4], GREEDY, step=75),
    ]
    record = run_workload(toy_model, config, arrivals)
    assert record.engine is not None
    envelope = record.engine.scheduler.take_prefix_events()
    engine_events = envelope.events if envelope else []
    assert any(isinstance(e, BlockRemoved) for e in engine_events), "nothing was evicted"
    # d shares a's prefix but some of it was evicted: a shorter (possibly empty) hit
    assert 0 < record.finished["d"].num_cached_tokens < 16
    compared = 0
    for a in arrivals:
        expected = oracle_result(oracle, a.prompt, a.params.resolve(D, 512), config)
        compared += assert_matches_oracle(record.finished[a.request_id], expected, a.request_id)
    assert compared > 0


@pytest.mark.unit
@pytest.mark.parametrize("mode", ["split", "wcpb"])
def test_sync_and_async_publish_the_same_blocks_in_the_same_order(toy_model, mode) -> None:
    def published(async_scheduling: bool) -> list[tuple[type, tuple[int, ...]]]:
        config = SchedulerConfig(
            block_size=2,
            num_blocks=256,
            prefill_chunk_size=3,
            max_num_batched_tokens=5,
            enable_prefix_caching=True,
            async_scheduling=async_scheduling,
            **MODES[mode],
        )
        engine = LLMEngine(toy_model, config)
        engine.add_request("a", BASE, GREEDY)
        engine.add_request("b", [*BASE[:6], 1, 2, 3, 4, 5, 6, 7], GREEDY)
        out = []
        while engine.has_unfinished_requests():
            engine.step()
            envelope = engine.scheduler.take_prefix_events()
            for event in envelope.events if envelope else []:
                out.append((type(event), tuple(getattr(event, "block_hashes", ()))))
        return out

    sync, asynchronous = published(False), published(True)
    assert sync and sync == asynchronous


@pytest.mark.unit
def test_prefix_index_agrees_with_the_kv_manager_after_every_step(toy_model) -> None:
    """Envelopes drained after each engine step, applied to the real prefix-cache index,
    reproduce exactly the scheduler's cached blocks, through publication and eviction."""
    from services.prefix_cache.core import PrefixIndex

    config = SchedulerConfig(
        block_size=4,
        num_blocks=40,
        enable_prefix_caching=True,
        wavefront_chunked_prefill=True,
        prefill_chunk_size=4,
        async_scheduling=True,
    )
    engine = LLMEngine(toy_model, config)
    index = PrefixIndex()
    producer = engine.scheduler.prefix_log.producer_id
    prompts = [
        [*BASE, 1],
        [300 + i for i in range(13)],
        [*BASE[:8], 5, 6, 7, 8, 9],
        [400 + i for i in range(13)],
        [*BASE, 2],
    ]
    evicted = False
    for step in range(400):
        if step % 20 == 0 and prompts:
            engine.add_request(f"r{step}", prompts.pop(0), GREEDY)
        engine.step()
        envelope = engine.scheduler.take_prefix_events()
        if envelope is not None:
            outcome = index.apply(envelope)
            assert outcome.applied and not outcome.gap  # in-order delivery: no gaps
            evicted |= any(isinstance(e, BlockRemoved) for e in envelope.events)
        held = index.cached_blocks().get(producer, set())
        assert held == engine.scheduler.kv.cached_block_hashes()
        if not prompts and not engine.has_unfinished_requests():
            break
    assert evicted and index.cached_blocks()[producer]
