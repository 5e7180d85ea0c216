"""Structured outputs in the in-process engine (the grammar engine's masks on the worker): on
a random model the mask does all the work, so every output must follow its format; greedy and
sampled tokens equal the serial oracle run with the same mask; a preemption, a worker loss
or a move to another shard rebuilds the grammar's state from the tokens; and a request
without a format is unchanged."""

from __future__ import annotations

import json
import random
import time

import msgspec
import numpy as np
import pytest
import torch

from messages.api import FinishedEvent, TokenEvent
from messages.errors import RequestError
from messages.sampling import SamplingParams, StructuredOutput
from services.common.config import KVAdmission, SchedulerConfig
from services.common.structured.grammar import check_structured_output
from services.common.structured.grammar_xgrammar import choice_ebnf
from services.common.tokenizer import TextCodec
from services.engine.engine import LLMEngine
from services.engine.executor import InProcessExecutor
from services.gateway.constrained.structured import FormatError, structured_output
from services.scheduler.core.intake import KnownOutputs
from services.worker.model.toy import toy_config
from services.worker.runner import ModelRunner
from services.worker.sampling.grammar import GrammarBook, PassMasks
from services.worker.sim import SIM_REFUSES_STRUCTURED_OUTPUT, SimCostModel, SimRunner
from tests.helpers import (
    TOY_VOCAB,
    assert_equals_masked_oracle,
    check_formats,
    masked_oracle_run,
    structured_constraint,
    structured_workload,
)

VOCAB = TOY_VOCAB


@pytest.fixture(scope="module")
def book(codec: TextCodec, toy_model) -> GrammarBook:
    return GrammarBook(codec, VOCAB, toy_model.cfg.stop_token_ids)


def _run(engine: LLMEngine, workload) -> tuple[dict[str, FinishedEvent], list[TokenEvent]]:
    for rid, prompt, params, _ in workload:
        engine.add_request(rid, prompt, params)
    events = engine.run_until_done()
    finished = {e.request_id: e for e in events if isinstance(e, FinishedEvent)}
    return finished, [e for e in events if isinstance(e, TokenEvent)]


# ---------------------------------------------------------------------- the engine
@pytest.mark.oracle
@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_every_output_follows_its_format_and_equals_the_oracle(
    toy_model, oracle, codec, backend: str
) -> None:
    """Ten random requests, greedy and sampled, every kind, some exiting early, sharing
    batches (async scheduling, follow-on rows, chunked prefill): each output is complete and
    valid, and equals the oracle's with the same mask, with either grammar engine."""
    workload = structured_workload(10, seed=7)
    config = SchedulerConfig(
        block_size=4, num_blocks=1024, prefill_chunk_size=8, structured_outputs_backend=backend
    )
    book = GrammarBook(
        codec, VOCAB, toy_model.cfg.stop_token_ids, backend=config.structured_outputs_backend
    )
    finished, _ = _run(LLMEngine(toy_model, config, codec=codec), workload)
    check_formats(finished, workload, codec, book)
    compared = 0
    for rid, prompt, params, _ in workload:
        expected, gaps = masked_oracle_run(oracle, book, prompt, params)
        compared += assert_equals_masked_oracle(finished[rid], expected, gaps, rid)
    assert compared >= 0.9 * sum(len(f.token_ids) for f in finished.values())
    depths = {d for f in finished.values() for d in f.exit_depths}
    assert len(depths) > 1  # early exit happened under the mask


@pytest.mark.oracle
def test_a_request_without_a_format_is_unchanged_beside_constrained_ones(toy_model, codec) -> None:
    """The same unconstrained requests, alone on an engine without grammars and sharing
    batches with constrained ones: identical tokens, exit depths and text."""
    rng = random.Random(3)
    plain = [
        (
            f"p{i}",
            [rng.randrange(1, 509) for _ in range(rng.randrange(2, 16))],
            SamplingParams(max_tokens=24, temperature=0.0 if i % 2 else 0.9, seed=i),
            "",
        )
        for i in range(6)
    ]
    config = SchedulerConfig(block_size=4, num_blocks=1024, prefill_chunk_size=8)
    alone, _ = _run(LLMEngine(toy_model, config, codec=codec), plain)
    mixed_engine = LLMEngine(toy_model, config, codec=codec)
    mixed, _ = _run(mixed_engine, plain + structured_workload(5, seed=11))
    for rid, *_ in plain:
        assert mixed[rid] == alone[rid], rid
    # a grammar lives as long as its request on the worker (freed with the next batch)
    assert set(mixed_engine.runner.constrained) <= set(mixed_engine.runner.requests)


