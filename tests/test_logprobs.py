"""Log-probabilities: each generated token's, and its most likely alternatives, equal the
serial oracle's log-softmax of the logits the token was chosen from (at its exit depth),
for greedy and sampled requests, in every prefill mode, beside requests that ask for none;
prompt log-probabilities equal the oracle's full-depth prompt logits, also when the prompt
is cached (it is computed anyway) or preempted mid-prefill."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from messages.api import FinishedEvent, TokenEvent
from messages.batch import SampledLogprobs
from messages.errors import RequestError
from messages.sampling import MAX_LOGPROBS, SamplingParams
from services.common.config import KVLayout, ModelLimits, SchedulerConfig
from services.common.sampling import sample_token
from services.common.tokenizer import TextCodec
from services.engine.engine import LLMEngine
from services.engine.executor import InProcessExecutor
from services.scheduler.engine_core import EngineCore
from services.worker.model.toy import toy_config
from services.worker.sampling import logprobs as logprobs_module
from services.worker.sampling.logprobs import LOGPROB_FLOOR, logprob_columns, read_scored
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
    "shared": dict(prefill_chunk_size=3, kv_layout=KVLayout.SHARED),
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
    policy = dict(max_tokens=10, min_loops=1, exit_threshold=0.6, ignore_eos=True)
    if mode == "shared":  # the oracle computes the same prompt chunks
        policy.update(kv_layout="shared", prefill_chunk_size=config.prefill_chunk_size)
    greedy = oracle.generate(PROMPT[:5], **policy)
    _assert_equals_oracle(tokens["greedy5"], greedy, 5)
    # greedy: the token is the most likely one
    assert all(e.logprobs.top_logprobs[0].token_id == e.token_id for e in tokens["greedy5"])

    assert all(e.logprobs is None for e in tokens["none"])

    # sampled: the distribution is the model's (before temperature and the filters), and
    # the token is the seeded sampler's, as without logprobs
    want = oracle.generate(
        PROMPT[:7],
        **policy,
        sampler=lambda logits, i: sample_token(
            logits, temperature=0.8, top_k=40, top_p=0.95, seed=7, output_index=i
        ),
    )
    _assert_equals_oracle(tokens["sampled3"], want, 3)

    own = oracle.generate(PROMPT[:8], **policy)
    _assert_equals_oracle(tokens["own_only"], own, 0)
    most = oracle.generate(PROMPT[:9], **policy)
    _assert_equals_oracle(tokens["most"], most, MAX_LOGPROBS)


@pytest.mark.unit
def test_logprobs_name_their_tokens_with_a_tokenizer(toy_model, toy_checkpoint) -> None:
    codec = TextCodec.from_checkpoint(toy_checkpoint)
    assert codec is not None
    engine = LLMEngine(toy_model, SchedulerConfig(block_size=4, num_blocks=64), codec=codec)
    params = SamplingParams(
        max_tokens=6, temperature=0.0, logprobs=2, prompt_logprobs=1, ignore_eos=True
    )
    events = _run(engine, {"r": params})["r"]
    prompt = PROMPT[:5]
    assert [e.token for e in events[0].prompt_logprobs] == [codec.piece(t) for t in prompt]
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
    columns = logprob_columns(logits, torch.tensor([1, 0]), 4)
    scored = read_scored(columns.tolist())
    results = [SampledLogprobs(logprob=c, top_ids=i, top_logprobs=v) for c, i, v in scored]
    first, second = results
    assert first.logprob == LOGPROB_FLOOR  # the -inf logit
    assert first.top_ids == [3, 2, 0, 1]
    assert first.top_logprobs[:3] == pytest.approx(torch.log_softmax(logits[0, [3, 2, 0]], 0))
    assert all(math.isfinite(v) for r in results for v in [r.logprob, *r.top_logprobs])
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


def _prompt_reference(
    oracle, prompt: list[int], top: int, **layout: object
) -> list[tuple[float, list[int]]]:
    """(log-probability of prompt token p, the ``top`` best ids) for p >= 1, from the
    oracle's full-depth logits of position p - 1 (``layout``: its KV layout and chunks)."""
    logprobs = torch.log_softmax(oracle.prompt_logits(prompt, **layout), dim=-1)
    out = []
    for p in range(1, len(prompt)):
        best = torch.topk(logprobs[p - 1], top).indices.tolist() if top else []
        out.append((float(logprobs[p - 1, prompt[p]]), best))
    return out


def _check_prompt_logprobs(
    event: TokenEvent, oracle, prompt: list[int], top: int, **layout: object
) -> None:
    entries = event.prompt_logprobs
    assert entries is not None and event.index == 0
    assert [e.token_id for e in entries] == prompt
    assert entries[0].logprob is None and entries[0].top_logprobs == []  # nothing predicts it
    for entry, (want, best) in zip(
        entries[1:], _prompt_reference(oracle, prompt, top, **layout), strict=True
    ):
        assert entry.logprob == pytest.approx(want, abs=TOL)
        assert [t.token_id for t in entry.top_logprobs] == best


