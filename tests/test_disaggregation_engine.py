"""Prefill/decode disaggregation in one process: a prefill engine runs each prompt and its
first token, hands the request over, and a decode engine pulls the prompt's KV (every
plane) from the prefill engine's runner with NIXL (two agents, real READs) and decodes.
Tokens, exit depths and log-probabilities equal a colocated run (and the serial oracle);
a failed pull or a handoff no longer held prefills on the decode side, with the same
tokens; no block leaks on either side."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.kv_codec import block_bytes
from messages.api import FinishedEvent, TokenEvent
from messages.prefix import prompt_block_hashes
from messages.sampling import SamplingParams
from services.common.config import KVAdmission, KVLayout, SchedulerConfig
from services.common.sparse_prefill import resolve_sparse_prefill
from services.engine.engine import LLMEngine
from services.oracle import SparseSetting
from services.scheduler.core.request import RequestState
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

SAMPLED = SamplingParams(max_tokens=9, temperature=0.9, top_k=20, seed=1234, ignore_eos=True)
WITH_LOGPROBS = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("params", [GREEDY_EXIT, SAMPLED], ids=["greedy-exit", "sampled"])
def test_disaggregated_equals_colocated(toy_model, oracle, name, params):
    config = CONFIGS[name]
    requests = workload(params)
    expected = colocated(toy_model, config, requests)
    pair = Pair.build(toy_model, config)
    for request in requests:
        pair.add(*request)
    pair.run()
    compare(pair, expected)
    assert pair.handed_off == len(requests) and pair.pulled == len(requests)
    assert pair.executor.bytes > 0
    pair.check_no_leaks(config)
    if config.speculative_tokens:  # the decode shard's cycles really ran
        assert pair.decode.scheduler.spec_stats.num_spec_rows > 0
    if params is GREEDY_EXIT:
        shared = config.kv_layout == KVLayout.SHARED
        for rid, prompt, p in requests:
            want = oracle.generate(
                prompt,
                max_tokens=p.max_tokens,
                min_loops=p.min_loops,
                exit_threshold=p.exit_threshold,
                ignore_eos=True,
                kv_layout=config.kv_layout.value,
                prefill_chunk_size=config.prefill_chunk_size if shared else None,
            )
            assert pair.finished()[rid].token_ids == want.token_ids


@pytest.mark.parametrize("codec", ["auto", "fp8"])
def test_prefix_hits_on_the_decode_side_pull_only_the_rest(toy_model, codec):
    """The second request of a shared prefix finds it cached on the decode shard (pulled
    for the first, under the codec's key): it pulls only the blocks past it, and its tokens
    stay the same."""
    config = dataclasses.replace(CONFIGS["wcpb-async-prefix"], kv_cache_dtype=codec)
    first, second = ("c", PROMPTS["c"], GREEDY_EXIT), ("d", PROMPTS["d"], GREEDY_EXIT)
    expected = colocated(toy_model, config, [first, second])
    pair = Pair.build(toy_model, config)
    pair.add(*first)
    pair.run()
    before = pair.executor.bytes
    pair.add(*second)
    pair.run()
    compare(pair, expected)
    one_block = before // -(-len(PROMPTS["c"]) // config.block_size)
    blocks_second = -(-len(PROMPTS["d"]) // config.block_size)
    hit = len(SHARED_PREFIX) // config.block_size
    assert pair.executor.bytes - before == one_block * (blocks_second - hit)
    pair.check_no_leaks(config)


def test_logprobs_equal_colocated(toy_model):
    config = CONFIGS["wcpb-async-prefix"]
    requests = workload(WITH_LOGPROBS)[:3]
    engine = LLMEngine(toy_model, config)
    for request in requests:
        engine.core.add_request(*request)
    want = [e for e in engine.run_until_done() if isinstance(e, TokenEvent)]
    pair = Pair.build(toy_model, config)
    for request in requests:
        pair.add(*request)
    pair.run()
    got = [e for e in pair.events if isinstance(e, TokenEvent)]

    def key(e: TokenEvent):
        return (e.request_id, e.index)

    assert sorted(map(key, got)) == sorted(map(key, want))
    by_key = {key(e): e for e in want}
    for event in got:
        other = by_key[key(event)]
        mine, theirs = event.logprobs, other.logprobs
        assert event.token_id == other.token_id and mine is not None and theirs is not None
        # float32 rows in other batch shapes: equal to rounding
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert [t.token_id for t in mine.top_logprobs] == [t.token_id for t in theirs.top_logprobs]
        for a, b in zip(mine.top_logprobs, theirs.top_logprobs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


@pytest.mark.parametrize("failure", ["pull-fails", "handoff-expired"])
def test_lost_kv_is_prefilled_on_the_decode_side(toy_model, failure):
    config = CONFIGS["wcpb-async-prefix"]
    requests = workload(GREEDY_EXIT)
    expected = colocated(toy_model, config, requests)
    pair = Pair.build(toy_model, config)
    pair.executor.fail = failure == "pull-fails"
    pair.release_held = failure != "handoff-expired"
    for request in requests:
        pair.add(*request)
    pair.run()
    compare(pair, expected)
    assert pair.handed_off == len(requests) and pair.pulled == 0
    pair.check_no_leaks(config)


def _hand_over_all(pair: Pair, n: int) -> None:
    """Runs the prefill side until ``n`` requests are handed to the decode side."""
    for _ in range(2000):
        if pair.handed_off >= n:
            return
        pair.events += pair.prefill.step()
        pair._hand_over()
    raise AssertionError("no handoff")


def _drain(pair: Pair) -> None:
    """Steps the decode side until its batches in flight (their pulls) are back."""
    for _ in range(50):
        pair.events += pair.decode.step()
        pair._confirm()
        if not pair.decode.core.inflight:
            return


def test_an_abort_before_or_during_a_pull_leaks_nothing(toy_model):
    """Aborted on the decode shard before its pull started, the handoff goes back at once
    (not after the hold time); aborted while its blocks land, they are freed when the
    worker says the pull is over. Each request ends once, aborted."""
    config = CONFIGS["wcpb-async-prefix"]
    pair = Pair.build(toy_model, config)
    pair.add("a", PROMPTS["a"], GREEDY_EXIT)
    pair.add("b", PROMPTS["b"], GREEDY_EXIT)
    _hand_over_all(pair, 2)
    pair.events += pair.decode.core.abort_request("a")  # still waiting to start there
    pair.events += pair.decode.step()
    assert pair.decode.scheduler.requests["b"].state is RequestState.RECEIVING_KV
    pair.events += pair.decode.core.abort_request("b")  # its pull is in flight
    _drain(pair)
    finished = pair.finished()
    assert {rid: e.finish_reason for rid, e in finished.items()} == {"a": "abort", "b": "abort"}
    assert sum(isinstance(e, FinishedEvent) for e in pair.events) == 2
    assert pair.unused == 1  # "a": never read
    pair.check_no_leaks(config)


def test_a_decode_worker_lost_mid_pull_prefills_and_releases_the_handoff(toy_model):
    config = CONFIGS["wcpb-async-prefix"]
    requests = workload(GREEDY_EXIT)[:2]
    expected = colocated(toy_model, config, requests)
    pair = Pair.build(toy_model, config)
    for request in requests:
        pair.add(*request)
    _hand_over_all(pair, 2)
    pair.events += pair.decode.step()
    assert all(
        r.state is RequestState.RECEIVING_KV for r in pair.decode.scheduler.requests.values()
    )
    pair.executor._queued.clear()  # the worker and its batches are gone
    pair.decode.core.reset_after_executor_loss()
    pair.run()
    compare(pair, expected)
    assert pair.pulled == 0 and pair.unused == 2
    pair.check_no_leaks(config)


def test_landing_blocks_of_an_unconfirmed_abort_are_never_reused(toy_model):
    """A pull that failed without NIXL confirming its abort: its landing blocks stay out
    of use (a late write could land there) until the worker's KV is reset; the request
    prefills elsewhere in the pool, with the same tokens."""
    config = CONFIGS["wcpb-async-prefix"]
    requests = workload(GREEDY_EXIT)[:2]
    expected = colocated(toy_model, config, requests)
    pair = Pair.build(toy_model, config)
    pair.executor.fail = pair.executor.unconfirmed = True
    for request in requests:
        pair.add(*request)
    pair.run()
    compare(pair, expected)
    pulls = pair.decode.scheduler.pulls
    kv = pair.decode.scheduler.kv
    blocks = sum(-(-len(PROMPTS[rid]) // config.block_size) for rid, _, _ in requests)
    assert pulls.num_quarantined_blocks == blocks * 4  # every plane's landing blocks
    assert kv.num_free_blocks == config.num_blocks - pulls.num_quarantined_blocks
    pair.decode.core.reset_after_executor_loss()  # a new worker KV: nothing to fear
    assert pulls.num_quarantined_blocks == 0
    assert pair.decode.scheduler.kv.num_free_blocks == config.num_blocks


SPARSE_PROMPTS = {
    "s1": [(7 * i + 3) % 90 + 1 for i in range(37)],
    "s2": [*SHARED_PREFIX, *[(5 * i + 1) % 90 + 1 for i in range(21)]],
    "s3": [(3 * i + 11) % 90 + 1 for i in range(9)],
}


def test_token_sparse_prefill_hands_over_with_the_same_tokens(toy_model, oracle):
    """A token-sparse prompt's planes already hold its frozen tokens' copied K/V: pulled
    as they are, the decode shard goes on with the colocated run's (and the oracle's)
    tokens and exit depths; its blocks publish under the sparse key on both sides."""
    config = SchedulerConfig(
        block_size=4, num_blocks=200, max_num_batched_tokens=8, prefill_chunk_size=4,
        enable_prefix_caching=True, sparse_window=8,
    )  # fmt: skip
    params = SamplingParams(
        max_tokens=8, temperature=0.0, min_loops=1, exit_threshold=0.6, ignore_eos=True,
        token_sparse_prefill=True,
    )  # fmt: skip
    requests = [(rid, prompt, params) for rid, prompt in SPARSE_PROMPTS.items()]
    expected = colocated(toy_model, config, requests)
    pair = Pair.build(toy_model, config)
    for request in requests:
        pair.add(*request)
    pair.run()
    compare(pair, expected)
    assert pair.handed_off == len(requests) and pair.pulled == len(requests)
    for rid, prompt, p in requests:
        want = oracle_result(oracle, prompt, p.resolve(toy_model.cfg.total_ut_steps, 512), config)
        assert assert_matches_oracle(pair.finished()[rid], want, rid) == p.max_tokens
    assert pair.prefill.scheduler.stats.num_prefill_rows_saved > 0  # it did run sparse
    # the pulled blocks are cached on the decode side under the sparse key, never the dense
    decode, prompt, bs = pair.decode.scheduler, SPARSE_PROMPTS["s1"], config.block_size
    steps = toy_model.cfg.total_ut_steps
    schedule = resolve_sparse_prefill(
        params.resolve(steps, 512), config.sparse_defaults(), steps, split_prefill=True
    )
    assert schedule is not None
    reusable = schedule.last_reusable_position(len(prompt)) // bs
    sparse_hashes = prompt_block_hashes(
        prompt, bs, decode.cache_salt + schedule.cache_key(), max_blocks=reusable
    )
    dense_hashes = prompt_block_hashes(prompt, bs)[:reusable]
    assert decode.kv.lookup_prefix(sparse_hashes) == len(sparse_hashes) > 0
    assert decode.kv.lookup_prefix(dense_hashes) == 0
    pair.check_no_leaks(config)


@pytest.mark.parametrize("lost", ["result", "answer"])
def test_a_pull_never_settled_prefills_past_its_deadline(toy_model, lost):
    """Results travel at most once: a pull whose result was lost (or whose release was
    never answered) ends past its deadline (twice the pull's timeout and a grace, from the
    first check that sees it): the request prefills with the same tokens and its handoff
    goes back at once. Without a result its landing blocks stay out of use until the
    worker's KV is reset (the worker may still write them); with one they are freed."""
    config = CONFIGS["wcpb-async-prefix"]
    requests = workload(GREEDY_EXIT)[:1]
    expected = colocated(toy_model, config, requests)
    pair = Pair.build(toy_model, config)
    pair.add(*requests[0])
    _hand_over_all(pair, 1)
    pulls = pair.decode.scheduler.pulls
    pair.events += pair.decode.step()
    assert len(pulls) == 1
    for _ in range(10):  # the batch that carried the pull comes back
        pair.events += pair.decode.step()
        for result in pair.executor.done:
            if lost == "answer":  # read: waits for the prefill side's word, which is lost
                assert pulls.pulled(result) is not None
        pair.executor.done.clear()
    limit = 2 * pulls.timeout_s + 10.0
    assert pulls.expire(100.0) == [] and pulls.expire(100.0 + limit) == []  # not yet
    assert pulls.expire(100.0 + limit + 0.1) == ["a"]
    pair._confirm()  # the handoff goes back with the unused ones
    assert pair.unused == 1 and len(pair.prefill.scheduler.handoffs) == 0
    pair.run()
    compare(pair, expected)
    blocks = -(-len(PROMPTS["a"]) // config.block_size) * 4  # every plane's landing blocks
    kept = blocks if lost == "result" else 0
    assert pulls.num_quarantined_blocks == kept
    assert pair.decode.scheduler.kv.num_free_blocks == config.num_blocks - kept


# ------------------------------------------------------------------ token-sparse prefill
# The prefill shard's setting travels with the handoff, whatever the decode shard's own
# defaults: its decode-side prefix hits and published blocks are keyed by it, and a prefill
# there after a failed pull runs under it, so the tokens equal the oracle's.
SPARSE_WINDOW = 8
SPARSE_SHARED = [(7 * i + 3) % 400 + 1 for i in range(24)]
SPARSE_PREFILL = SchedulerConfig(
    block_size=4, num_blocks=200, max_num_batched_tokens=8, prefill_chunk_size=4,
    enable_prefix_caching=True, token_sparse_prefill=True, sparse_window=SPARSE_WINDOW,
)  # fmt: skip
# the decode shard was started without the option: its own default is dense
DENSE_DECODE = SchedulerConfig(
    block_size=4, num_blocks=200, max_num_batched_tokens=8, prefill_chunk_size=4,
    enable_prefix_caching=True, sparse_window=2 * SPARSE_WINDOW,
)  # fmt: skip
SPARSE_DEFAULT = SamplingParams(max_tokens=6, temperature=0.0, exit_threshold=0.7, ignore_eos=True)
DENSE_ASKED = SamplingParams(
    max_tokens=6, temperature=0.0, exit_threshold=0.7, ignore_eos=True, token_sparse_prefill=False
)
SPARSE_SETTING = SparseSetting(SPARSE_WINDOW, (1.0, 1.0, 0.25, 0.1))


def _check_oracle(pair: Pair, oracle, rid: str, prompt: list[int], sparse: SparseSetting | None):
    want = oracle.generate(
        prompt, max_tokens=6, exit_threshold=0.7, ignore_eos=True, sparse_prefill=sparse
    )
    assert assert_matches_oracle(pair.finished()[rid], want, rid) == 6


def test_a_failed_pull_prefills_under_the_prefill_shards_setting(toy_model, oracle) -> None:
    pair = Pair.build(toy_model, SPARSE_PREFILL, DENSE_DECODE)
    pair.executor.fail = True
    prompt = [*SPARSE_SHARED, 50, 51, 52, 53, 54, 55, 56]
    pair.add("a", prompt, SPARSE_DEFAULT)
    pair.run()
    assert pair.handed_off == 1 and pair.pulled == 0
    _check_oracle(pair, oracle, "a", prompt, SPARSE_SETTING)
    pair.check_no_leaks(SPARSE_PREFILL)


def test_decode_side_prefix_blocks_are_keyed_by_the_carried_setting(toy_model, oracle) -> None:
    """A sparse request's pulled blocks are published on the decode shard under its sparse
    key: a dense request sharing the prefix finds none of them there (it pulls all of its
    own), a sparse one finds the whole windows."""
    pair = Pair.build(toy_model, SPARSE_PREFILL, DENSE_DECODE)
    first = [*SPARSE_SHARED, 60, 61, 62, 63, 64, 65]
    pair.add("sparse", first, SPARSE_DEFAULT)
    pair.run()
    dense = [*SPARSE_SHARED, 70, 71, 72, 73, 74]
    pair.add("dense", dense, DENSE_ASKED)
    pair.run()
    again = [*SPARSE_SHARED, 80, 81, 82, 83]
    pair.add("again", again, SPARSE_DEFAULT)
    pair.run()
    assert pair.pulled == 3
    _check_oracle(pair, oracle, "sparse", first, SPARSE_SETTING)
    _check_oracle(pair, oracle, "dense", dense, None)
    _check_oracle(pair, oracle, "again", again, SPARSE_SETTING)
    cached = {rid: e.num_cached_tokens for rid, e in pair.finished().items()}
    assert cached["dense"] == 0 and cached["again"] == 24
    pair.check_no_leaks(SPARSE_PREFILL)


def test_small_kv_on_both_sides_waits_for_decode_kv_and_never_falls_back(toy_model, oracle):
    """Small KV on both shards, more requests than fit: a request whose landing blocks do
    not fit waits for decode KV (back in the waiting queue, its handoff held) instead of
    prefilling on the decode shard; decode-side preemption recomputes mid-decode; every
    token equals a colocated run and the oracle, no fallback is counted, and no block is
    held on either side after the run."""
    small = SchedulerConfig(
        block_size=4, num_blocks=48, max_num_seqs=4, max_num_batched_tokens=8,
        prefill_chunk_size=4, kv_admission=KVAdmission.INCREMENTAL,
    )  # fmt: skip
    params = GREEDY_EXIT
    requests = [
        (f"{rid}{k}", [*prompt, k + 1], params) for k in range(2) for rid, prompt in PROMPTS.items()
    ]
    expected = colocated(toy_model, small, requests)
    pair = Pair.build(toy_model, small)
    for request in requests:
        pair.add(*request)
    pair.run()
    compare(pair, expected)
    stats = pair.decode.scheduler.stats
    assert stats.kv_transfer_fallbacks == {}
    assert stats.num_kv_waits > 0  # landing blocks really did not fit at times
    assert stats.num_preemptions > 0  # and decode-side KV pressure preempted mid-decode
    assert pair.pulled == len(requests)
    compared = 0
    for rid, prompt, p in requests:
        want = oracle_result(oracle, prompt, p.resolve(toy_model.cfg.total_ut_steps, 512), small)
        compared += assert_matches_oracle(pair.finished()[rid], want, rid)
    assert compared > 0
    pair.check_no_leaks(small)


# ------------------------------------------------------------------ fp8 KV
# Under --kv-cache-dtype fp8 both shards store e4m3 codes and float32 scales; a pull moves
# both (never decoded values), so the decode shard attends over exactly what the prefill
# shard wrote and every token equals the serial oracle applying its own fp8 codec.
FP8_CONFIGS = {
    name: dataclasses.replace(CONFIGS[name], kv_cache_dtype="fp8")
    for name in ("wcpb-async-prefix", "atomic-sync", "shared-layout", "speculative-decode")
}


def _fp8_block_ratio(model) -> float:
    """fp8 bytes per block (codes and scales) over auto's, at the model's heads and dtype."""
    cfg = model.cfg
    shape = (4, cfg.num_key_value_heads, cfg.head_dim, model.dtype.itemsize)
    return block_bytes("fp8", *shape) / block_bytes("auto", *shape)


@pytest.mark.parametrize("name", list(FP8_CONFIGS))
def test_fp8_disaggregated_equals_the_fp8_oracle(toy_model, oracle, name):
    """Tokens and exit depths equal a colocated fp8 run and the fp8 oracle; the pulls moved
    codes and scales: fp8's share of auto's bytes for the same pulls."""
    config = FP8_CONFIGS[name]
    requests = workload(GREEDY_EXIT)
    expected = colocated(toy_model, config, requests)
    pair = Pair.build(toy_model, config)
    assert arena_of(pair.decode.runner).k.dtype == torch.uint8  # codes, with scales beside
    for request in requests:
        pair.add(*request)
    pair.run()
    compare(pair, expected)
    assert pair.handed_off == len(requests) and pair.pulled == len(requests)
    pair.check_no_leaks(config)
    if config.speculative_tokens:  # the decode shard speculated over pulled fp8 KV
        assert pair.decode.scheduler.spec_stats.num_spec_rows > 0
    compared = 0
    for rid, prompt, p in requests:
        want = oracle_result(oracle, prompt, p.resolve(toy_model.cfg.total_ut_steps, 512), config)
        compared += assert_matches_oracle(pair.finished()[rid], want, rid)
    assert compared == len(requests) * GREEDY_EXIT.max_tokens  # every token
    auto = Pair.build(toy_model, CONFIGS[name])
    for request in requests:
        auto.add(*request)
    auto.run()
    assert auto.pulled == pair.pulled and auto.executor.bytes > 0
    assert pair.executor.bytes / auto.executor.bytes == _fp8_block_ratio(toy_model)


@pytest.mark.parametrize("codec", ["auto", "fp8"])
def test_tight_kv_and_sparse_prefill_hand_over_under_each_codec(toy_model, oracle, codec):
    """Under either codec: tight KV on both shards (decode-side waits and preemption) and
    token-sparse prefill (frozen tokens' copied codes and scales) hand over with the
    oracle's tokens and exit depths."""
    config = SchedulerConfig(
        block_size=4, num_blocks=48, max_num_seqs=4, max_num_batched_tokens=8,
        prefill_chunk_size=4, kv_admission=KVAdmission.INCREMENTAL, sparse_window=8,
        kv_cache_dtype=codec,
    )  # fmt: skip
    sparse = SamplingParams(
        max_tokens=8, temperature=0.0, min_loops=1, exit_threshold=0.6, ignore_eos=True,
        token_sparse_prefill=True,
    )  # fmt: skip
    requests = [(rid, prompt, sparse) for rid, prompt in SPARSE_PROMPTS.items()]
    requests += [
        (f"{rid}{k}", [*prompt, k + 1], GREEDY_EXIT)
        for k in range(2)
        for rid, prompt in PROMPTS.items()
    ]
    pair = Pair.build(toy_model, config)
    for request in requests:
        pair.add(*request)
    pair.run()
    assert pair.pulled == len(requests)
    stats = pair.decode.scheduler.stats
    assert stats.num_preemptions > 0 and stats.kv_transfer_fallbacks == {}
    assert pair.prefill.scheduler.stats.num_prefill_rows_saved > 0  # it did run sparse
    compared = 0
    for rid, prompt, p in requests:
        want = oracle_result(oracle, prompt, p.resolve(toy_model.cfg.total_ut_steps, 512), config)
        compared += assert_matches_oracle(pair.finished()[rid], want, rid)
    assert compared == sum(p.max_tokens for _, _, p in requests)
    pair.check_no_leaks(config)


def test_shards_of_different_codecs_never_share_a_block(toy_model, oracle):
    """A prefill shard under auto and a decode shard under fp8: the scheduler refuses the
    handoff by its block format (the codec named) and the decode shard prefills the prompt
    itself, with the fp8 oracle's tokens; the worker refuses the pull by name too."""
    auto, fp8 = CONFIGS["wcpb-async-prefix"], FP8_CONFIGS["wcpb-async-prefix"]
    pair = Pair.build(toy_model, auto, fp8)
    handoff_format = pair.prefill.scheduler.block_format
    why = pair.decode.scheduler.block_format.mismatch(handoff_format)
    assert why == "kv_cache_dtype: fp8 vs auto"
    requests = workload(GREEDY_EXIT)[:2]
    for request in requests:
        pair.add(*request)
    pair.run()
    assert pair.handed_off == len(requests) and pair.pulled == 0
    assert sum(pair.decode.scheduler.stats.kv_transfer_fallbacks.values()) == len(requests)
    compared = 0
    for rid, prompt, p in requests:
        want = oracle_result(oracle, prompt, p.resolve(toy_model.cfg.total_ut_steps, 512), fp8)
        compared += assert_matches_oracle(pair.finished()[rid], want, rid)
    assert compared == len(requests) * GREEDY_EXIT.max_tokens
    with pytest.raises(TransferError) as err:  # the workers' own check
        pair.executor.agent.plan(pair.executor.source.source_info(), [0], [0])
    assert err.value.cause == "layout_mismatch" and "kv_cache_dtype: fp8 vs auto" in str(err.value)
    pair.check_no_leaks(fp8)
