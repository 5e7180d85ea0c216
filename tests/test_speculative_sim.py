"""Speculative cycles on the simulated device: its tokens and exit depths are plain
decoding's whatever the drafts' acceptance, and fewer passes run per token the more drafts
are right; the H100 profile is the H200's with HBM3's bandwidth."""

from __future__ import annotations

import pytest

from messages.api import FinishedEvent
from messages.sampling import SamplingParams
from services.common.config import SchedulerConfig
from services.engine.engine import LLMEngine
from services.worker.model.ouro import OuroModel
from services.worker.sim import H100_HBM_BYTES_PER_S, SimRunner

pytestmark = pytest.mark.unit


def _run(
    model: OuroModel,
    acceptance: float,
    threshold: float,
    exits: tuple[float, ...] | None = None,
    **spec: int,
):
    sim = SimRunner.h100(model.cfg)
    sim.sleep = False
    sim.draft_acceptance = acceptance
    sim.exit_distribution = exits
    config = SchedulerConfig(block_size=4, num_blocks=512, max_num_seqs=4, **spec)
    engine = LLMEngine(model, config, simulated=sim)
    params = SamplingParams(
        max_tokens=24, temperature=0.0, min_loops=1, exit_threshold=threshold, ignore_eos=True
    )
    for i in range(4):
        engine.add_request(f"r{i}", [3 + i, 9, 27, 81], params)
    done = {e.request_id: e for e in engine.run_until_done() if isinstance(e, FinishedEvent)}
    tokens = sum(len(e.token_ids) for e in done.values())
    return done, sim.stats.core_passes / tokens, engine.scheduler.spec_stats


@pytest.mark.parametrize("threshold", [1.0, 0.5])
def test_simulated_speculation_gives_plain_tokens_in_fewer_passes(toy_model, threshold) -> None:
    plain, plain_passes, _ = _run(toy_model, 0.0, threshold)
    previous = None
    for acceptance in (0.0, 0.5, 1.0):
        done, passes, spec = _run(
            toy_model, acceptance, threshold, None, speculative_tokens=4, draft_loops=1
        )
        for rid, want in plain.items():
            assert (done[rid].token_ids, done[rid].exit_depths) == (
                want.token_ids,
                want.exit_depths,
            )
        assert spec.num_draft_tokens > 0
        if acceptance == 1.0:
            assert spec.num_accepted_tokens == spec.num_draft_tokens
            assert passes < (0.6 if threshold == 1.0 else 0.8) * plain_passes
        if acceptance == 0.0 and threshold == 1.0:
            # every first draft wrong: the cycle ends at its first position's exit, which
            # ran its loops from the cycle's first pass, as plain decoding's token does
            assert passes == pytest.approx(plain_passes)
        if previous is not None:
            assert passes < previous
        previous = passes


def test_a_measured_exit_distribution_drives_the_simulated_gate(toy_model) -> None:
    """Gated tokens exit at the depths a model measured (here: never after 3 loops, mostly
    after 1), speculating or not, with the same tokens and depths."""
    measured = (0.7, 0.0, 0.3, 0.0)
    plain, _, _ = _run(toy_model, 0.0, 0.5, measured)
    depths = [d for e in plain.values() for d in e.exit_depths[1:]]
    assert len(depths) == 4 * 23
    assert set(depths) <= {1, 3}
    assert 0.5 < depths.count(1) / len(depths) < 0.9
    spec, _, stats = _run(toy_model, 0.5, 0.5, measured, speculative_tokens=3, draft_loops=2)
    assert stats.num_draft_tokens > 0
    for rid, want in plain.items():
        assert (spec[rid].token_ids, spec[rid].exit_depths) == (want.token_ids, want.exit_depths)
    fixed, _, _ = _run(toy_model, 0.0, 1.0, measured)  # gate off: full depth, as before
    assert {d for e in fixed.values() for d in e.exit_depths[1:]} == {4}


def test_the_h100_profile_reads_at_hbm3_speed(toy_model) -> None:
    h100, h200 = SimRunner.h100(toy_model.cfg), SimRunner.h200(toy_model.cfg)
    assert h100.cost.bytes_per_s == H100_HBM_BYTES_PER_S
    assert h100.cost.flops_per_s == h200.cost.flops_per_s
    # a one-row decode pass is bound by the weights: slower by the bandwidths' ratio
    ratio = h100.cost.core_pass_s(1, 100, 100) / h200.cost.core_pass_s(1, 100, 100)
    assert ratio == pytest.approx(h200.cost.bytes_per_s / h100.cost.bytes_per_s)


def test_the_bench_measures_exits_and_leaves_exact_positions_out_of_draft_agreement() -> None:
    from services.bench.comparisons.speculative import conditional_acceptance, exit_distribution

    assert exit_distribution([1, 1, 3, 4], 4) == (0.5, 0.0, 0.25, 0.25)
    # half the positions exit by d = 1 (exact): the others agree at 0.8 for 0.9 pooled
    assert conditional_acceptance(0.9, (0.5, 0.0, 0.25, 0.25), 1) == pytest.approx(0.8)
    assert conditional_acceptance(0.9, None, 1) == 0.9  # gate off: nothing exact
    assert conditional_acceptance(0.3, (0.5, 0.0, 0.25, 0.25), 1) == 0.0  # clamped


def test_a_batch_with_nothing_to_run_costs_nothing_and_does_not_fail(toy_model) -> None:
    # async scheduling sends a speculating request's next row before the last one's result:
    # when that result completes it, the row has nothing to run
    sim = SimRunner.h100(toy_model.cfg)
    assert sim._run([]) == 0.0
