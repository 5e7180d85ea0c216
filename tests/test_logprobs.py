"""Log-probabilities: each generated token's, and its most likely alternatives, equal the
serial oracle's log-softmax of the logits the token was chosen from (at its exit depth),
for greedy and sampled requests, in every prefill mode, beside requests that ask for none."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from messages.api import FinishedEvent, TokenEvent
from messages.batch import RowResult, WorkerSampling
from messages.errors import RequestError
from messages.sampling import MAX_LOGPROBS, SamplingParams
from services.common.config import ModelLimits, SchedulerConfig
from services.common.sampling import sample_token
from services.common.tokenizer import TextCodec
from services.engine.engine import LLMEngine
from services.engine.executor import InProcessExecutor
from services.scheduler.engine_core import EngineCore
from services.worker.model.toy import toy_config
from services.worker.runner import LOGPROB_FLOOR, _attach_logprobs
from services.worker.sim import SimCostModel, SimRunner

PROMPT = [17, 4, 250, 31, 99, 8, 8, 140]
TOL = 1e-4  # batched float32 against the serial oracle's float32


def _run(engine: LLMEngine, requests: dict[str, SamplingParams]) -> dict[str, list[TokenEvent]]:
    for i, (rid, params) in enumerate(requests.items()):
        engine.add_request(rid, PROMPT[: 5 + i], params)
    tokens: dict[str, list[TokenEvent]] = {rid: [] for rid in requests}
    finished: set[str] = set()
    for event in engine.run_until_done():
        if isinstance(event, TokenEvent):
            tokens[event.request_id].append(event)
        elif isinstance(event, FinishedEvent):
            finished.add(event.request_id)
    assert finished == set(requests)
    return tokens


def _assert_equals_oracle(events: list[TokenEvent], expected, num_top: int) -> None:
    assert [e.token_id for e in events] == expected.token_ids
    assert [e.exit_depth for e in events] == expected.exit_depths
    for event, step in zip(events, expected.steps, strict=True):
        assert event.logprobs is not None
        assert event.logprobs.logprob == pytest.approx(step.logprob, abs=TOL)
        got = [(t.token_id, t.logprob) for t in event.logprobs.top_logprobs]
        assert len(got) == num_top
        assert [t for t, _ in got] == [t for t, _ in step.top_logprobs[:num_top]]
        for (_, value), (_, want) in zip(got, step.top_logprobs, strict=False):
            assert value == pytest.approx(want, abs=TOL)
        assert all(a[1] >= b[1] for a, b in itertools.pairwise(got))  # most likely first


CONFIGS = {
    "atomic": dict(prefill_chunk_size=3),
    "split_async": dict(prefill_chunk_size=2, split_prefill=True, async_scheduling=True),
    "wcpb_async": dict(
        prefill_chunk_size=2,
        split_prefill=True,
        wavefront_chunked_prefill=True,
        async_scheduling=True,
    ),
    # KV for one request and a half: preempted ones recompute their tokens, whose
    # log-probabilities must be neither sent again nor lost
    "preempted": dict(prefill_chunk_size=2, async_scheduling=True, num_blocks=24),
}


@pytest.mark.oracle
@pytest.mark.parametrize("mode", CONFIGS)
def test_logprobs_equal_the_oracle_beside_requests_without_them(
    toy_model, oracle, mode: str
) -> None:
    common = dict(max_tokens=10, min_loops=1, exit_threshold=0.6, ignore_eos=True)
    sampled = dict(temperature=0.8, top_k=40, top_p=0.95, seed=7)
    config = SchedulerConfig(**{"block_size": 4, "num_blocks": 256, **CONFIGS[mode]})
    engine = LLMEngine(toy_model, config)
    tokens = _run(
        engine,
        {
            "greedy5": SamplingParams(temperature=0.0, logprobs=5, **common),
            "none": SamplingParams(temperature=0.0, **common),
            "sampled3": SamplingParams(logprobs=3, **sampled, **common),
            "own_only": SamplingParams(temperature=0.0, logprobs=0, **common),
            "most": SamplingParams(temperature=0.0, logprobs=MAX_LOGPROBS, **common),
        },
    )
    assert (engine.scheduler.stats.num_preemptions > 0) == (mode == "preempted")
    greedy = oracle.generate(PROMPT[:5], max_tokens=10, min_loops=1, exit_threshold=0.6)
    _assert_equals_oracle(tokens["greedy5"], greedy, 5)
    # greedy: the token is the most likely one
    assert all(e.logprobs.top_logprobs[0].token_id == e.token_id for e in tokens["greedy5"])

    assert all(e.logprobs is None for e in tokens["none"])

    # sampled: the distribution is the model's (before temperature and the filters), and
    # the token is the seeded sampler's, as without logprobs
    want = oracle.generate(
        PROMPT[:7],
        max_tokens=10,
        min_loops=1,
        exit_threshold=0.6,
        sampler=lambda logits, i: sample_token(
            logits, temperature=0.8, top_k=40, top_p=0.95, seed=7, output_index=i
        ),
    )
    _assert_equals_oracle(tokens["sampled3"], want, 3)

    own = oracle.generate(PROMPT[:8], max_tokens=10, min_loops=1, exit_threshold=0.6)
    _assert_equals_oracle(tokens["own_only"], own, 0)
    most = oracle.generate(PROMPT[:9], max_tokens=10, min_loops=1, exit_threshold=0.6)
    _assert_equals_oracle(tokens["most"], most, MAX_LOGPROBS)


@pytest.mark.unit
def test_logprobs_name_their_tokens_with_a_tokenizer(toy_model, toy_checkpoint) -> None:
    codec = TextCodec.from_checkpoint(toy_checkpoint)
    assert codec is not None
    engine = LLMEngine(toy_model, SchedulerConfig(block_size=4, num_blocks=64), codec=codec)
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)
    events = _run(engine, {"r": params})["r"]
    for event in events:
        assert event.logprobs is not None
        assert event.logprobs.token == codec.piece(event.token_id)
        assert [t.token for t in event.logprobs.top_logprobs] == [
            codec.piece(t.token_id) for t in event.logprobs.top_logprobs
        ]


@pytest.mark.unit
def test_without_a_tokenizer_tokens_are_named_by_id(toy_model) -> None:
    engine = LLMEngine(toy_model, SchedulerConfig(block_size=4, num_blocks=64))
    params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=2, ignore_eos=True)
    for event in _run(engine, {"r": params})["r"]:
        assert event.logprobs is not None
        assert event.logprobs.token == f"token_id:{event.token_id}"
        assert [t.token for t in event.logprobs.top_logprobs] == [
            f"token_id:{t.token_id}" for t in event.logprobs.top_logprobs
        ]


@pytest.mark.unit
def test_infinite_logits_give_finite_logprobs() -> None:
    """JSON has no -inf or NaN: values are floored at vLLM's -9999, also for a row whose
    logits hold +inf (no finite distribution)."""
    logits = torch.tensor([[0.0, -math.inf, 1.0, 2.0], [math.inf, 0.0, 0.0, 0.0]])
    sampling = WorkerSampling(
        temperature=0.0, top_p=1.0, top_k=0, seed=0, min_loops=1, max_loops=4,
        exit_threshold=1.0, logprobs=4,
    )  # fmt: skip
    results = [RowResult(row_index=0), RowResult(row_index=1)]
    _attach_logprobs(logits, [sampling, sampling], [1, 0], results)
    first, second = (r.logprobs for r in results)
    assert first.logprob == LOGPROB_FLOOR  # the -inf logit
    assert first.top_ids == [3, 2, 0, 1]
    assert first.top_logprobs[:3] == pytest.approx(torch.log_softmax(logits[0, [3, 2, 0]], 0))
    assert all(
        math.isfinite(v) for r in results for v in [r.logprobs.logprob, *r.logprobs.top_logprobs]
    )
    assert second.logprob <= 0.0


@pytest.mark.unit
def test_the_simulated_device_answers_logprobs_in_shape() -> None:
    """``--device sim`` (benchmarks) returns log-probabilities of the asked shape: its
    token is certain."""
    cfg = toy_config("toy")
    runner = SimRunner(cfg, SimCostModel.for_model(cfg), sleep=False)
    core = EngineCore(
        SchedulerConfig(block_size=4, num_blocks=64),
        ModelLimits.from_model_config(cfg),
        InProcessExecutor(runner),  # type: ignore[arg-type]
    )
    core.add_request("r", [1, 2, 3], SamplingParams(max_tokens=4, logprobs=3, ignore_eos=True))
    events = []
    while core.has_unfinished_requests():
        events += core.step()
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert len(tokens) == 4
    for e in tokens:
        assert e.logprobs.logprob == 0.0
        assert e.logprobs.top_logprobs[0].token_id == e.token_id
        assert len(e.logprobs.top_logprobs) == 3


@pytest.mark.unit
@pytest.mark.parametrize("value", [-1, MAX_LOGPROBS + 1, True, 2.0])
def test_out_of_range_logprobs_are_refused(value) -> None:
    with pytest.raises(RequestError, match="logprobs"):
        SamplingParams(logprobs=value).validate()


@pytest.mark.unit
def test_logprobs_in_range_are_accepted() -> None:
    for value in (None, 0, MAX_LOGPROBS):
        SamplingParams(logprobs=value).validate()
