"""Tool calling through the real services: the unchanged ``openai`` client against ``rlt
up``'s gateway on the toy model. With ``required`` and a named function every finished
answer is calls whose arguments validate, plain and streamed, parallel on and off, and the
streamed calls (concatenated) are the plain ones for the same seed; ``auto`` never returns
a malformed call; a conversation with past calls and tool results renders; what cannot be
served is a 400 naming it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from openai import OpenAI

from services.launcher import free_port
from tests.service_procs import start_rlt_up

pytestmark = pytest.mark.services

MODEL = "toy-tools"
# bounded strings and no other properties: the random model's calls end within max_tokens
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["city"],
    "additionalProperties": False,
}
LIGHT = {
    "type": "object",
    "properties": {"on": {"type": "boolean"}, "room": {"enum": ["hall", "kitchen"]}},
    "required": ["on", "room"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                      "parameters": CITY}},
    {"type": "function", "function": {"name": "set_light", "parameters": LIGHT}},
]  # fmt: skip
SCHEMAS = {"get_weather": CITY, "set_light": LIGHT}
MESSAGES: list[Any] = [{"role": "user", "content": "Is it raining in Paris? Lights on, please."}]


@pytest.fixture(scope="module")
def oai(toy_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenAI]:
    workdir = tmp_path_factory.mktemp("rlt-up-tools")
    http_port = free_port()
    cmd = [sys.executable, "-m", "services.cli", "up", "--port", str(free_port())]
    cmd += ["--http-port", str(http_port), "--checkpoint", str(toy_checkpoint)]
    cmd += ["--client-url-file", str(workdir / "client-url"), "--served-model-name", MODEL]
    env = {**os.environ, "RLT_RUN_DIR": str(workdir), "OMP_NUM_THREADS": "1"}
    proc: subprocess.Popen[str]
    proc, _ = start_rlt_up(cmd, env, workdir / "rlt-up.log", timeout_s=90)
    try:
        yield OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="x", max_retries=0)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _plain(oai: OpenAI, **fields: Any) -> tuple[str | None, list[dict], str]:
    r = oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, **fields)
    assert r.usage is not None and r.usage.completion_tokens > 0
    message = r.choices[0].message
    calls = [c.model_dump() for c in message.tool_calls or []]
    return message.content, calls, r.choices[0].finish_reason


def _streamed(oai: OpenAI, **fields: Any) -> tuple[str | None, list[dict], str]:
    chunks = list(
        oai.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, stream=True,
            stream_options={"include_usage": True}, **fields,
        )
    )  # fmt: skip
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    content, calls, reason = "", {}, ""
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reason = choice.finish_reason or reason
            for piece in choice.delta.tool_calls or []:
                call = calls.setdefault(
                    piece.index, {"id": None, "type": "function",
                                  "function": {"name": None, "arguments": ""}}
                )  # fmt: skip
                if piece.id is not None:
                    call["id"] = piece.id
                    call["function"]["name"] = piece.function.name
                call["function"]["arguments"] += piece.function.arguments or ""
    return content or None, [calls[i] for i in sorted(calls)], reason


def _check_calls(calls: list[dict], names: set[str]) -> None:
    for call in calls:
        function = call["function"]
        assert function["name"] in names and call["id"].startswith("call_")
        jsonschema.validate(json.loads(function["arguments"]), SCHEMAS[function["name"]])


@pytest.mark.parametrize("parallel", [True, False])
def test_required_and_named_calls_validate_and_stream_as_they_answer(
    oai: OpenAI, parallel: bool
) -> None:
    """A random model rarely ends after a call when it may write another: with parallel
    calls most answers run to max_tokens, and every call but the cut last one validates."""
    named = {"type": "function", "function": {"name": "set_light"}}
    finished = 0
    for i, choice in enumerate(["required", named]):
        fields = dict(tool_choice=choice, parallel_tool_calls=parallel, max_tokens=100,
                      temperature=float(i), seed=40 + i)  # fmt: skip
        content, calls, reason = _plain(oai, **fields)
        streamed = _streamed(oai, **fields)
        # the same seed: the same calls (ids are per response)
        assert streamed[0] == content and streamed[2] == reason
        assert [{**c, "id": None} for c in streamed[1]] == [{**c, "id": None} for c in calls]
        assert content is None and calls and (parallel or len(calls) == 1)
        names = {"set_light"} if choice == named else set(SCHEMAS)
        if reason == "tool_calls":
            finished += 1
            _check_calls(calls, names)
            _check_calls(streamed[1], names)
        else:
            assert reason == "length"
            _check_calls(calls[:-1], names)
    if not parallel:  # one call, then only the end may follow
        assert finished == 2


def test_auto_returns_text_or_well_formed_calls(oai: OpenAI) -> None:
    for seed in range(3):
        content, calls, reason = _plain(oai, max_tokens=64, temperature=1.0, seed=seed)
        assert reason in ("stop", "length", "tool_calls")
        if reason == "tool_calls":
            _check_calls(calls, set(SCHEMAS))
        elif reason == "stop":
            assert not calls and isinstance(content, str)


def test_a_conversation_with_past_calls_and_results_renders(oai: OpenAI) -> None:
    history: list[Any] = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "light rain"},
    ]  # fmt: skip
    r = oai.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=8
    )
    assert r.choices[0].message.tool_calls is None and r.usage.prompt_tokens > 100


def test_what_cannot_be_served_is_a_400_naming_it(oai: OpenAI) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
        ({"response_format": {"type": "json_object"}}, "cannot be combined with tools"),
    ]
    for fields, words in cases:
        with pytest.raises(openai.BadRequestError) as err:
            _plain(oai, max_tokens=4, **fields)
        assert words in err.value.message
    unique = {"type": "object", "properties": {"ids": {"type": "array", "uniqueItems": True}}}
    bad = [TOOLS[0], {"type": "function", "function": {"name": "tag", "parameters": unique}}]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            oai.chat.completions.create(
                model=MODEL, messages=MESSAGES, tools=bad, max_tokens=4, stream=stream
            )
        assert (
            "tools[1].function.parameters (tag): structured_output (json_schema) does not "
            'compile: Unimplemented keys: ["uniqueItems"]'
        ) in err.value.message
