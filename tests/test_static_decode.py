"""Static padded decode passes (what a CUDA graph replays) against the unpadded eager pass
and the serial oracle, with sampled rows, early exit and both KV layouts."""

from __future__ import annotations

import pytest

from messages.api import FinishedEvent, TokenEvent
from messages.sampling import SamplingParams, StructuredOutput
from services.common.config import KVLayout, SchedulerConfig
from services.common.sampling import sample_token
from services.engine.engine import LLMEngine
from services.oracle.near_tie import compare_with_oracle
from services.worker.passes.static_decode import DecodeMode, Variant, buckets
from services.worker.sampling.grammar import GrammarBook
from tests.helpers import FORMATS, MaskedSampler

PROMPTS = [[5, 17, 42, 99, 3], [250, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19], [300], [8, 9]]


def _params(i: int) -> SamplingParams:
    sampled = i % 2 == 1
    return SamplingParams(
        max_tokens=10,
        temperature=0.8 if sampled else 0.0,
        top_k=20 if i == 3 else 0,
        top_p=0.9 if i == 1 else 1.0,
        seed=100 + i,
        min_loops=1,
        exit_threshold=0.7,
        ignore_eos=True,
    )


def _run(model, layout: KVLayout, mode: DecodeMode) -> tuple[list[tuple], LLMEngine]:
    config = SchedulerConfig(block_size=4, num_blocks=256, max_num_seqs=8, kv_layout=layout)
    engine = LLMEngine(model, config, decode_mode=mode)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, _params(i))
    finished = {}
    while engine.has_unfinished_requests():
        for event in engine.step():
            if isinstance(event, FinishedEvent):
                finished[event.request_id] = event
    out = [(finished[f"r{i}"].token_ids, finished[f"r{i}"].exit_depths) for i in range(5)]
    return out, engine


@pytest.mark.oracle
@pytest.mark.parametrize("layout", [KVLayout.LAST_EXITED, KVLayout.SHARED])
def test_padded_decode_equals_eager_decode(toy_model, layout: KVLayout) -> None:
    eager, _ = _run(toy_model, layout, DecodeMode.EAGER)
    padded, engine = _run(toy_model, layout, DecodeMode.PADDED)
    assert padded == eager
    assert engine.runner.static is not None and engine.runner.static.replays > 0
    assert len({d for _, depths in eager for d in depths}) > 1  # early exit really happened


@pytest.mark.oracle
def test_padded_sampled_request_equals_the_oracle(toy_model, oracle) -> None:
    padded, _ = _run(toy_model, KVLayout.LAST_EXITED, DecodeMode.PADDED)
    for i in (1, 3):
        p = _params(i)
        expected = oracle.generate(
            PROMPTS[i],
            max_tokens=p.max_tokens,
            min_loops=p.min_loops,
            exit_threshold=p.exit_threshold,
            ignore_eos=True,
            sampler=lambda logits, k, p=p: sample_token(
                logits,
                temperature=p.temperature,
                top_k=p.top_k,
                top_p=p.top_p,
                seed=p.seed,
                output_index=k,
            ),
        )
        assert padded[i] == (expected.token_ids, expected.exit_depths)


@pytest.mark.unit
def test_buckets_are_powers_of_two_up_to_the_largest() -> None:
    assert buckets(128) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert buckets(48) == [1, 2, 4, 8, 16, 32, 48]


# ---------------------------------------------------------------- constrained rows stay static
def _mixed_run(toy_model, codec, mode: DecodeMode) -> tuple[dict, LLMEngine, list[bool]]:
    """Free greedy and sampled rows beside JSON-constrained rows and a row asking for
    log-probabilities, in one decode batch. Returns the finished events, the engine and,
    per decode-only pass, whether it ran through a static bucket."""
    config = SchedulerConfig(block_size=4, num_blocks=256, max_num_seqs=8)
    engine = LLMEngine(toy_model, config, codec=codec, decode_mode=mode)
    kind, spec = FORMATS["json_schema"]
    for i, prompt in enumerate(PROMPTS):
        params = _params(i)
        params.max_tokens = 24
        if i in (0, 3):  # a format ends the output itself
            params.ignore_eos = False
            params.structured_output = StructuredOutput(kind=kind, spec=spec)
        if i == 1:
            params.logprobs = 3
        engine.add_request(f"r{i}", prompt, params)
    static: list[bool] = []
    run_pass = engine.runner._run_pass

    def counted(active, first_pass):  # type: ignore[no-untyped-def]
        plan, packed = run_pass(active, first_pass)
        if all(live.is_decode and live.row.token_count == 1 for live in active):
            static.append(plan.padded)
        return plan, packed

    engine.runner._run_pass = counted  # type: ignore[method-assign]
    events = engine.run_until_done()
    finished = {e.request_id: e for e in events if isinstance(e, FinishedEvent)}
    logprobs = [e.logprobs for e in events if isinstance(e, TokenEvent) and e.request_id == "r1"]
    return {"finished": finished, "logprobs": logprobs}, engine, static


@pytest.mark.oracle
def test_constrained_and_logprobs_rows_keep_the_batch_on_the_static_path(
    toy_model, codec, oracle
) -> None:
    """A structured output's row or one asking for log-probabilities no longer takes its
    neighbours off the static (graph) path: every decode pass of the mixed batch runs in a
    bucket, the LOGITS variant applies the masks and the sampler after it, and tokens, exit
    depths and log-probabilities equal the eager pass's (and the constrained greedy row the
    oracle's with the same mask)."""
    eager, _, eager_static = _mixed_run(toy_model, codec, DecodeMode.EAGER)
    padded, engine, padded_static = _mixed_run(toy_model, codec, DecodeMode.PADDED)
    assert not any(eager_static)
    assert padded_static and all(padded_static), padded_static
    static = engine.runner.static
    assert static is not None
    assert static.replays_by_variant[Variant.LOGITS] > 0
    assert static.replays == len(padded_static)
    for rid, want in eager["finished"].items():
        got = padded["finished"][rid]
        assert (got.token_ids, got.exit_depths) == (want.token_ids, want.exit_depths), rid
    assert len(padded["logprobs"]) == 24 and all(lp is not None for lp in padded["logprobs"])
    for a, b in zip(padded["logprobs"], eager["logprobs"], strict=True):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
    book = GrammarBook(codec, toy_model.cfg.vocab_size, toy_model.cfg.stop_token_ids)
    p = _params(0)
    constraint = StructuredOutput(kind="json_schema", spec=FORMATS["json_schema"][1])
    sampler = MaskedSampler(book.compile(constraint).result(), toy_model.cfg.vocab_size, p)
    want = oracle.generate(
        PROMPTS[0],
        max_tokens=24,
        min_loops=p.min_loops,
        exit_threshold=p.exit_threshold,
        sampler=sampler,
    )
    comparison = compare_with_oracle(padded["finished"]["r0"], want, sampler.gaps)
    assert comparison.mismatch is None and comparison.compared > 0, comparison