@pytest.mark.oracle
def test_preemption_rebuilds_the_grammar_from_the_generated_tokens(
    toy_model, oracle, codec, book
) -> None:
    """A KV cache too small for everyone: requests are preempted mid-output, recomputed and
    their known tokens replayed; the worker rebuilds each matcher from those tokens."""
    # long JSON outputs (with whitespace), so requests hold more KV as they go
    workload = structured_workload(25, seed=5, json_max_tokens=320, any_whitespace=True)
    workload = [w for w in workload if w[3] == "json_schema"]
    config = SchedulerConfig(
        block_size=8,
        num_blocks=240,
        max_num_seqs=6,
        prefill_chunk_size=8,
        kv_admission=KVAdmission.INCREMENTAL,
    )
    resent: list[int] = []  # tokens a request had generated when the worker got it again

    def on_batch(batch) -> None:
        resent.extend(len(n.generated_token_ids) for n in batch.wire.new_requests)

    engine = LLMEngine(toy_model, config, codec=codec, on_batch=on_batch)
    finished, tokens = _run(engine, workload)
    assert engine.scheduler.stats.num_preemptions > 0
    assert any(n > 0 for n in resent)  # some matchers were rebuilt mid-output
    check_formats(finished, workload, codec, book)
    compared = 0
    for rid, prompt, params, _ in workload:
        expected, gaps = masked_oracle_run(oracle, book, prompt, params)
        compared += assert_equals_masked_oracle(finished[rid], expected, gaps, rid)
        # each token reached the client once, in order
        indices = [t.index for t in tokens if t.request_id == rid]
        assert indices == list(range(len(finished[rid].token_ids)))
    assert compared > 0


@pytest.mark.oracle
@pytest.mark.parametrize("crash_step", [6, 40])
def test_a_worker_loss_rebuilds_the_grammar_on_the_new_worker(
    toy_model, codec, crash_step: int
) -> None:
    workload = [w for w in structured_workload(8, seed=9) if w[3] != "json_object"]
    config = SchedulerConfig(block_size=4, num_blocks=1024, prefill_chunk_size=8)
    expected, _ = _run(LLMEngine(toy_model, config, codec=codec), workload)
    engine = LLMEngine(toy_model, config, codec=codec)
    for rid, prompt, params, _ in workload:
        engine.add_request(rid, prompt, params)
    events = []
    for _ in range(crash_step):
        events += engine.step()
    engine.core.reset_after_executor_loss()
    engine.runner = ModelRunner(
        toy_model, config.num_blocks, config.block_size, grammars=engine.grammars
    )
    engine.core.executor = InProcessExecutor(engine.runner)
    events += engine.run_until_done()
    got = {e.request_id: e for e in events if isinstance(e, FinishedEvent)}
    for rid, want in expected.items():
        assert (got[rid].token_ids, got[rid].exit_depths) == (want.token_ids, want.exit_depths)


@pytest.mark.oracle
def test_a_request_resumed_with_known_tokens_goes_on_in_its_format(toy_model, codec, book) -> None:
    """A shard loss resumes a request elsewhere with the tokens its client has: the new
    worker's matcher starts from them, and the rest equals the uninterrupted run."""
    workload = [w for w in structured_workload(4, seed=13) if w[3] in ("json_schema", "grammar")]
    config = SchedulerConfig(block_size=4, num_blocks=1024)
    expected, _ = _run(LLMEngine(toy_model, config, codec=codec), workload)
    engine = LLMEngine(toy_model, config, codec=codec)
    for rid, prompt, params, _ in workload:
        want = expected[rid]
        k = len(want.token_ids) // 2
        known = KnownOutputs(want.token_ids[:k], want.exit_depths[:k])
        engine.core.add_request(rid, prompt, params, known_outputs=known)
    got = {e.request_id: e for e in engine.run_until_done() if isinstance(e, FinishedEvent)}
    for rid, want in expected.items():
        assert (got[rid].token_ids, got[rid].exit_depths) == (want.token_ids, want.exit_depths)
    check_formats(got, workload, codec, book)


# ---------------------------------------------------------------------- refusals
LL, XG = "llguidance", "xgrammar"


def _nested_schema(levels: int) -> str:
    """An array schema nested ``levels + 1`` JSON levels deep (the innermost, an integer)."""
    return '{"items": ' * levels + '{"type": "integer"}' + "}" * levels


