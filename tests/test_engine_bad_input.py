"""Bad input to the engine and SamplingParams: a clear error each, engine state unchanged."""

from __future__ import annotations

import pytest

from messages.errors import RequestError
from messages.sampling import SamplingParams
from services.common.config import SchedulerConfig
from services.engine.engine import LLMEngine

pytestmark = pytest.mark.unit

OK = SamplingParams(max_tokens=4, temperature=0.0)


@pytest.fixture
def engine(toy_model) -> LLMEngine:
    e = LLMEngine(toy_model, SchedulerConfig(block_size=4, num_blocks=128))
    e.add_request("live", [1, 2, 3], OK)
    return e


CASES = [
    ("empty prompt", [], OK, "at least one token"),
    ("token outside vocab", [1, 512], OK, "outside the vocabulary"),
    ("negative token", [-1], OK, "outside the vocabulary"),
    ("max_tokens < 1", [1], SamplingParams(max_tokens=0), "max_tokens must be >= 1"),
    ("min > max loops", [1], SamplingParams(min_loops=3, max_loops=2), "must not exceed"),
    ("max_loops > D", [1], SamplingParams(max_loops=5), "exceeds the model's total_ut_steps"),
    ("threshold > 1", [1], SamplingParams(exit_threshold=1.5), "exit_threshold"),
    ("threshold < 0", [1], SamplingParams(exit_threshold=-0.1), "exit_threshold"),
    ("too long", [1] * 2000, SamplingParams(max_tokens=100), "max_position_embeddings"),
    ("bad top_p", [1], SamplingParams(top_p=0.0), "top_p"),
    ("negative temperature", [1], SamplingParams(temperature=-1.0), "temperature"),
    ("stop token outside vocab", [1], SamplingParams(stop_token_ids=[9999]), "stop token"),
]


@pytest.mark.parametrize(("label", "prompt", "params", "message"), CASES, ids=[c[0] for c in CASES])
def test_bad_request_is_refused_and_changes_nothing(engine, label, prompt, params, message):
    before_ids = set(engine.scheduler.requests)
    before_free = engine.scheduler.kv.num_free_blocks
    with pytest.raises(RequestError, match=message):
        engine.add_request(f"bad-{label}", prompt, params)
    assert set(engine.scheduler.requests) == before_ids
    assert engine.scheduler.kv.num_free_blocks == before_free
    # the live request is unaffected
    (done,) = [
        e
        for e in engine.run_until_done()
        if e.request_id == "live" and getattr(e, "finish_reason", None)
    ]
    assert len(done.token_ids) == 4


def test_duplicate_live_request_id_is_refused(engine) -> None:
    with pytest.raises(RequestError, match="already live"):
        engine.add_request("live", [4, 5], OK)
    assert engine.scheduler.requests["live"].prompt_token_ids == [1, 2, 3]


def test_request_id_can_be_reused_after_it_finished(engine) -> None:
    engine.run_until_done()
    engine.add_request("live", [4, 5], OK)
    assert engine.run_until_done()[-1].finish_reason == "length"


def test_abort_of_unknown_id_is_a_clear_error(engine) -> None:
    with pytest.raises(RequestError, match="unknown request id"):
        engine.abort_request("nope")


def test_sampling_params_reject_wrong_types() -> None:
    with pytest.raises(RequestError, match="integer"):
        SamplingParams(max_tokens=True).validate()  # type: ignore[arg-type]
    with pytest.raises(RequestError, match="integer"):
        SamplingParams(top_k=1.5).validate()  # type: ignore[arg-type]
    # found by the fuzzer: integers too large for msgpack must be refused, not crash encoders
    with pytest.raises(RequestError, match="top_k must be <="):
        SamplingParams(top_k=2**70).validate()
