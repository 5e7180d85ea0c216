"""Prefill/decode disaggregation under ``--kv-cache-dtype int4-delta``, in one process (two
engines, two NIXL agents, real READs; ``tests/disaggregation_pair.py``).

Only a prompt's full blocks move: they are sealed on the prefill worker at every plane, so a
pull lands their codes, scales, zero points and ``stored`` flags, never decoded values. A
last block that is not full is open there (its tokens exact in a tail no peer reads): the
decode shard prefills those tokens, fewer than a block, from the pulled codes. Tokens and
exit depths equal a colocated int4-delta run and the serial oracle applying its own
int4-delta codec, every token compared."""

from __future__ import annotations

import dataclasses

import pytest

from kernels.kv_codec import block_bytes
from messages.sampling import SamplingParams
from services.common.config import KVAdmission, SchedulerConfig
from services.scheduler.core.disaggregation import FALLBACK_NO_SEALED_BLOCK
from services.worker.kv_transfer.agent import TransferError, nixl_available
from services.worker.kv_transfer.pulls import arena_of
from tests.disaggregation_pair import (
    CONFIGS,
    GREEDY_EXIT,
    PROMPTS,
    SHARED_PREFIX,
    Pair,
    colocated,
    compare,
    workload,
)
from tests.engine_harness import assert_matches_oracle, oracle_result

pytestmark = [
    pytest.mark.oracle,
    pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed"),
]

INT4 = {"kv_cache_dtype": "int4-delta"}
# each under another anchor interval: 2 (the default), 0 (plane 0 the only anchor), 1
INT4_CONFIGS = {
    name: dataclasses.replace(CONFIGS[name], kv_int4_anchor_every=anchor_every, **INT4)
    for name, anchor_every in (
        ("wcpb-async-prefix", 2),
        ("atomic-sync", 0),
        ("speculative-decode", 1),
    )
}


def _block_bytes(model, config: SchedulerConfig) -> int:
    """Bytes one pulled block moves: codes, scales, zero points and flags of every layer."""
    cfg = model.cfg
    one = block_bytes(
        "int4-delta", config.block_size, cfg.num_key_value_heads, cfg.head_dim,
        model.dtype.itemsize,
    )  # fmt: skip
    return one * cfg.num_hidden_layers


def _check_oracle(oracle, model, pair: Pair, requests, config: SchedulerConfig) -> int:
    compared = 0
    for rid, prompt, p in requests:
        want = oracle_result(oracle, prompt, p.resolve(model.cfg.total_ut_steps, 512), config)
        compared += assert_matches_oracle(pair.finished()[rid], want, rid)
    return compared


@pytest.mark.parametrize("name", list(INT4_CONFIGS))
def test_int4_disaggregated_equals_the_int4_oracle(toy_model, oracle, name):
    """Every request hands over; each pull moves exactly its prompt's full blocks (every
    plane and layer at int4-delta's bytes), the decode shard prefills the rest of the
    last block, and tokens and exit depths equal a colocated run and the int4 oracle."""
    config = INT4_CONFIGS[name]
    requests = workload(GREEDY_EXIT)
    expected = colocated(toy_model, config, requests)
    pair = Pair.build(toy_model, config)
    assert len(arena_of(pair.decode.runner).tensors) == 7  # codes and every field beside
    for request in requests:
        pair.add(*request)
    pair.run()
    compare(pair, expected)
    assert pair.handed_off == len(requests) and pair.pulled == len(requests)
    bs, planes = config.block_size, toy_model.cfg.total_ut_steps
    full_blocks = sum(len(prompt) // bs for _, prompt, _ in requests)
    per_block = planes * _block_bytes(toy_model, config)
    if config.enable_prefix_caching:  # blocks hit on the decode shard are not pulled again
        assert pair.executor.bytes % per_block == 0
        assert 0 < pair.executor.bytes <= full_blocks * per_block
    else:
        assert pair.executor.bytes == full_blocks * per_block
    # a prompt that ends in a partial block prefills its last tokens on the decode shard
    assert any(len(prompt) % bs for _, prompt, _ in requests)
    assert any(len(prompt) % bs == 0 for _, prompt, _ in requests)  # and one that does not
    assert pair.decode.scheduler.stats.kv_transfer_fallbacks == {}
    pair.check_no_leaks(config)
    if config.speculative_tokens:  # the decode shard speculated over pulled int4 KV
        assert pair.decode.scheduler.spec_stats.num_spec_rows > 0
    compared = _check_oracle(oracle, toy_model, pair, requests, config)
    assert compared == len(requests) * GREEDY_EXIT.max_tokens  # every token


def test_a_prompt_shorter_than_a_block_prefills_on_the_decode_shard(toy_model, oracle):
    """Nothing of a prompt under one block is sealed: no pull, the handoff goes back at
    once, the fallback is counted by its reason, and the tokens are the oracle's."""
    config = INT4_CONFIGS["wcpb-async-prefix"]
    requests = [("short", [8, 9, 10], GREEDY_EXIT), ("long", PROMPTS["a"], GREEDY_EXIT)]
    pair = Pair.build(toy_model, config)
    for request in requests:
        pair.add(*request)
    pair.run()
    assert pair.handed_off == 2 and pair.pulled == 1 and pair.unused == 1
    fallbacks = pair.decode.scheduler.stats.kv_transfer_fallbacks
    assert fallbacks == {FALLBACK_NO_SEALED_BLOCK: 1}
    assert _check_oracle(oracle, toy_model, pair, requests, config) == 2 * GREEDY_EXIT.max_tokens
    pair.check_no_leaks(config)


def test_int4_prefix_hits_on_the_decode_side_pull_only_the_rest(toy_model, oracle):
    """The decode shard publishes a pulled prompt's full blocks (sealed there) as its
    prefix cache: the next request of the shared prefix pulls only the full blocks past
    the hit, with the oracle's tokens."""
    config = INT4_CONFIGS["wcpb-async-prefix"]
    first, second = ("c", PROMPTS["c"], GREEDY_EXIT), ("d", PROMPTS["d"], GREEDY_EXIT)
    pair = Pair.build(toy_model, config)
    pair.add(*first)
    pair.run()
    before = pair.executor.bytes
    pair.add(*second)
    pair.run()
    bs, planes = config.block_size, toy_model.cfg.total_ut_steps
    hit = len(SHARED_PREFIX) // bs
    pulled = len(PROMPTS["d"]) // bs - hit
    assert pulled > 0 and before == len(PROMPTS["c"]) // bs * planes * _block_bytes(
        toy_model, config
    )
    assert pair.executor.bytes - before == pulled * planes * _block_bytes(toy_model, config)
    compared = _check_oracle(oracle, toy_model, pair, [first, second], config)
    assert compared == 2 * GREEDY_EXIT.max_tokens
    pair.check_no_leaks(config)


