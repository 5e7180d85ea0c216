"""Structured outputs through the real services: the ``openai`` client against ``rlt up``'s
gateway (``response_format`` and vLLM's ``structured_outputs``, streamed and not, greedy and
sampled: every output follows its format; greedy ones equal the oracle with the same mask;
a format that does not compile is a 400 naming the problem), and a worker killed (-9)
mid-stream: the new worker rebuilds each grammar from the tokens and every request ends in
its format, equal to an uninterrupted run."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from openai import OpenAI

from messages.api import ErrorEvent, FinishedEvent, GenerateRequest
from messages.sampling import SamplingParams, StructuredOutput
from services.common.tokenizer import TextCodec
from services.engine.engine import LLMEngine
from services.launcher import NatsServer, free_port
from services.oracle import SerialOracle
from services.worker.model.ouro import OuroModel
from services.worker.sampling.grammar import GrammarBook
from tests.helpers import (
    CHOICES,
    EMAIL_REGEX,
    FORMATS,
    PERSON_SCHEMA,
    SUM_GRAMMAR,
    MaskedSampler,
    assert_follows,
)
from tests.service_cases import ENGINE_ARGS, engine_config, kv_reclaimed
from tests.service_procs import (
    StreamCollector,
    client,
    health,
    service_procs,
    start_rlt_up,
    wait_for,
)

pytestmark = pytest.mark.services

MODEL = "toy-ckpt"
VOCAB = 512  # the toy model's
ENV = {"RLT_WORKER_HEARTBEAT_TIMEOUT_S": "1.5", "RLT_WORKER_HEARTBEAT_S": "0.25"}


@dataclass
class Up:
    http_url: str
    proc: subprocess.Popen[str]


@pytest.fixture(scope="module")
def up(toy_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    workdir = tmp_path_factory.mktemp("rlt-up-structured")
    http_port = free_port()
    cmd = [sys.executable, "-m", "services.cli", "up", "--port", str(free_port())]
    cmd += ["--http-port", str(http_port), "--checkpoint", str(toy_checkpoint)]
    cmd += ["--client-url-file", str(workdir / "client-url"), "--served-model-name", MODEL]
    env = {**os.environ, "RLT_RUN_DIR": str(workdir), "OMP_NUM_THREADS": "1"}
    proc, _ = start_rlt_up(cmd, env, workdir / "rlt-up.log", timeout_s=90)
    try:
        yield Up(f"http://127.0.0.1:{http_port}", proc)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def book(codec: TextCodec, toy_model: OuroModel) -> GrammarBook:
    return GrammarBook(codec, toy_model.cfg.vocab_size, toy_model.cfg.stop_token_ids)


# (the request's format fields, the format as the NATS API says it)
_HTTP_FORMATS = {
    "json_schema": (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON_SCHEMA},
            }
        },
        FORMATS["json_schema"],
    ),
    "regex": ({"extra_body": {"structured_outputs": {"regex": EMAIL_REGEX}}}, FORMATS["regex"]),
    "choice": ({"extra_body": {"structured_outputs": {"choice": CHOICES}}}, FORMATS["choice"]),
    "grammar": (
        {"extra_body": {"structured_outputs": {"grammar": SUM_GRAMMAR}}},
        FORMATS["grammar"],
    ),
    "vllm_json": (
        {"extra_body": {"structured_outputs": {"json": PERSON_SCHEMA}}},
        FORMATS["json_schema"],
    ),
}


def _call(
    oai: OpenAI,
    chat: bool,
    stream: bool,
    prompt: list[int],
    fields: dict,
    temperature: float,
    seed: int,
) -> tuple[str, str, list[int] | None]:
    """(text, finish_reason, token ids when not streamed) of one request."""
    fields = {**fields}
    extra = {**fields.pop("extra_body", {}), "return_token_ids": True}
    if not chat and "response_format" in fields:  # not in the client's completions signature
        extra["response_format"] = fields.pop("response_format")
    common = dict(
        model=MODEL, max_tokens=512, temperature=temperature, seed=seed, extra_body=extra, **fields
    )
    if chat:
        messages = [{"role": "user", "content": " ".join(str(t) for t in prompt)}]
        if stream:
            chunks = list(oai.chat.completions.create(messages=messages, stream=True, **common))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reason = next(c.choices[0].finish_reason for c in chunks[::-1] if c.choices)
            return text, reason, None
        r = oai.chat.completions.create(messages=messages, **common)
        return r.choices[0].message.content, r.choices[0].finish_reason, None
    if stream:
        chunks = list(oai.completions.create(prompt=prompt, stream=True, **common))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        reason = next(c.choices[0].finish_reason for c in chunks[::-1] if c.choices)
        return text, reason, None
    r = oai.completions.create(prompt=prompt, **common)
    return r.choices[0].text, r.choices[0].finish_reason, r.choices[0].model_extra["token_ids"]


def test_openai_client_outputs_follow_their_formats(
    up: Up, oracle: SerialOracle, book: GrammarBook
) -> None:
    oai = OpenAI(base_url=f"{up.http_url}/v1", api_key="not-needed", max_retries=0)
    rng = random.Random(21)
    names = list(_HTTP_FORMATS)
    compared = 0
    for i in range(10):
        name = names[i % len(names)]
        fields, (kind, spec) = _HTTP_FORMATS[name]
        chat, stream, greedy = bool(i & 1), bool(i & 2), not i & 4
        prompt = [rng.randrange(1, 509) for _ in range(rng.randrange(2, 16))]
        temperature, seed = (0.0 if greedy else 1.0), 500 + i
        text, reason, ids = _call(oai, chat, stream, prompt, fields, temperature, seed)
        label = (name, chat, stream, greedy, text)
        assert reason == "stop", label
        assert_follows(kind, spec, text)
        if ids is not None and greedy:  # completions of token ids: the oracle's prompt
            params = SamplingParams(
                max_tokens=512, temperature=0.0, seed=seed,
                structured_output=StructuredOutput(kind=kind, spec=spec),
            )  # fmt: skip
            sampler = MaskedSampler(book.compile(params.structured_output).result(), VOCAB, params)
            expected = oracle.generate(prompt, max_tokens=512, sampler=sampler)
            if min(sampler.gaps) > 1e-5:
                assert ids == expected.token_ids, label
                compared += 1
    assert compared
    # any JSON object: complete ones parse; a random model may run it to max_tokens
    r = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "an object"}],
        response_format={"type": "json_object"},
        max_tokens=64,
        temperature=0,
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_a_format_that_does_not_compile_is_a_400_naming_the_problem(up: Up) -> None:
    oai = OpenAI(base_url=f"{up.http_url}/v1", api_key="not-needed", max_retries=0)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            oai.completions.create(
                model=MODEL,
                prompt=[1, 2, 3],
                max_tokens=4,
                stream=stream,
                extra_body={"structured_outputs": {"regex": "a(b"}},
            )
        assert "unclosed group" in err.value.message
    for schema, problem in [
        ({"type": "strin"}, "Invalid type: strin"),
        # a keyword the engine does not enforce is refused by name, never ignored
        ({"type": "array", "uniqueItems": True}, 'Unimplemented keys: ["uniqueItems"]'),
        # nested past what an engine converts in bounded time
        (json.loads('{"items": ' * 150 + "{}" + "}" * 150), "nested 151 levels"),
    ]:
        with pytest.raises(openai.BadRequestError) as err:
            oai.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": schema},
                },
            )
        assert problem in err.value.message


async def test_worker_killed_mid_stream_rebuilds_each_grammar(
    toy_checkpoint: Path, toy_model: OuroModel, oracle: SerialOracle, codec, book, tmp_path: Path
) -> None:
    rng = random.Random(31)
    cases: list[tuple[list[int], SamplingParams]] = []
    for i in range(6):
        kind, spec = FORMATS[["json_schema", "grammar", "json_schema", "regex"][i % 4]]
        # one request names the other engine: its replacement worker must compile it alike
        backend = "xgrammar" if i == 2 else None
        prompt = [rng.randrange(1, 509) for _ in range(rng.randrange(3, 14))]
        params = SamplingParams(
            max_tokens=512,
            temperature=0.0,
            seed=i,
            min_loops=1,
            exit_threshold=0.7 if i % 2 else 1.0,
            structured_output=StructuredOutput(kind=kind, spec=spec, backend=backend),
        )
        cases.append((prompt, params))
    with (
        NatsServer(port=free_port()) as server,
        service_procs(server.url, toy_checkpoint, tmp_path, ENGINE_ARGS, ENV) as procs,
    ):
        await procs.start_all()
        async with client(server.url) as nc:
            col = await StreamCollector(nc).start()
            # a format that does not compile: admission's clear error, before any routing
            bad = GenerateRequest(
                request_id="bad",
                prompt_token_ids=[1, 2],
                structured_output=StructuredOutput(kind="grammar", spec="root ::= x"),
            )
            await col.send(99, bad)
            for i, (ids, p) in enumerate(cases):
                request = GenerateRequest(
                    request_id=f"kill-{i}", prompt_token_ids=ids, **_fields(p)
                )
                await col.send(i, request)
            idx = list(range(len(cases)))
            await wait_for(lambda: all(len(col.tokens(i)) >= 3 for i in idx), 120, "tokens")
            procs.kill("worker")  # SIGKILL
            mid_stream = [i for i in idx if not col.terminals(i)]
            replacement = procs.start("worker", key="worker-2")
            await procs.wait_ready(replacement)
            await col.wait_done([*idx, 99], 120)
            h = await health(nc, "scheduler")
            assert h["worker_losses"] >= 1, h
            await wait_for(lambda: kv_reclaimed(nc), 10, "KV reclaimed")
    (error,) = col.terminals(99)
    assert isinstance(error, ErrorEvent) and error.code == "invalid_request", error
    assert "Rule 'x' not found" in error.message
    assert mid_stream, "nothing was mid-generation when the worker died"
    engine = LLMEngine(toy_model, engine_config(), codec=codec)
    expected = engine.generate([ids for ids, _ in cases], [p for _, p in cases])
    for i, (_, p) in enumerate(cases):
        (done,) = col.terminals(i)
        assert isinstance(done, FinishedEvent), done
        assert [t.index for t in col.tokens(i)] == list(range(len(done.token_ids)))
        assert (done.token_ids, done.exit_depths) == (
            expected[i].token_ids,
            expected[i].exit_depths,
        )
        assert done.finish_reason == "stop", (i, done.text)
        assert p.structured_output is not None
        assert_follows(
            p.structured_output.kind, p.structured_output.spec, codec.decode(done.token_ids)
        )
    for i in (0, 1):
        ids, p = cases[i]
        assert p.structured_output is not None
        sampler = MaskedSampler(book.compile(p.structured_output).result(), VOCAB, p)
        ref = oracle.generate(
            ids, max_tokens=p.max_tokens, min_loops=p.min_loops,
            exit_threshold=p.exit_threshold, sampler=sampler,
        )  # fmt: skip
        if min(sampler.gaps) > 1e-5:
            (done,) = col.terminals(i)
            assert (done.token_ids, done.exit_depths) == (ref.token_ids, ref.exit_depths)


def _fields(p: SamplingParams) -> dict:
    return {
        "max_tokens": p.max_tokens,
        "temperature": p.temperature,
        "seed": p.seed,
        "min_loops": p.min_loops,
        "exit_threshold": p.exit_threshold,
        "structured_output": p.structured_output,
    }
