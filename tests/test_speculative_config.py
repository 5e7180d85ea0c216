"""Self-speculative decoding's settings: the engine flags, the per-request opt-out, the rows
it turns itself off for, ``auto``'s choice of K, and what usage reports."""

from __future__ import annotations

import argparse

import pytest

from messages.api import FinishedEvent
from messages.batch import RowKind
from messages.sampling import SamplingParams, StructuredOutput
from services.common.config import KVLayout, ModelLimits, SchedulerConfig
from services.common.flags import add_engine_flags, scheduler_config_from_args
from services.engine.engine import LLMEngine
from services.scheduler.core.batch import ScheduledBatch
from services.scheduler.core.scheduler import Scheduler
from services.scheduler.core.speculation import DraftLength


def _parse(*argv: str) -> SchedulerConfig:
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    return scheduler_config_from_args(parser.parse_args(list(argv)))


@pytest.mark.unit
def test_flags_set_k_d_and_auto() -> None:
    off = _parse()
    assert (off.speculative_tokens, off.speculative_auto) == (0, False)
    fixed = _parse("--speculative-tokens", "3", "--draft-loops", "2")
    assert (fixed.speculative_tokens, fixed.speculative_auto, fixed.draft_loops) == (3, False, 2)
    auto = _parse("--speculative-tokens", "auto")
    assert auto.speculative_auto and auto.speculative_tokens == 8
    with pytest.raises(SystemExit):
        _parse("--speculative-tokens", "many")


@pytest.mark.unit
def test_auto_speculates_where_it_pays_and_not_where_it_costs() -> None:
    auto = DraftLength(max_k=8, draft_loops=1, total_loops=4)
    for _ in range(200):
        auto.observe_cycle(drafted=4, accepted=4)  # drafts nearly always right
    assert auto.choose(batch=1) >= 4
    assert auto.choose(batch=4096) < auto.choose(batch=1)  # rows cost once compute-bound
    poor = DraftLength(max_k=8, draft_loops=1, total_loops=4)
    for _ in range(200):
        poor.observe_cycle(drafted=2, accepted=0)
    assert poor.choose(batch=1) == 0
    for _ in range(5000):  # no cycles for a long while: back to trying
        poor.idle()
    assert poor.choose(batch=1) > 0


def _auto_with(acceptance: float, exits: list[float], draft_loops: int = 1) -> DraftLength:
    auto = DraftLength(max_k=8, draft_loops=draft_loops, total_loops=len(exits))
    right = round(20 * acceptance)
    for _ in range(100):  # the running acceptance settles on this
        for i in range(20):
            auto.observe_cycle(drafted=1, accepted=1 if i < right else 0)
    auto.exits.share = list(exits)
    return auto


@pytest.mark.unit
def test_a_cycle_lasts_until_its_decided_positions_have_all_exited() -> None:
    spread = _auto_with(0.8, [0.0, 0.5, 0.0, 0.5]).exits
    assert spread.decided_after(1, 1) == pytest.approx(3.0)  # one position: its mean exit
    # position 1 starts a pass after position 0: max(e0, 1 + e1), e in {2, 4} equally
    assert spread.decided_after(1, 2) == pytest.approx((3 + 5 + 4 + 5) / 4)
    shallow = _auto_with(0.8, [1.0, 0.0, 0.0, 0.0]).exits
    assert shallow.draft_passes(2) == pytest.approx(1.0)  # drafting stops at the exit
    assert shallow.decided_after(2, 3) == pytest.approx(3.0)


@pytest.mark.unit
def test_exit_depths_follow_committed_tokens() -> None:
    auto = DraftLength(max_k=8, draft_loops=1, total_loops=4)
    assert auto.exits.mean == pytest.approx(4.0)  # before any token: all D loops
    for _ in range(1000):
        auto.observe_exit(3)
    assert auto.exits.mean == pytest.approx(3.0, abs=1e-6)
    assert sum(auto.exits.share) == pytest.approx(1.0)


@pytest.mark.unit
def test_auto_drafts_long_where_a_rejection_costs_only_the_passes_up_to_it() -> None:
    # a cycle ends at its first rejected draft's exit: a longer K adds no passes to the
    # cycles that end early, so at batch 1 auto drafts as far as it may
    auto = _auto_with(0.8, [0.0, 0.0, 0.0, 1.0])
    assert auto_acceptance_near(auto, 0.8)
    assert auto.cycle_rate(8, 1) > auto.cycle_rate(3, 1) > auto.cycle_rate(1, 1)
    assert auto.choose(batch=1) == 8
    # where rows cost (a compute-bound batch), fewer
    assert auto.choose(batch=2048) < 8


def auto_acceptance_near(auto: DraftLength, acceptance: float) -> bool:
    return abs(auto.acceptance - acceptance) < 0.01