@pytest.mark.unit
@pytest.mark.parametrize(
    ("constraint", "problems"),
    [
        (
            StructuredOutput(kind="regex", spec="a(b"),
            {LL: "unclosed group", XG: "parenthesis is not closed"},
        ),
        (
            StructuredOutput(kind="grammar", spec='root ::= "a" | b'),
            {LL: "Rule 'b' not found", XG: 'Rule "b" is not defined'},
        ),
        (
            StructuredOutput(kind="json_schema", spec='{"type": "strin"}'),
            {LL: "Invalid type: strin", XG: 'Unsupported type "strin"'},
        ),
        # what llguidance does not enforce is refused by name, never ignored
        (
            StructuredOutput(kind="json_schema", spec='{"type": "array", "uniqueItems": true}'),
            {LL: 'Unimplemented keys: ["uniqueItems"]'},
        ),
        (StructuredOutput(kind="json_schema", spec="[1, 2"), "not a JSON schema"),
        (StructuredOutput(kind="json_schema", spec="[1, 2]"), "must be an object"),
        (StructuredOutput(kind="choice", spec='["a", 1]'), "array of strings"),
        (StructuredOutput(kind="choice", spec="[]"), "array of strings"),
        (StructuredOutput(kind="regex", spec=""), "needs a spec"),
        (StructuredOutput(kind="json_object", spec="{}"), "takes no spec"),
        (StructuredOutput(kind="xml", spec="x"), "kind must be one of"),
        (StructuredOutput(kind="regex", spec="a", any_whitespace=True), "json_object only"),
        (StructuredOutput(kind="regex", spec="a", backend="outlines"), "backend must be one of"),
        # counted repetitions whose parse would stall (quadratic in the count)
        (StructuredOutput(kind="regex", spec="(a|b){1,5000}"), "counts over 1000"),
        (
            StructuredOutput(
                kind="json_schema",
                spec='{"type": "object", "properties": {"x": {"type": "string", '
                '"pattern": "a{2000}"}}}',
            ),
            "counts over 1000",
        ),
        (StructuredOutput(kind="grammar", spec='root ::= "a"{0,3000}'), "counts over 1000"),
        # a schema whose conversion would stall (xgrammar's grows with the cube of the depth)
        (StructuredOutput(kind="json_schema", spec=_nested_schema(200)), "nested 201 levels"),
    ],
)
@pytest.mark.parametrize("backend", [LL, XG])
def test_a_format_that_does_not_compile_is_refused_naming_the_problem(
    constraint: StructuredOutput, problems: str | dict[str, str], backend: str
) -> None:
    problem = problems if isinstance(problems, str) else problems.get(backend)
    if problem is None:
        pytest.skip(f"{backend} compiles it")
    if constraint.backend is None:
        constraint = msgspec.structs.replace(constraint, backend=backend)
    with pytest.raises(RequestError) as err:
        check_structured_output(constraint)
    assert problem in err.value.message
    assert "/project/cpp" not in err.value.message  # xgrammar's source location is not ours
    assert "\n" not in err.value.message  # one line (llguidance's echo the grammar)


@pytest.mark.unit
def test_a_bounded_repetition_within_the_limit_compiles() -> None:
    check_structured_output(StructuredOutput(kind="regex", spec="(a|b){1,1000}"))
    schema = '{"type": "string", "pattern": "^x{3,900}$", "description": "{5000} is prose"}'
    check_structured_output(StructuredOutput(kind="json_schema", spec=schema))


@pytest.mark.unit
def test_a_grammar_that_never_compiles_fails_its_request_not_the_pass(
    book: GrammarBook, monkeypatch: pytest.MonkeyPatch
) -> None:
    from concurrent.futures import Future

    from services.worker.sampling import grammar as worker_grammar

    monkeypatch.setattr(worker_grammar, "COMPILE_WAIT_S", 0.05)
    stuck: Future[object] = Future()  # a compile that never ends
    grammar = worker_grammar.RequestGrammar(book, stuck, [])
    out = np.zeros(book.words, dtype=np.int32)
    assert not grammar.fill_mask(out)
    assert grammar.error is not None and "did not compile within" in grammar.error
    assert grammar.accept(5, 0) == grammar.error


