"""Structured outputs under self-speculative decoding: a draft at position p + i is sampled
under the grammar state advanced by the drafts before it, the target under the same state
(the committed prefix, once those drafts are accepted), and a rejection rolls the grammar
back to the committed tokens. Greedy constrained output equals plain constrained decoding
and the serial oracle with the same mask, with either grammar engine, over K, d, the exit
gate, async scheduling, the padded static path and preemption; sampled constrained output
follows its format (docs/speculative.md)."""

from __future__ import annotations

import os
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from messages.api import FinishedEvent, TokenEvent
from messages.sampling import SamplingParams
from services.common.config import KVAdmission, SchedulerConfig
from services.engine.engine import LLMEngine
from services.worker.sampling.grammar import GrammarBook, RequestGrammar
from tests.helpers import (
    TOY_VOCAB,
    assert_equals_masked_oracle,
    check_formats,
    masked_oracle_run,
    structured_workload,
)

pytestmark = pytest.mark.oracle


def _greedy(workload):
    """The workload's requests, all greedy (their outputs must equal plain decoding's)."""
    out = []
    for rid, prompt, params, name in workload:
        fields = {f: getattr(params, f) for f in params.__struct_fields__}
        out.append((rid, prompt, SamplingParams(**{**fields, "temperature": 0.0}), name))
    return out


def _run(toy_model, codec, config: SchedulerConfig, workload, scored=None):
    """Runs the workload: (finished events, the engine); ``scored`` (a dict) receives each
    request's streamed log-probabilities, in order."""
    engine = LLMEngine(toy_model, config, codec=codec)
    for rid, prompt, params, _ in workload:
        engine.add_request(rid, prompt, params)
    events = engine.run_until_done()
    finished = {e.request_id: e for e in events if isinstance(e, FinishedEvent)}
    assert set(finished) == {w[0] for w in workload}
    if scored is not None:
        for e in events:
            if isinstance(e, TokenEvent):
                scored.setdefault(e.request_id, []).append(e.logprobs)
    return finished, engine