PROMPT_CONFIGS = {
    "atomic": dict(prefill_chunk_size=3),
    "wcpb_async": dict(
        prefill_chunk_size=2,
        split_prefill=True,
        wavefront_chunked_prefill=True,
        async_scheduling=True,
    ),
    "prefix_cached": dict(prefill_chunk_size=4, enable_prefix_caching=True),
    # SHARED: a chunk's later positions see its earlier ones at the depth they reached, so
    # the result depends on where chunks end; the oracle is told the same chunks
    "shared": dict(prefill_chunk_size=3, kv_layout=KVLayout.SHARED),
}


@pytest.mark.oracle
@pytest.mark.parametrize("mode", PROMPT_CONFIGS)
def test_prompt_logprobs_equal_the_oracles_prompt_logits(toy_model, oracle, mode: str) -> None:
    config = SchedulerConfig(**{"block_size": 4, "num_blocks": 256, **PROMPT_CONFIGS[mode]})
    engine = LLMEngine(toy_model, config)
    long_prompt = [*PROMPT, 3, 9, 27, 81, 243, 217, 139, 5]  # 16 tokens: whole blocks
    common = dict(max_tokens=6, temperature=0.0, ignore_eos=True)
    if mode == "prefix_cached":  # its blocks in the cache before the asking request comes
        engine.add_request("warm", long_prompt, SamplingParams(**common))
        engine.run_until_done()
    requests = {
        "prompt3": (long_prompt, SamplingParams(prompt_logprobs=3, logprobs=1, **common)),
        "plain": (long_prompt[:12], SamplingParams(**common)),
        "prompt0": (long_prompt[:9], SamplingParams(prompt_logprobs=0, **common)),
        "other": (long_prompt[2:], SamplingParams(**common)),
    }
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    events = [e for e in engine.run_until_done() if isinstance(e, TokenEvent)]
    first = {e.request_id: e for e in events if e.index == 0}
    layout = {}
    if mode == "shared":
        layout = {"kv_layout": "shared", "prefill_chunk_size": config.prefill_chunk_size}
    _check_prompt_logprobs(first["prompt3"], oracle, long_prompt, 3, **layout)
    _check_prompt_logprobs(first["prompt0"], oracle, long_prompt[:9], 0, **layout)
    # only the first token carries them, and only for the requests that asked
    assert all(e.prompt_logprobs is None for e in events if e not in first.values())
    assert first["plain"].prompt_logprobs is None and first["other"].prompt_logprobs is None
    # the generated tokens are the oracle's, as without them
    want = oracle.generate(long_prompt, max_tokens=6, ignore_eos=True, **layout)
    assert [e.token_id for e in events if e.request_id == "prompt3"] == want.token_ids
    assert not engine.scheduler.requests  # every request ended


@pytest.mark.oracle
@pytest.mark.parametrize("mode", ["atomic", "split", "wcpb"])
def test_prompt_logprobs_survive_a_preemption_mid_prefill(toy_model, oracle, mode) -> None:
    """A more urgent request takes the KV of one half through its prompt: the prompt is
    computed again and its log-probabilities go out once, equal to the oracle's."""
    config = SchedulerConfig(
        block_size=4,
        num_blocks=24,  # the slow request's whole footprint
        prefill_chunk_size=2,
        max_num_batched_tokens=4,
        split_prefill=mode != "atomic",
        wavefront_chunked_prefill=mode == "wcpb",
    )
    engine = LLMEngine(toy_model, config)
    prompt = [*PROMPT, 3, 9, 27, 81, 243, 217, 139, 5]
    common = dict(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request("slow", prompt, SamplingParams(prompt_logprobs=2, priority=1, **common))
    request = engine.scheduler.requests["slow"]

    def scored() -> int:
        return sum(slot is not None for slot in request.prompt_logprobs or [])

    events = []
    while not scored():
        events += engine.step()
    assert scored() < len(prompt) - 1  # part of the prompt scored
    engine.add_request("urgent", prompt[:5], SamplingParams(priority=0, **common))
    events += engine.run_until_done()
    assert engine.scheduler.stats.num_preemptions > 0
    tokens = [e for e in events if isinstance(e, TokenEvent) and e.request_id == "slow"]
    with_prompt = [e for e in tokens if e.prompt_logprobs is not None]
    assert len(with_prompt) == 1
    _check_prompt_logprobs(with_prompt[0], oracle, prompt, 2)
    want = oracle.generate(prompt, max_tokens=6, ignore_eos=True)
    assert [e.token_id for e in tokens] == want.token_ids


@pytest.mark.oracle
def test_prompt_logprobs_scored_in_slices_equal_the_oracle(toy_model, oracle, monkeypatch) -> None:
    """The worker scores a batch's prompt positions a slice at a time (bounded memory)."""
    monkeypatch.setattr(logprobs_module, "_PROMPT_SLICE", 3)
    engine = LLMEngine(toy_model, SchedulerConfig(block_size=4, num_blocks=64))
    prompt = [*PROMPT, 3, 9, 27]
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=4, ignore_eos=True)
    engine.add_request("r", prompt, params)
    first = next(e for e in engine.run_until_done() if isinstance(e, TokenEvent))
    _check_prompt_logprobs(first, oracle, prompt, 4)