@pytest.mark.unit
@pytest.mark.parametrize("backend", [LL, XG])
def test_a_schema_nested_up_to_the_limit_compiles_with_either_engine(backend: str) -> None:
    """The depth bound is rlt's, below both engines' own: a schema's validity does not
    depend on the server's engine."""
    from services.common.structured.grammar import MAX_SCHEMA_DEPTH

    spec = _nested_schema(MAX_SCHEMA_DEPTH - 1)
    check_structured_output(StructuredOutput(kind="json_schema", spec=spec, backend=backend))


@pytest.mark.unit
def test_compiled_grammars_are_bounded_in_bytes(codec: TextCodec, toy_model) -> None:
    """The compiled-grammar LRU holds at most ``cache_bytes``: the oldest go first, never
    the one just compiled (xgrammar's, whose sizes are its precomputed masks)."""
    one = GrammarBook(codec, VOCAB, toy_model.cfg.stop_token_ids, backend=XG)
    size = one.compile(StructuredOutput(kind="regex", spec="a+b")).result().memory_size_bytes
    assert size > 0
    book = GrammarBook(
        codec, VOCAB, toy_model.cfg.stop_token_ids, cache_bytes=int(size * 2.5), backend=XG
    )
    specs = [f"a+b{'c' * i}" for i in range(5)]
    for spec in specs:
        book.compile(StructuredOutput(kind="regex", spec=spec)).result()
    for _ in range(100):  # a future's callbacks run just after its waiters wake
        if len(book._sizes) == len(book._cache):
            break
        time.sleep(0.01)
    held = [key.spec for key in book._cache]
    assert held and held[-1] == specs[-1] and len(held) <= 3, held
    assert book._bytes <= size * 2.5 * 1.5  # the sizes of grammars alike differ a little


@pytest.mark.unit
def test_a_format_with_no_next_token_fails_with_that(book: GrammarBook) -> None:
    from services.worker.sampling.grammar import RequestGrammar

    empty = StructuredOutput(kind="regex", spec=r"[^\s\S]")
    grammar = RequestGrammar(book, book.compile(empty), [])
    out = np.zeros(book.words, dtype=np.int32)
    assert not grammar.fill_mask(out)
    assert grammar.error == "structured output: the format allows no next token"
    assert grammar.accept(5, 0) == grammar.error


@pytest.mark.unit
def test_the_engine_refuses_what_cannot_run(toy_model, codec) -> None:
    config = SchedulerConfig(block_size=4, num_blocks=64)
    bad = SamplingParams(structured_output=StructuredOutput(kind="regex", spec="(("))
    with pytest.raises(RequestError, match="does not compile"):
        LLMEngine(toy_model, config, codec=codec).add_request("r", [1, 2], bad)
    ok = SamplingParams(structured_output=structured_constraint("regex"))
    with pytest.raises(RequestError, match="tokenizer"):
        LLMEngine(toy_model, config).add_request("r", [1, 2], ok)
    with pytest.raises(RequestError, match="ignore_eos"):
        SamplingParams(structured_output=structured_constraint("regex"), ignore_eos=True).validate()


@pytest.mark.unit
def test_the_simulated_device_refuses_a_format() -> None:
    from services.common.config import ModelLimits
    from services.scheduler.engine_core import EngineCore

    cfg = toy_config("toy")
    core = EngineCore(
        SchedulerConfig(block_size=4, num_blocks=64),
        ModelLimits.from_model_config(cfg),
        InProcessExecutor(SimRunner(cfg, SimCostModel.for_model(cfg), sleep=False)),  # type: ignore[arg-type]
    )
    core.add_request(
        "r", [1, 2, 3], SamplingParams(structured_output=structured_constraint("choice"))
    )
    events = []
    while core.has_unfinished_requests():
        events += core.step()
    assert [e.message for e in events if e.request_id == "r"] == [SIM_REFUSES_STRUCTURED_OUTPUT]


# ---------------------------------------------------------------------- pieces
@pytest.mark.unit
def test_pass_masks_equal_xgrammars_own_kernel() -> None:
    """The device-side mask (torch ops) against xgrammar's kernel: random bitmasks with the
    sign bit set, a vocabulary that is not a multiple of 32, rows without a mask kept."""
    import xgrammar as xgr

    g = torch.Generator().manual_seed(0)
    vocab, rows = 77, 5
    logits = torch.randn(rows, vocab, generator=g)
    masked_rows = [0, 2, 3]
    bits = torch.randint(-(2**31), 2**31 - 1, (len(masked_rows), 3), generator=g, dtype=torch.int64)
    bits = bits.to(torch.int32)
    words = torch.cat([torch.tensor(masked_rows, dtype=torch.int32), bits.flatten()])
    got = PassMasks(len(masked_rows), words).apply(logits)
    want = logits.clone()
    full = torch.full((rows, 3), -1, dtype=torch.int32)
    full[masked_rows] = bits
    xgr.apply_token_bitmask_inplace(want, full)
    assert torch.equal(got, want)
    # every row masked, in order: the same without the gather
    every = torch.randint(-(2**31), 2**31 - 1, (rows, 3), generator=g, dtype=torch.int64)
    every = every.to(torch.int32)
    words = torch.cat([torch.arange(rows, dtype=torch.int32), every.flatten()])
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, every)
    assert torch.equal(PassMasks(rows, words, every_row=True).apply(logits), want)


