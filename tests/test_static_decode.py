"""Static padded decode passes (what a CUDA graph replays) against the unpadded eager pass
and the serial oracle, with sampled rows, early exit and both KV layouts."""

from __future__ import annotations

import pytest

from messages.api import FinishedEvent
from messages.sampling import SamplingParams
from services.common.config import KVLayout, SchedulerConfig
from services.common.sampling import sample_token
from services.engine.engine import LLMEngine
from services.worker.passes.static_decode import DecodeMode, buckets

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