def _spec_rows(batches: list[ScheduledBatch], request_id: str) -> int:
    return sum(
        1
        for b in batches
        for t in b.tasks
        if t.kind is RowKind.SPECULATIVE and t.request.request_id == request_id
    )


@pytest.mark.oracle
def test_opted_out_requests_decode_plainly_beside_speculating_ones(toy_model) -> None:
    batches: list[ScheduledBatch] = []
    engine = LLMEngine(
        toy_model,
        SchedulerConfig(block_size=4, num_blocks=256, speculative_tokens=3, draft_loops=3),
        on_batch=batches.append,
    )
    base = {"max_tokens": 8, "temperature": 0.0, "min_loops": 1, "ignore_eos": True}
    engine.add_request("spec", [5, 6, 7], SamplingParams(**base))
    engine.add_request("out", [5, 6, 7], SamplingParams(**base, speculative=False))
    engine.add_request("lp", [5, 6, 7], SamplingParams(**base, logprobs=2))
    done = {e.request_id: e for e in engine.run_until_done() if isinstance(e, FinishedEvent)}
    assert _spec_rows(batches, "spec") > 0
    assert _spec_rows(batches, "out") == 0
    assert _spec_rows(batches, "lp") > 0  # log-probabilities ride on cycles
    # the same prompt and settings: the same tokens, speculating or not
    assert done["spec"].token_ids == done["out"].token_ids == done["lp"].token_ids
    assert done["spec"].exit_depths == done["out"].exit_depths
    assert done["spec"].draft_tokens > 0
    assert 0 <= done["spec"].accepted_draft_tokens <= done["spec"].draft_tokens
    assert done["out"].draft_tokens == 0 and done["lp"].draft_tokens > 0
    spec = engine.scheduler.spec_stats
    assert spec.num_draft_tokens == done["spec"].draft_tokens + done["lp"].draft_tokens
    assert sum(spec.accepted_per_position) == spec.num_accepted_tokens


@pytest.mark.oracle
def test_a_structured_output_speculates_with_the_same_tokens(toy_model, codec) -> None:
    fmt = SamplingParams(
        max_tokens=12, temperature=0.0, structured_output=StructuredOutput(kind="json_object")
    )
    done = {}
    for k in (0, 3):
        batches: list[ScheduledBatch] = []
        config = SchedulerConfig(block_size=4, num_blocks=256, speculative_tokens=k)
        engine = LLMEngine(toy_model, config, codec=codec, on_batch=batches.append)
        engine.add_request("fmt", [5, 6, 7], fmt)
        free = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        engine.add_request("free", [5, 6, 7], free)
        events = engine.run_until_done()
        done[k] = {e.request_id: e for e in events if isinstance(e, FinishedEvent)}
        assert (_spec_rows(batches, "fmt") > 0) == (k > 0)
        assert (_spec_rows(batches, "free") > 0) == (k > 0)
    assert done[3]["fmt"].token_ids == done[0]["fmt"].token_ids
    assert done[3]["free"].token_ids == done[0]["free"].token_ids
    assert done[3]["free"].draft_tokens > 0 and done[3]["fmt"].draft_tokens > 0


@pytest.mark.oracle
@pytest.mark.parametrize("setting", [{"kv_layout": KVLayout.SHARED}], ids=["shared"])
def test_the_shared_layout_does_not_speculate(toy_model, setting) -> None:
    batches: list[ScheduledBatch] = []
    config = SchedulerConfig(block_size=4, num_blocks=256, speculative_tokens=3, **setting)
    engine = LLMEngine(toy_model, config, on_batch=batches.append)
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True))
    engine.run_until_done()
    assert _spec_rows(batches, "r") == 0


@pytest.mark.unit
@pytest.mark.parametrize("codec", ["auto", "fp8", "int4-delta"])
def test_every_kv_codec_speculates(codec: str) -> None:
    """fp8 codes each token as it is written, so a rejected draft's K/V is rewritten before
    it is read, as under auto; int4-delta keeps the blocks a cycle may write again open to
    that (tests/test_kv_int4_speculative_oracle.py)."""
    limits = ModelLimits(
        total_ut_steps=4, vocab_size=64, max_position_embeddings=64, eos_token_ids=()
    )
    config = SchedulerConfig(num_blocks=64, speculative_tokens=3, kv_cache_dtype=codec)
    assert Scheduler(config, limits).speculator.enabled


@pytest.mark.unit
def test_draft_loops_must_leave_loops_to_verify(toy_model) -> None:
    with pytest.raises(ValueError, match="draft_loops"):
        LLMEngine(toy_model, SchedulerConfig(speculative_tokens=2, draft_loops=4))
