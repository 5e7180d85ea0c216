"""Log-probabilities: each generated token's, and its most likely alternatives, equal the
serial oracle's log-softmax of the logits the token was chosen from (at its exit depth),
for greedy and sampled requests, in every prefill mode, beside requests that ask for none."""

from __future__ import annotations

import itertools

import pytest

from messages.api import FinishedEvent, TokenEvent
from messages.errors import RequestError
from messages.sampling import MAX_LOGPROBS, SamplingParams
from services.common.config import SchedulerConfig
from services.common.sampling import sample_token
from services.common.tokenizer import TextCodec
from services.engine.engine import LLMEngine

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
}


@pytest.mark.oracle
@pytest.mark.parametrize("mode", CONFIGS)
def test_logprobs_equal_the_oracle_beside_requests_without_them(
    toy_model, oracle, mode: str
) -> None:
    common = dict(max_tokens=10, min_loops=1, exit_threshold=0.6, ignore_eos=True)
    sampled = dict(temperature=0.8, top_k=40, top_p=0.95, seed=7)
    config = SchedulerConfig(block_size=4, num_blocks=256, **CONFIGS[mode])
    tokens = _run(
        LLMEngine(toy_model, config),
        {
            "greedy5": SamplingParams(temperature=0.0, logprobs=5, **common),
            "none": SamplingParams(temperature=0.0, **common),
            "sampled3": SamplingParams(logprobs=3, **sampled, **common),
            "own_only": SamplingParams(temperature=0.0, logprobs=0, **common),
            "most": SamplingParams(temperature=0.0, logprobs=MAX_LOGPROBS, **common),
        },
    )
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
@pytest.mark.parametrize("value", [-1, MAX_LOGPROBS + 1, True, 2.0])
def test_out_of_range_logprobs_are_refused(value) -> None:
    with pytest.raises(RequestError, match="logprobs"):
        SamplingParams(logprobs=value).validate()


@pytest.mark.unit
def test_logprobs_in_range_are_accepted() -> None:
    for value in (None, 0, MAX_LOGPROBS):
        SamplingParams(logprobs=value).validate()
