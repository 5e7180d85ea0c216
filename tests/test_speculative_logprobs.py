"""Log-probabilities under self-speculative decoding: each committed token's log-probability
and its most likely alternatives equal plain decoding's (the exit coda's log-softmax), and
the serial oracle's, several tokens per result, for greedy requests over K, d, the exit
gate, async scheduling and the padded static path, and for sampled requests, whose
rejection rule may commit another token than the exit coda's sample (docs/speculative.md)."""

from __future__ import annotations

import os
from unittest import mock

import pytest

from messages.api import FinishedEvent, TokenEvent
from messages.sampling import SamplingParams
from services.common.config import SchedulerConfig
from services.engine.engine import LLMEngine
from services.worker.passes import speculative
from services.worker.sampling.logprobs import token_logprob

pytestmark = pytest.mark.oracle

PROMPTS = [[17, 4, 250, 31, 99], [8, 8, 140, 3, 9, 27], [81, 243, 217, 139]]
TOL = 1e-4  # batched float32 against float32
TOP = 5


def _run(toy_model, config: SchedulerConfig, params: SamplingParams) -> dict[str, list]:
    engine = LLMEngine(toy_model, config)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    tokens: dict[str, list[TokenEvent]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    finished: dict[str, FinishedEvent] = {}
    for event in engine.run_until_done():
        if isinstance(event, TokenEvent):
            tokens[event.request_id].append(event)
        elif isinstance(event, FinishedEvent):
            finished[event.request_id] = event
    assert set(finished) == set(tokens)
    spec = engine.scheduler.spec_stats
    if config.speculative_tokens:
        assert spec.num_spec_rows > 0  # these requests speculated...
        assert spec.num_drafts > 0 or config.speculative_auto  # ...and drafted (auto: may not)
    return {
        rid: [(e.token_id, e.exit_depth, e.logprobs) for e in evs] for rid, evs in tokens.items()
    }


def _scored_by(scorer):
    """Speculation's constructor with ``scorer`` in place of the runner's."""
    init = speculative.Speculation.__init__

    def patched(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        self._score = scorer

    return patched


def _same_logprobs(got, want) -> None:
    assert got is not None and want is not None
    assert got.logprob == pytest.approx(want.logprob, abs=TOL)
    assert [t.token_id for t in got.top_logprobs] == [t.token_id for t in want.top_logprobs]
    for a, b in zip(got.top_logprobs, want.top_logprobs, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=TOL)


def _assert_equal_to_oracle(oracle, prompt, events, params: SamplingParams) -> int:
    """Teacher-forced: the oracle follows the engine's tokens, so each step's log-softmax
    at its exit must be the reported one (also where the rejection rule chose the token)."""
    forced = [t for t, _, _ in events]
    expected = oracle.generate(
        prompt,
        max_tokens=len(forced),
        min_loops=params.min_loops,
        exit_threshold=params.exit_threshold,
        ignore_eos=True,
        sampler=lambda logits, i: forced[i],
    )
    assert expected.token_ids == forced
    assert [d for _, d, _ in events] == expected.exit_depths
    for (_, _, lp), step in zip(events, expected.steps, strict=True):
        assert lp is not None
        assert lp.logprob == pytest.approx(step.logprob, abs=TOL)
        assert [t.token_id for t in lp.top_logprobs] == [t for t, _ in step.top_logprobs[:TOP]]
        for t, (_, value) in zip(lp.top_logprobs, step.top_logprobs, strict=False):
            assert t.logprob == pytest.approx(value, abs=TOL)
    return len(events)


CASES = {
    "K2_d1_gate": dict(speculative_tokens=2, draft_loops=1, threshold=0.6),
    "K4_d3_fixed": dict(speculative_tokens=4, draft_loops=3, threshold=1.0),
    "K3_d2_async": dict(speculative_tokens=3, draft_loops=2, threshold=0.6, async_scheduling=True),
    "auto_d3_gate": dict(speculative_tokens=8, speculative_auto=True, draft_loops=3, threshold=0.6),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("padded", [False, True], ids=["eager", "padded"])
def test_greedy_logprobs_equal_plain_decoding_and_the_oracle(
    toy_model, oracle, case: str, padded: bool
) -> None:
    fields = dict(CASES[case])
    threshold = fields.pop("threshold")
    params = SamplingParams(
        max_tokens=12,
        temperature=0.0,
        min_loops=1,
        exit_threshold=threshold,
        ignore_eos=True,
        logprobs=TOP,
    )
    base = dict(block_size=4, num_blocks=256, prefill_chunk_size=4)
    env = {"RLT_DECODE_MODE": "padded"} if padded else {}
    with mock.patch.dict(os.environ, env):
        plain = _run(toy_model, SchedulerConfig(**base), params)
        spec = _run(toy_model, SchedulerConfig(**base, **fields), params)
    compared = 0
    for rid, events in spec.items():
        want = plain[rid]
        assert [(t, d) for t, d, _ in events] == [(t, d) for t, d, _ in want]
        for (_, _, got), (_, _, lp) in zip(events, want, strict=True):
            _same_logprobs(got, lp)
            compared += 1
    assert compared == 12 * len(PROMPTS)
    prompt = PROMPTS[0]
    assert _assert_equal_to_oracle(oracle, prompt, spec["r0"], params) == 12


def test_sampled_logprobs_score_the_committed_token(toy_model, oracle) -> None:
    """Sampled cycles: a rejected draft's resampled token, an accepted draft and the exit
    sample are all scored at their position's exit, as the oracle scores that token."""
    params = SamplingParams(
        max_tokens=16,
        temperature=1.0,
        seed=11,
        min_loops=1,
        exit_threshold=0.6,
        ignore_eos=True,
        logprobs=TOP,
    )
    config = SchedulerConfig(block_size=4, num_blocks=256, speculative_tokens=3, draft_loops=1)
    rescored = []  # tokens the rejection rule chose apart from the exit coda's sample

    def scored(logits, token: int) -> float:
        rescored.append(token)
        return token_logprob(logits, token)

    with mock.patch.object(speculative.Speculation, "__init__", _scored_by(scored)):
        spec = _run(toy_model, config, params)
    assert rescored
    compared = sum(
        _assert_equal_to_oracle(oracle, prompt, spec[f"r{i}"], params)
        for i, prompt in enumerate(PROMPTS)
    )
    assert compared == 16 * len(PROMPTS)