CASES = {
    "K3_d1_gate_llg": dict(speculative_tokens=3, draft_loops=1, backend="llguidance"),
    "K4_d3_xgr": dict(speculative_tokens=4, draft_loops=3, backend="xgrammar"),
    "K2_d2_async_llg": dict(
        speculative_tokens=2, draft_loops=2, backend="llguidance", async_scheduling=True
    ),
    "K8_d3_async_xgr": dict(
        speculative_tokens=8, draft_loops=3, backend="xgrammar", async_scheduling=True
    ),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("padded", [False, True], ids=["eager", "padded"])
def test_greedy_constrained_speculation_equals_plain_and_the_oracle(
    toy_model, oracle, codec, case: str, padded: bool
) -> None:
    fields = dict(CASES[case])
    backend = fields.pop("backend")
    workload = _greedy(structured_workload(5, seed=21, json_max_tokens=256, any_whitespace=False))
    base = dict(
        block_size=4, num_blocks=1024, prefill_chunk_size=8, structured_outputs_backend=backend
    )
    env = {"RLT_DECODE_MODE": "padded"} if padded else {}
    with mock.patch.dict(os.environ, env):
        plain, _ = _run(toy_model, codec, SchedulerConfig(**base), workload)
        spec, engine = _run(toy_model, codec, SchedulerConfig(**base, **fields), workload)
    stats = engine.scheduler.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0  # cycles ran and accepted
    book = GrammarBook(codec, TOY_VOCAB, toy_model.cfg.stop_token_ids, backend=backend)
    check_formats(spec, workload, codec, book)
    compared = 0
    for rid, prompt, params, _ in workload:
        got, want = spec[rid], plain[rid]
        assert (got.token_ids, got.exit_depths) == (want.token_ids, want.exit_depths), rid
        assert got.finish_reason == want.finish_reason
        compared += len(got.token_ids)
        expected, gaps = masked_oracle_run(oracle, book, prompt, params)
        assert_equals_masked_oracle(got, expected, gaps, rid)
    assert compared >= len(workload)


def test_constrained_speculation_under_preemption_equals_plain(toy_model, codec) -> None:
    """Tight KV: requests are preempted mid-cycle, their grammars rebuilt from the committed
    tokens on the worker; the output equals plain constrained decoding's."""
    workload = _greedy(structured_workload(8, seed=5, json_max_tokens=120, any_whitespace=True))
    base = dict(
        block_size=8,
        num_blocks=100,
        max_num_seqs=6,
        prefill_chunk_size=8,
        kv_admission=KVAdmission.INCREMENTAL,
    )
    plain, _ = _run(toy_model, codec, SchedulerConfig(**base), workload)
    spec, engine = _run(
        toy_model, codec, SchedulerConfig(**base, speculative_tokens=4, draft_loops=2), workload
    )
    assert engine.scheduler.stats.num_preemptions > 0
    assert engine.scheduler.spec_stats.num_drafts > 0
    compared = 0
    for rid, *_ in workload:
        assert spec[rid].token_ids == plain[rid].token_ids, rid
        assert spec[rid].exit_depths == plain[rid].exit_depths, rid
        compared += len(spec[rid].token_ids)
    assert compared > 0


def test_sampled_constrained_speculation_follows_the_format(toy_model, codec) -> None:
    """Sampled drafts and targets under their positions' masks, with rejections: every
    output is complete and valid."""
    workload = [
        w
        for w in structured_workload(10, seed=31, json_max_tokens=512, any_whitespace=False)
        if w[2].temperature
    ]
    config = SchedulerConfig(
        block_size=4, num_blocks=1024, prefill_chunk_size=8, speculative_tokens=3, draft_loops=1
    )
    finished, engine = _run(toy_model, codec, config, workload)
    stats = engine.scheduler.spec_stats
    assert stats.num_drafts > 0
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # some drafts were rejected
    book = GrammarBook(codec, TOY_VOCAB, toy_model.cfg.stop_token_ids)
    check_formats(finished, workload, codec, book)


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_grammar_drafts_roll_back_to_the_committed_tokens(codec, toy_model, backend) -> None:
    """``speculate`` advances the matcher past the committed tokens, ``commit`` keeps a
    matching draft, rolls back on another token (also past a drafted stop token)."""
    from messages.sampling import StructuredOutput

    book = GrammarBook(codec, TOY_VOCAB, toy_model.cfg.stop_token_ids, backend=backend)
    choice = StructuredOutput(kind="choice", spec='["yes", "no"]')
    ids_yes, ids_no = codec.encode("yes"), codec.encode("no")
    eos = toy_model.cfg.stop_token_ids[0]
    grammar = RequestGrammar(book, book.compile(choice), [])
    start = grammar.position_mask()
    assert start.words is not None
    # draft "yes" + EOS, then one more past the end
    for token in [*ids_yes, eos, eos]:
        assert grammar.speculate(token) is None
    past_end = grammar.position_mask()
    assert past_end.words is not None
    assert (past_end.words == book.stop_mask.numpy()).all()  # only stop tokens after the end
    # the target disagrees at the first token: back to the start, then "no"
    assert grammar.commit(ids_no[0], 0) is None
    assert grammar.num_accepted == 1 and not grammar.ended
    for i, token in enumerate(ids_no[1:], start=1):
        assert grammar.commit(token, i) is None
    assert grammar.commit(eos, len(ids_no)) is None
    assert grammar.ended
    # a fresh grammar: drafts kept when committed, then rolled back by a cycle's end
    again = RequestGrammar(book, book.compile(choice), [])
    for token in ids_yes:
        assert again.speculate(token) is None
    assert again.commit(ids_yes[0], 0) is None
    again.rollback()
    assert again.num_accepted == 1
    after_first = again.position_mask()
    fresh = RequestGrammar(book, book.compile(choice), ids_yes[:1])
    assert (after_first.words == fresh.position_mask().words).all()
    # a draft the format refuses (a stop token before the output is complete) fails
    refused = RequestGrammar(book, book.compile(choice), [])
    assert "does not follow the format" in (refused.speculate(eos) or "")


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_constrained_and_scored_speculation_equals_plain_over_configurations(
    toy_model, codec, data
) -> None:
    """Random budgets, block sizes, async scheduling, prefix caching and tight KV: greedy
    constrained requests (some asking log-probabilities) give plain decoding's tokens,
    exit depths and log-probabilities."""
    seed = data.draw(st.integers(0, 10_000))
    workload = []
    for i, (rid, prompt, params, name) in enumerate(
        _greedy(structured_workload(4, seed=seed, json_max_tokens=32, any_whitespace=False))
    ):
        fields = {f: getattr(params, f) for f in params.__struct_fields__}
        workload.append(
            (rid, prompt, SamplingParams(**{**fields, "logprobs": 2 * (i % 2) or None}), name)
        )
    block_size = data.draw(st.sampled_from([1, 2, 4, 8]))
    longest = max(len(p) + params.max_tokens for _, p, params, _ in workload)
    need = -(-longest // block_size) * toy_model.cfg.total_ut_steps
    base = dict(
        block_size=block_size,
        num_blocks=need + data.draw(st.integers(0, 3 * need)),
        max_num_seqs=data.draw(st.integers(1, 4)),
        max_num_batched_tokens=data.draw(st.integers(4, 24)),
        prefill_chunk_size=data.draw(st.integers(1, 8)),
        async_scheduling=data.draw(st.booleans()),
        enable_prefix_caching=data.draw(st.booleans()),
        kv_admission=data.draw(st.sampled_from(list(KVAdmission))),
        structured_outputs_backend=data.draw(st.sampled_from(["llguidance", "xgrammar"])),
    )
    spec_fields = dict(
        speculative_tokens=data.draw(st.sampled_from([1, 2, 4, 8])),
        speculative_auto=data.draw(st.booleans()),
        draft_loops=data.draw(st.integers(1, toy_model.cfg.total_ut_steps - 1)),
    )
    plain_scores: dict[str, list] = {}
    spec_scores: dict[str, list] = {}
    plain, _ = _run(toy_model, codec, SchedulerConfig(**base), workload, plain_scores)
    spec_config = SchedulerConfig(**base, **spec_fields)
    spec, engine = _run(toy_model, codec, spec_config, workload, spec_scores)
    assert engine.scheduler.spec_stats.num_spec_rows > 0
    compared = scored = 0
    for rid, _, params, _ in workload:
        got, want = spec[rid], plain[rid]
        assert (got.token_ids, got.exit_depths) == (want.token_ids, want.exit_depths), rid
        compared += len(got.token_ids)
        for a, b in zip(spec_scores[rid], plain_scores[rid], strict=True):
            assert (a is None) == (b is None) == (params.logprobs is None)
            if a is not None:
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
                assert [t.token_id for t in a.top_logprobs] == [t.token_id for t in b.top_logprobs]
                scored += 1
    assert compared > 0 and scored > 0
