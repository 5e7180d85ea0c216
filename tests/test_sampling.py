"""Sampling: seeded, per-request, independent of batch neighbours, and equal to the oracle
driven with the same sampler."""

from __future__ import annotations

import pytest
import torch

from messages.api import FinishedEvent
from messages.sampling import SamplingParams
from services.common.config import SchedulerConfig
from services.common.sampling import sample_token
from services.engine.engine import LLMEngine

PROMPT = [17, 4, 250, 31, 99]


def sampled(toy_model, params: SamplingParams, neighbours: int = 0, **config) -> FinishedEvent:
    engine = LLMEngine(toy_model, SchedulerConfig(block_size=4, num_blocks=256, **config))
    engine.add_request("target", PROMPT, params)
    for i in range(neighbours):
        engine.add_request(
            f"n{i}",
            [3 + i, 8, 60 + i],
            SamplingParams(max_tokens=9, temperature=1.0, seed=i, min_loops=1, exit_threshold=0.5),
        )
    events = engine.run_until_done()
    return next(e for e in events if isinstance(e, FinishedEvent) and e.request_id == "target")


@pytest.mark.unit
def test_seeded_tokens_do_not_depend_on_the_rest_of_the_batch(toy_model) -> None:
    params = SamplingParams(
        max_tokens=10,
        temperature=0.9,
        top_p=0.9,
        top_k=50,
        seed=1234,
        min_loops=1,
        exit_threshold=0.7,
        ignore_eos=True,
    )
    alone = sampled(toy_model, params)
    crowded = sampled(toy_model, params, neighbours=5)
    crowded_async = sampled(
        toy_model,
        params,
        neighbours=5,
        async_scheduling=True,
        wavefront_chunked_prefill=True,
        prefill_chunk_size=2,
    )
    assert alone.token_ids == crowded.token_ids == crowded_async.token_ids
    assert alone.exit_depths == crowded.exit_depths == crowded_async.exit_depths
    other_seed = sampled(toy_model, SamplingParams(**{**_fields(params), "seed": 99}))
    assert other_seed.token_ids != alone.token_ids


def _fields(params: SamplingParams) -> dict:
    return {f: getattr(params, f) for f in params.__struct_fields__}


@pytest.mark.oracle
def test_sampled_engine_equals_the_oracle_with_the_same_sampler(toy_model, oracle) -> None:
    params = SamplingParams(
        max_tokens=12,
        temperature=0.8,
        top_k=40,
        top_p=0.95,
        seed=7,
        min_loops=1,
        exit_threshold=0.7,
        ignore_eos=True,
    )
    got = sampled(toy_model, params, neighbours=3)
    expected = oracle.generate(
        PROMPT,
        max_tokens=12,
        min_loops=1,
        exit_threshold=0.7,
        ignore_eos=True,
        sampler=lambda logits, i: sample_token(
            logits, temperature=0.8, top_k=40, top_p=0.95, seed=7, output_index=i
        ),
    )
    assert got.token_ids == expected.token_ids
    assert got.exit_depths == expected.exit_depths


@pytest.mark.unit
def test_filters_that_leave_one_token_are_greedy() -> None:
    logits = torch.randn(512, generator=torch.Generator().manual_seed(0))
    best = int(torch.argmax(logits))
    for i in range(20):
        assert (
            sample_token(logits, temperature=1.0, top_k=1, top_p=1.0, seed=i, output_index=i)
            == best
        )
        assert (
            sample_token(logits, temperature=1.0, top_k=0, top_p=1e-6, seed=i, output_index=i)
            == best
        )


@pytest.mark.unit
def test_top_k_never_samples_outside_the_k_best() -> None:
    logits = torch.randn(64, generator=torch.Generator().manual_seed(1))
    allowed = set(torch.topk(logits, 5).indices.tolist())
    draws = {
        sample_token(logits, temperature=2.0, top_k=5, top_p=1.0, seed=3, output_index=i)
        for i in range(200)
    }
    assert draws <= allowed and len(draws) > 1


@pytest.mark.unit
def test_greedy_and_sampled_rows_in_one_batch_each_get_their_own_token(toy_model) -> None:
    # The worker takes one batched argmax for greedy rows and the host sampler for the
    # others; a batch that interleaves both must hand every row its own token.
    def params(i: int) -> SamplingParams:
        temperature = 0.0 if i % 2 else 0.9
        return SamplingParams(
            max_tokens=8,
            temperature=temperature,
            seed=i,
            min_loops=1,
            exit_threshold=0.7,
            ignore_eos=True,
        )

    prompts = [[5 + i, 40 + 3 * i, 7, 200 - i] for i in range(6)]

    def run(ids: list[int]) -> dict[str, FinishedEvent]:
        engine = LLMEngine(toy_model, SchedulerConfig(block_size=4, num_blocks=256))
        for i in ids:
            engine.add_request(f"r{i}", prompts[i], params(i))
        return {e.request_id: e for e in engine.run_until_done() if isinstance(e, FinishedEvent)}

    together = run(list(range(6)))
    for i in range(6):
        alone = run([i])[f"r{i}"]
        assert together[f"r{i}"].token_ids == alone.token_ids
        assert together[f"r{i}"].exit_depths == alone.exit_depths