@pytest.mark.unit
def test_choices_become_an_exact_grammar() -> None:
    assert choice_ebnf(["a", 'b"c', "déjà"]) == 'root ::= "a" | "b\\"c" | "déjà"'


@pytest.mark.unit
def test_the_gateway_reads_openai_and_vllm_formats() -> None:
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {}}}
    got = structured_output(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}},
        None,
    )
    assert got == StructuredOutput(kind="json_schema", spec=json.dumps(schema).replace(" ", ""))
    assert structured_output({"type": "json_object"}, None) == StructuredOutput(kind="json_object")
    assert structured_output(None, {"choice": ["x", "y"]}) == StructuredOutput(
        kind="choice", spec='["x","y"]'
    )
    assert structured_output(None, {"regex": "a+", "disable_fallback": True}) == (
        StructuredOutput(kind="regex", spec="a+")
    )
    assert structured_output({"type": "text"}, None) is None
    # JSON is compact unless the request asks for whitespace (vLLM's option, said false)
    spaced = structured_output(None, {"json": schema, "disable_any_whitespace": False})
    assert spaced is not None and spaced.any_whitespace
    for vllm in [{"json": schema}, {"json": schema, "disable_any_whitespace": True}]:
        got = structured_output(None, vllm)
        assert got is not None and not got.any_whitespace
    regex = structured_output(None, {"regex": "a+", "disable_any_whitespace": False})
    assert regex == StructuredOutput(kind="regex", spec="a+")  # no whitespace to allow
    for response_format, vllm, param in [
        ({"type": "json_object"}, {"regex": "a"}, "structured_outputs"),
        (None, {"regex": "a", "json": "{}"}, "structured_outputs"),
        (None, {"regex": "a", "whitespace_pattern": " "}, "structured_outputs.whitespace_pattern"),
        (None, {"regex": "a", "nope": 1}, "structured_outputs.nope"),
        (None, {"choice": "a"}, "structured_outputs.choice"),
        (
            {"type": "json_schema", "json_schema": {"name": "x"}},
            None,
            "response_format.json_schema.schema",
        ),
        ({"type": "grammar"}, None, "response_format"),
    ]:
        with pytest.raises(FormatError) as err:
            structured_output(response_format, vllm)
        assert err.value.param == param


@pytest.mark.unit
def test_admission_fixes_each_requests_grammar_engine(toy_checkpoint, codec) -> None:
    """Admission writes its server's engine into a format that names none (so every worker
    the request runs on compiles it alike), keeps one a request names, and refuses a format
    its engine does not enforce with a 400 naming the keyword."""
    from services.admission.config import AdmissionConfig
    from services.admission.errors import AdmissionError
    from services.admission.validation import RequestValidator
    from services.common.checkpoint import load_model_limits

    limits = load_model_limits(toy_checkpoint)

    def prepare(backend: str, constraint: dict) -> StructuredOutput:
        config = AdmissionConfig(structured_outputs_backend=backend)
        validator = RequestValidator(limits, codec, config)
        body = {"prompt": "hi", "structured_output": constraint}
        prepared = validator.prepare(json.dumps(body).encode())
        validator.check_structured_output(prepared)
        assert prepared.params.structured_output is not None
        return prepared.params.structured_output

    unique = {"kind": "json_schema", "spec": '{"type": "array", "uniqueItems": true}'}
    assert prepare(XG, unique).backend == XG
    assert prepare(LL, {"kind": "regex", "spec": "a+"}).backend == LL
    assert prepare(XG, {**unique, "backend": "xgrammar"}).backend == XG
    with pytest.raises(AdmissionError) as err:
        prepare(XG, {**unique, "backend": "llguidance"})
    assert err.value.code == "invalid_request" and "uniqueItems" in err.value.message
