"""The near-tie rule (``services/oracle/near_tie.py``) that the oracle tests, the device check
and the soak share: a comparison stops only at the oracle's own near-ties, the recording
sampler chooses as the engine does, and a divergence between two runs is named and measured
along the path both runs agreed on."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from messages.sampling import SamplingParams
from services.common.sampling import draw_scores, sample_token
from services.oracle import SerialOracle, near_tie
from services.oracle.near_tie import (
    TIE_EPS,
    ChoiceSampler,
    KVCodecArgs,
    compare_with_oracle,
    explain_divergence,
    first_difference,
)

PROMPT = [5, 17, 300, 42, 9, 260, 11]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, min_loops=1, exit_threshold=0.7)
SAMPLED = SamplingParams(
    max_tokens=10, temperature=0.8, seed=11, min_loops=1, exit_threshold=0.7, ignore_eos=True
)


def _step(token: int, depth: int, gap: float = 1.0, margin: float = 1.0) -> SimpleNamespace:
    return SimpleNamespace(token_id=token, exit_depth=depth, top2_gap=gap, threshold_margin=margin)


def _oracle(*steps: SimpleNamespace, selection_margin: float = math.inf) -> SimpleNamespace:
    return SimpleNamespace(
        steps=list(steps),
        token_ids=[s.token_id for s in steps],
        exit_depths=[s.exit_depth for s in steps],
        finish_reason="length",
        selection_margin=selection_margin,
    )


def _engine(tokens: list[int], depths: list[int]) -> SimpleNamespace:
    return SimpleNamespace(token_ids=tokens, exit_depths=depths, finish_reason="length")


@pytest.mark.unit
def test_oracle_comparison_stops_only_at_the_oracles_near_ties() -> None:
    compare = compare_with_oracle
    expected = _oracle(_step(5, 4), _step(7, 2), _step(9, 3))

    same = compare(_engine([5, 7, 9], [4, 2, 3]), expected)
    assert (same.compared, same.total, same.near_tie, same.mismatch) == (3, 3, None, None)

    wrong = compare(_engine([5, 8, 9], [4, 2, 3]), expected)
    assert wrong.compared == 1 and "token 1" in (wrong.mismatch or "")
    assert compare(_engine([5, 7, 9], [4, 3, 3]), expected).mismatch is not None
    assert compare(_engine([5, 7], [4, 2]), expected).mismatch is not None  # stopped early

    # a top-2 gap tie at token 1: any token may follow, but its exit depth must agree
    gap_tie = _oracle(_step(5, 4), _step(7, 2, gap=1e-6), _step(9, 3))
    tie = compare(_engine([5, 8, 1], [4, 2, 4]), gap_tie)
    assert (tie.compared, tie.mismatch) == (1, None) and "top-2 gap" in (tie.near_tie or "")
    assert compare(_engine([5, 8, 1], [4, 3, 4]), gap_tie).mismatch is not None

    # an exit-margin tie at token 1: even the depth may differ
    margin_tie = _oracle(_step(5, 4), _step(7, 2, margin=1e-7), _step(9, 3))
    tie = compare(_engine([5, 8], [4, 3]), margin_tie)
    assert (tie.compared, tie.mismatch) == (1, None) and "exit margin" in (tie.near_tie or "")

    # gaps measured by a sampler replace the raw logits' (a sampled row's draw scores)
    assert compare(_engine([5, 8, 1], [4, 2, 4]), expected, gaps=[1.0, 1e-6, 1.0]).near_tie

    # token-sparse prefill chose its active tokens at a near-tie: nothing is compared
    chosen_at_tie = _oracle(_step(5, 4), _step(7, 2), selection_margin=1e-7)
    tie = compare(_engine([6, 8], [1, 1]), chosen_at_tie)
    assert (tie.compared, tie.mismatch) == (0, None) and "active-token" in (tie.near_tie or "")
    clear = _oracle(_step(5, 4), _step(7, 2), selection_margin=1e-3)
    assert compare(_engine([6, 8], [1, 1]), clear).mismatch is not None


@pytest.mark.unit
def test_first_difference_names_the_first_token_or_where_one_run_ended() -> None:
    assert first_difference(([1, 2, 3], [4, 2, 2]), ([1, 2, 3], [4, 2, 2])) is None
    assert first_difference(([1, 2, 3], [4, 2, 2]), ([1, 9, 3], [4, 2, 2])) == 1
    assert first_difference(([1, 2, 3], [4, 2, 2]), ([1, 2, 3], [4, 2, 3])) == 2  # depth only
    assert first_difference(([1, 2, 3], [4, 2, 2]), ([1, 2], [4, 2])) == 2


@pytest.mark.unit
def test_draw_scores_take_the_sampled_tokens_argmax_and_drop_filtered_tokens() -> None:
    logits = torch.randn(512, generator=torch.Generator().manual_seed(3))
    for index in range(20):
        draw = {"temperature": 0.8, "top_k": 0, "top_p": 1.0, "seed": 7, "output_index": index}
        scores = draw_scores(logits, **draw)
        assert scores.dtype == torch.float64
        assert int(torch.argmax(scores)) == sample_token(logits, **draw)
        kept = draw_scores(logits, **{**draw, "top_k": 5})
        assert int(torch.isfinite(kept).sum()) == 5
        assert int(torch.argmax(kept)) == sample_token(logits, **{**draw, "top_k": 5})


@pytest.mark.oracle
def test_choice_sampler_chooses_as_the_engine_and_records_the_deciding_gap(
    oracle: SerialOracle,
) -> None:
    plain = oracle.generate(PROMPT, max_tokens=10, min_loops=1, exit_threshold=0.7)
    sampler = ChoiceSampler(GREEDY)
    greedy = oracle.generate(
        PROMPT, max_tokens=10, min_loops=1, exit_threshold=0.7, sampler=sampler
    )
    assert greedy.token_ids == plain.token_ids
    assert sampler.gaps == pytest.approx([s.top2_gap for s in plain.steps], abs=1e-6)

    sampler = ChoiceSampler(SAMPLED)
    drawn = oracle.generate(
        PROMPT, max_tokens=10, min_loops=1, exit_threshold=0.7, ignore_eos=True, sampler=sampler
    )
    want = oracle.generate(
        PROMPT,
        max_tokens=10,
        min_loops=1,
        exit_threshold=0.7,
        ignore_eos=True,
        sampler=lambda logits, i: sample_token(
            logits, temperature=0.8, top_k=0, top_p=1.0, seed=11, output_index=i
        ),
    )
    assert drawn.token_ids == want.token_ids
    # a draw's gap is not the raw logits' one: the noise decides
    assert sampler.gaps != pytest.approx([s.top2_gap for s in want.steps], abs=1e-3)

    forced = ChoiceSampler(GREEDY, forced=[3, 4, 5])
    path = oracle.generate(PROMPT, max_tokens=5, min_loops=1, exit_threshold=0.7, sampler=forced)
    assert path.token_ids[:3] == [3, 4, 5]


def _run(oracle: SerialOracle, params: SamplingParams) -> tuple[list[int], list[int]]:
    sampler = ChoiceSampler(params)
    result = oracle.generate(
        PROMPT,
        max_tokens=params.max_tokens,
        min_loops=params.min_loops,
        exit_threshold=params.exit_threshold,
        ignore_eos=params.ignore_eos,
        sampler=sampler,
    )
    return result.token_ids, result.exit_depths


@pytest.mark.oracle
def test_a_divergence_is_named_and_measured_along_the_agreed_path(
    oracle: SerialOracle, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens, depths = _run(oracle, GREEDY)
    assert len(set(depths[1:])) > 1, "the path should exit at several depths"
    assert explain_divergence(oracle, PROMPT, GREEDY, (tokens, depths), (tokens, depths)) is None

    # run b chose another token at 4: far from a tie, a defect, with both tokens named
    i = 4
    steps = oracle.generate(PROMPT, max_tokens=10, min_loops=1, exit_threshold=0.7).steps
    second = steps[i].top_logprobs[1][0]
    far = steps[i].top_logprobs[-1][0]
    for other, gap in ((second, steps[i].top2_gap), (far, None)):
        altered = [*tokens[:i], other, *tokens[i + 1 :]]
        found = explain_divergence(oracle, PROMPT, GREEDY, (tokens, depths), (altered, depths))
        assert found is not None and found.note == ""
        assert (found.index, found.tokens) == (i, (tokens[i], other))
        assert found.exit_depths == (depths[i], depths[i]) and found.draw_gap is None
        assert found.top2_gap == pytest.approx(steps[i].top2_gap, abs=1e-6)
        assert found.exit_margin == steps[i].threshold_margin
        assert found.near_tie is None and found.pair_gap > TIE_EPS
        if gap is not None:  # the runner-up: the pair is the top two
            assert found.pair_gap == pytest.approx(gap, abs=1e-6)
        else:
            assert found.pair_gap > found.top2_gap

    # token 0 (full depth, no exit rule): at a gap the rule calls close, a near-tie ...
    runner_up = steps[0].top_logprobs[1][0]
    monkeypatch.setattr(near_tie, "TIE_EPS", steps[0].top2_gap * 1.01)
    altered = [runner_up, *tokens[1:]]
    found = explain_divergence(oracle, PROMPT, GREEDY, (tokens, depths), (altered, depths))
    assert found is not None and found.index == 0 and found.exit_margin == float("inf")
    assert (found.near_tie or "").startswith("top-2 gap")
    # ... but not when the exit depths differ there too (the exit comes before the token)
    moved = [depths[0] - 1, *depths[1:]]
    found = explain_divergence(oracle, PROMPT, GREEDY, (tokens, depths), (altered, moved))
    assert found is not None and found.near_tie is None


@pytest.mark.oracle
def test_a_sampled_divergence_is_measured_on_the_draw_scores(oracle: SerialOracle) -> None:
    tokens, depths = _run(oracle, SAMPLED)
    i = 6
    sampler = ChoiceSampler(SAMPLED, forced=tokens)
    oracle.generate(
        PROMPT, max_tokens=i + 1, min_loops=1, exit_threshold=0.7, ignore_eos=True,
        sampler=sampler,
    )  # fmt: skip
    runner_up = int(torch.topk(sampler.scores, 2).indices[1])
    altered = [*tokens[:i], runner_up, *tokens[i + 1 :]]
    found = explain_divergence(oracle, PROMPT, SAMPLED, (tokens, depths), (altered, depths))
    assert found is not None and found.index == i and found.draw_gap is not None
    assert found.pair_gap == pytest.approx(found.draw_gap, abs=1e-9)
    assert found.near_tie is None

    # one run ended where the other went on: the same stop rule cannot do that
    ended = explain_divergence(oracle, PROMPT, SAMPLED, (tokens, depths), (tokens[:i], depths[:i]))
    assert ended is not None and ended.tokens == (tokens[i], None) and ended.near_tie is None
    assert "ended" in ended.note


@pytest.mark.oracle
def test_the_gaps_are_measured_on_the_runs_path_not_the_oracles_own(
    oracle: SerialOracle,
) -> None:
    """Both runs may have agreed on a path the oracle would not take itself (an earlier
    near-tie both went the same way across): the replay follows their tokens and exit
    depths up to the divergence, so the gaps there are those of their path."""
    tokens, depths = _run(oracle, GREEDY)
    i = 4
    steps = oracle.generate(PROMPT, max_tokens=10, min_loops=1, exit_threshold=0.7).steps
    other = steps[2].top_logprobs[1][0]
    path = [*tokens[:2], other, *tokens[3:]]
    shallow = [depths[0], 1, 1, 1, *depths[4:]]  # exits the policy would not take
    assert shallow != depths
    a = (path, shallow)
    b = ([*path[:i], (path[i] + 1) % 512, *path[i + 1 :]], shallow)
    found = explain_divergence(oracle, PROMPT, GREEDY, a, b)
    assert found is not None and found.index == i and found.note == "", found
    own = explain_divergence(
        oracle, PROMPT, GREEDY, (tokens, depths), ([*tokens[:i], b[0][i], *tokens[i + 1 :]], depths)
    )
    assert own is not None and abs(own.top2_gap - found.top2_gap) > 1e-6


@pytest.mark.oracle
def test_a_codec_rounding_flip_is_named_and_a_real_difference_is_not(
    oracle: SerialOracle,
) -> None:
    """Under int4-delta, two choices the oracle makes both of once its K/V move at float32's
    resolution are a codec rounding flip (a value group one rounding from its boundary);
    a token it never chooses is not, nor is the same difference without the codec."""
    prompt = [74, 1, 376, 1, 58, 1, 1, 27]
    params = SamplingParams(max_tokens=3, temperature=0.0, min_loops=1, exit_threshold=1.0)
    codec = KVCodecArgs("int4-delta", kv_block_size=2, kv_int4_anchor_every=0)
    runs = set()
    for seed in (None, *range(16)):
        r = oracle.generate(
            prompt, max_tokens=3, min_loops=1, exit_threshold=1.0, kv_cache_dtype="int4-delta",
            kv_block_size=2, kv_jitter_seed=seed,
        )  # fmt: skip
        runs.add((tuple(r.token_ids), tuple(r.exit_depths)))
    assert len(runs) >= 2, "this prompt's third token sits on a value group's boundary"
    (ta, da), (tb, db) = sorted(runs)[:2]
    i = first_difference((ta, da), (tb, db))
    assert i is not None
    found = explain_divergence(oracle, prompt, params, (ta, da), (tb, db), kv_codec=codec)
    assert found is not None and "int4-delta rounding flip" in (found.near_tie or "")
    assert found.pair_gap > TIE_EPS  # far from a logit near-tie: only the codec explains it
    plain = explain_divergence(oracle, prompt, params, (ta, da), (tb, db))
    assert plain is not None and plain.near_tie is None
    never = oracle.generate(prompt, max_tokens=3, min_loops=1, exit_threshold=1.0).steps[i]
    other = next(t for t, _ in never.top_logprobs[5:] if t not in (ta[i], tb[i]))
    altered = ([*ta[:i], other, *ta[i + 1 :]], da)
    found = explain_divergence(oracle, prompt, params, (ta, da), altered, kv_codec=codec)
    assert found is not None and found.near_tie is None