def test_int4_tight_kv_and_sparse_prefill_hand_over(toy_model, oracle):
    """Tight KV on both shards (decode-side waits and preemption) and token-sparse prefill
    (frozen tokens sealed without a delta, then pulled; the decode shard's prefill of a
    prompt's rest starts at a window): the oracle's tokens and exit depths."""
    sparse = SamplingParams(
        max_tokens=8, temperature=0.0, min_loops=1, exit_threshold=0.6, ignore_eos=True,
        token_sparse_prefill=True,
    )  # fmt: skip
    prompts = {
        "s1": [(7 * i + 3) % 90 + 1 for i in range(37)],
        "s2": [*SHARED_PREFIX, *[(5 * i + 1) % 90 + 1 for i in range(21)]],
    }
    requests = [(rid, prompt, sparse) for rid, prompt in prompts.items()]
    for k in range(2):
        requests += [(f"{rid}{k}", [*p, k + 1], GREEDY_EXIT) for rid, p in PROMPTS.items()]
    config = SchedulerConfig(
        block_size=4, num_blocks=48, max_num_seqs=4, max_num_batched_tokens=8,
        prefill_chunk_size=4, kv_admission=KVAdmission.INCREMENTAL, sparse_window=8, **INT4,
    )  # fmt: skip
    pair = Pair.build(toy_model, config)
    for request in requests:
        pair.add(*request)
    pair.run()
    assert pair.pulled == len(requests)
    stats = pair.decode.scheduler.stats
    assert stats.num_preemptions > 0 and stats.kv_transfer_fallbacks == {}
    assert pair.prefill.scheduler.stats.num_prefill_rows_saved > 0  # it did run sparse
    compared = _check_oracle(oracle, toy_model, pair, requests, config)
    assert compared == sum(p.max_tokens for _, _, p in requests)
    pair.check_no_leaks(config)


def test_shards_of_different_anchor_intervals_never_share_a_block(toy_model, oracle):
    """The anchor interval says which planes' codes are deltas: shards that differ in it
    refuse the handoff by name (the decode shard prefills, with its own oracle's tokens),
    and so do their workers."""
    two = INT4_CONFIGS["wcpb-async-prefix"]
    one = dataclasses.replace(two, kv_int4_anchor_every=1)
    assert two.kv_int4_anchor_every == 2
    pair = Pair.build(toy_model, two, one)
    why = pair.decode.scheduler.block_format.mismatch(pair.prefill.scheduler.block_format)
    assert why == "kv_int4_anchor_every: 1 vs 2"
    requests = workload(GREEDY_EXIT)[:2]
    for request in requests:
        pair.add(*request)
    pair.run()
    assert pair.handed_off == len(requests) and pair.pulled == 0
    compared = _check_oracle(oracle, toy_model, pair, requests, one)
    assert compared == len(requests) * GREEDY_EXIT.max_tokens
    with pytest.raises(TransferError) as err:
        pair.executor.agent.plan(pair.executor.source.source_info(), [0], [0])
    assert err.value.cause == "layout_mismatch" and "kv_int4_anchor_every: 1 vs 2" in str(err.value)
    pair.check_no_leaks(one)
