"""The gateway's pure parts: OpenAI request translation, string stops on a detokenized
stream, the answer/usage built from stream events, SSE framing, W3C traceparent parsing,
and the merge of every instance's metrics into one scrape. No NATS, no HTTP."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from messages.api import ErrorEvent, FinishedEvent, TokenEvent, TokenLogprobs, TopLogprob
from services.gateway.errors import ApiError
from services.gateway.metrics import ClusterMetrics
from services.gateway.protocol import (
    MAX_STOP_CHARS,
    MAX_STOPS,
    ChatRequest,
    CompletionRequest,
    StreamOptions,
    parse_chat,
    parse_completion,
)
from services.gateway.stops import StopMatcher
from services.gateway.stream import DONE_FRAME, Answer, SseEncoder
from services.gateway.translate import Options, choice_requests, options, to_generate
from services.runtime import tracing
from services.runtime.bus import encode_json
from services.runtime.tracing import TraceContext, Tracer, parse_traceparent
from tests.gateway_helpers import json_body as _body

pytestmark = pytest.mark.unit


# ---------------------------------------------------------------------- requests
def test_completion_prompt_forms() -> None:
    assert to_generate(parse_completion(_body(prompt="hi")), "r").prompt == "hi"
    ids = to_generate(parse_completion(_body(prompt=[5, 6, 7])), "r")
    assert ids.prompt_token_ids == [5, 6, 7] and ids.prompt is None
    # a list of one prompt, as the OpenAI API allows, is that prompt
    assert to_generate(parse_completion(_body(prompt=[[5, 6]])), "r").prompt_token_ids == [5, 6]
    assert to_generate(parse_completion(_body(prompt=["a b"])), "r").prompt == "a b"
    for bad in (["a", "b"], [[1], [2]], [], None, 3, [1, "x"], [True, 2]):
        with pytest.raises(ApiError) as err:
            parse_completion(_body(prompt=bad))
        assert err.value.status == 400 and err.value.param == "prompt"


def test_fields_reach_the_nats_request_and_unset_ones_stay_unset() -> None:
    req = parse_completion(
        _body(
            prompt="x",
            max_tokens=7,
            temperature=0,
            top_p=0.5,
            seed=3,
            top_k=4,
            ignore_eos=True,
            stop_token_ids=[9],
            min_loops=1,
            max_loops=3,
            exit_threshold=0.7,
            priority=2,
            user="someone",  # accepted and ignored
            unknown_field=1,  # ignored, as OpenAI-compatible servers do
        )
    )
    gen = to_generate(req, "cmpl-1")
    assert (gen.request_id, gen.max_tokens, gen.temperature, gen.top_p, gen.seed) == (
        "cmpl-1",
        7,
        0.0,
        0.5,
        3,
    )
    assert (gen.top_k, gen.ignore_eos, gen.stop_token_ids, gen.priority) == (4, True, [9], 2)
    assert (gen.min_loops, gen.max_loops, gen.exit_threshold) == (1, 3, 0.7)
    bare = to_generate(parse_completion(_body(prompt="x")), "r")
    # the checkpoint's defaults apply in admission (ModelLimits.resolve)
    assert bare.max_tokens is None and bare.temperature is None and bare.min_loops == 2


def test_chat_translation() -> None:
    req = parse_chat(
        _body(
            messages=[
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            ],
            max_tokens=5,
            max_completion_tokens=9,
            chat_template_kwargs={"enable_thinking": False},
        )
    )
    gen = to_generate(req, "chatcmpl-1")
    assert gen.max_tokens == 9  # max_completion_tokens is the newer name and wins
    assert gen.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},  # parts one per line, as vLLM joins them
    ]
    assert gen.chat_template_kwargs == {"enable_thinking": False}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"best_of": 3}, "best_of"),
        ({"n": 2, "best_of": 3}, "best_of"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stop": ""}, "stop"),
        ({"stop": ["a", ""]}, "stop"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"suffix": "x"}, "suffix"),
        ({"response_format": {"type": "structural_tag"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {}}},
            "response_format.json_schema.schema",
        ),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"parallel_tool_calls": False}, "parallel_tool_calls"),
        (
            {"stream": True, "stream_options": {"include_obfuscation": True}},
            "stream_options.include_obfuscation",
        ),
        ({"guided_regex": "a+"}, "guided_regex"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"presence_penalty": True}, "presence_penalty"),  # a boolean is not the number 0
        ({"min_tokens": 50}, "min_tokens"),
        ({"guided_json": {"type": "object"}}, "guided_json"),
        ({"guided_choice": ["a", "b"]}, "guided_choice"),
        (
            {"structured_outputs": {"regex": "a+", "whitespace_pattern": " "}},
            "structured_outputs.whitespace_pattern",
        ),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"skip_special_tokens": False}, "skip_special_tokens"),
    ],
)
def test_unsupported_completion_options_are_refused_by_name(
    fields: dict[str, object], param: str
) -> None:
    with pytest.raises(ApiError) as err:
        parse_completion(_body(prompt="x", **fields))
    assert err.value.status == 400
    assert err.value.param == param
    assert err.value.body()["error"]["param"] == param


@pytest.mark.parametrize(
    "fields",
    [
        {"top_logprobs": 2},  # without logprobs: true
        {"logprobs": True, "top_logprobs": 21},
        {"echo": True},  # vLLM's chat echo
        {"logprobs": False, "top_logprobs": 2},
        {"tools": [{"type": "code_interpreter"}]},  # function tools only
        {"tool_choice": "required"},  # without tools
        {"functions": [{"name": "f", "parameters": {}}], "function_call": "auto"},
        {"response_format": {"type": "structural_tag"}},
        {"messages": []},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
        {"messages": [{"content": "no role"}]},
        {"modalities": ["text", "audio"]},
        {"service_tier": "flex"},
        {"store": True},
    ],
)
def test_unsupported_chat_options_are_refused(fields: dict[str, object]) -> None:
    """(The param each names is checked for the completions endpoint above, and for every
    field by the table of docs/gateway.md below.)"""
    base = {"messages": [{"role": "user", "content": "hi"}], **fields}
    with pytest.raises(ApiError) as err:
        parse_chat(_body(**base))
    assert err.value.status == 400


def test_a_non_text_content_part_is_refused_by_its_type() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(ApiError) as err:
        parse_chat(_body(messages=[{"role": "user", "content": [image]}]))
    assert "'image_url'" in err.value.message and err.value.param == "messages"


# the values of a refused field that ask for nothing beyond what rlt does: accepted, and the
# request is the same as without them (as are the ignored fields)
_HARMLESS: dict[str, Any] = {
    "logit_bias": {},
    "presence_penalty": 0,
    "frequency_penalty": 0.0,
    "tools": [],
    "tool_choice": "none",
    "response_format": {"type": "text"},
    "repetition_penalty": 1.0,
    "min_tokens": 0,
    "skip_special_tokens": True,
    "use_beam_search": False,
    "user": "someone",
}
_HARMLESS_CHAT: dict[str, Any] = {
    "modalities": ["text"],
    "service_tier": "auto",
    "store": False,
    "echo": False,
    "add_generation_prompt": True,
    "metadata": {"team": "a"},
    "prompt_cache_key": "k",
    "safety_identifier": "s",
}


def test_harmless_values_of_refused_fields_change_nothing() -> None:
    plain = to_generate(parse_completion(_body(prompt="x")), "r")
    full = to_generate(parse_completion(_body(prompt="x", suffix="", **_HARMLESS)), "r")
    assert encode_json(full) == encode_json(plain)
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    plain = to_generate(parse_chat(_body(**chat)), "r")
    full = to_generate(parse_chat(_body(**chat, **_HARMLESS, **_HARMLESS_CHAT)), "r")
    assert encode_json(full) == encode_json(plain)
    streamed = {"stream": True, "stream_options": {"include_usage": True,
                "continuous_usage_stats": False, "include_obfuscation": False}}  # fmt: skip
    assert options(parse_chat(_body(**chat, **streamed))).include_usage


def _field_table() -> list[tuple[str, str, str]]:
    """docs/gateway.md's table of request fields: (field, completions, chat)."""
    text = (Path(__file__).parents[1] / "docs" / "gateway.md").read_text()
    rows = re.findall(r"^\| `([a-z_.]+)` \| (\S+) \| (\S+) \|", text, re.MULTILINE)
    assert len(rows) > 60, "the table of request fields is gone from docs/gateway.md"
    return rows


_REQUESTS = {
    "completions": (parse_completion, CompletionRequest, {"prompt": "hi"}),
    "chat": (parse_chat, ChatRequest, {"messages": [{"role": "user", "content": "hi"}]}),
}


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_the_documented_table_of_fields_is_what_the_gateway_does(endpoint: str) -> None:
    """Every field the table says is refused is refused by name; every one it says is
    honoured is read; every one it says is ignored (or is not the endpoint's) changes
    nothing."""
    parse, struct, base = _REQUESTS[endpoint]
    declared = set(struct.__struct_fields__) | {
        f"stream_options.{name}" for name in StreamOptions.__struct_fields__
    }
    plain = encode_json(to_generate(parse(_body(**base)), "r"))
    for field, *verdicts in _field_table():
        verdict = verdicts[0 if endpoint == "completions" else 1]
        if verdict == "honoured":
            assert field in declared, field
            continue
        if "." in field:  # stream_options' own fields
            outer, inner = field.split(".")
            fields: dict[str, Any] = {"stream": True, outer: {inner: True}}
        else:
            fields = {field: {"not": "harmless"}}
        if verdict == "refused":
            with pytest.raises(ApiError) as err:
                parse(_body(**base, **fields))
            assert (err.value.status, err.value.param) == (400, field), field
        else:
            assert verdict in ("ignored", "-"), (field, verdict)
            sample = {field: "x"} if "." not in field else {}
            req = parse(_body(**base, **sample))
            assert encode_json(to_generate(req, "r")) == plain, field


def test_deeply_nested_json_is_a_400_as_on_the_nats_api() -> None:
    deep = b"[" * 5000 + b"]" * 5000
    for body in (
        b'{"prompt": ' + deep + b"}",
        b'{"messages": [{"role": "user", "content": "x", "extra": ' + deep + b"}]}",
        b'{"unknown": ' + deep + b"}",
        deep,
    ):
        for parse in (parse_completion, parse_chat):
            with pytest.raises(ApiError) as err:
                parse(body)
            assert err.value.status == 400
    with pytest.raises(ApiError) as err:
        parse_completion(b'{"prompt": ' + deep + b"}")
    assert err.value.message == "invalid JSON: nested too deeply"


def test_an_echo_of_token_ids_beyond_any_vocabulary_is_a_400() -> None:
    def decode(ids: list[int]) -> str:  # as the tokenizers library does past 32 bits
        if any(i >= 2**32 for i in ids):
            raise OverflowError("number too large to fit in target type")
        return "text"

    with pytest.raises(ApiError) as err:
        options(parse_completion(_body(prompt=[2**40], echo=True)), decode)
    assert (err.value.status, err.value.param) == (400, "prompt")


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
_FIELD_NAMES = st.sampled_from(
    sorted(set(ChatRequest.__struct_fields__) | set(CompletionRequest.__struct_fields__))
)


@settings(max_examples=400, deadline=None)
@given(
    fields=st.dictionaries(_FIELD_NAMES, _JSON_VALUES, max_size=5),
    chat=st.booleans(),
    raw=st.binary(max_size=40),
)
def test_any_body_is_an_api_error_or_a_request_that_can_be_sent(
    fields: dict[str, Any], chat: bool, raw: bytes
) -> None:
    """Whatever the body (known fields of any JSON value, or bytes), parsing ends in an
    ApiError (a 4xx) or a request the shell can encode and send: never another exception
    (a 500)."""
    base = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    parse = parse_chat if chat else parse_completion
    for body in (json.dumps({**base, **fields}).encode(), raw):
        try:
            req = parse(body)
            opts = options(req, lambda ids: "text")
            requests = choice_requests(to_generate(req, "r"), req.n or 1)
        except ApiError as exc:
            assert 400 <= exc.status < 500
            continue
        assert opts.stream in (True, False)
        for request in requests:
            encode_json(request)


def test_stop_strings_are_bounded() -> None:
    base = {"prompt": "x"}
    parse_completion(_body(**base, stop=["s"] * MAX_STOPS))
    for stop in (["s"] * (MAX_STOPS + 1), ["y" * (MAX_STOP_CHARS + 1)]):
        with pytest.raises(ApiError) as err:
            parse_completion(_body(**base, stop=stop))
        assert err.value.status == 400 and err.value.param == "stop"


def test_bad_json_and_wrong_types_are_400() -> None:
    for body in (b"{not json", b'{"model": "toy", "prompt": "x", "max_tokens": "many"}'):
        with pytest.raises(ApiError) as err:
            parse_completion(body)
        assert err.value.status == 400


def test_error_codes_map_to_http_statuses() -> None:
    cases = {
        "invalid_request": (400, {}),
        "not_found": (404, {}),
        "overloaded": (429, {"Retry-After": "1"}),
        "unavailable": (503, {"Retry-After": "1"}),
        "timeout": (504, {}),
        "internal": (500, {}),
    }
    for code, (status, headers) in cases.items():
        exc = ApiError("m", code)
        assert (exc.status, exc.headers()) == (status, headers), code
        assert exc.body() == {
            "error": {
                "message": "m",
                "type": exc.body()["error"]["type"],
                "param": None,
                "code": code,
            }
        }


# ---------------------------------------------------------------------- string stops
def test_stop_string_split_across_deltas() -> None:
    m = StopMatcher(["</end>"])
    assert m.push("hello </") == "hello "  # "</" may start the stop: held
    assert m.push("en") == ""
    assert m.push("d> more") == ""
    assert m.matched == "</end>"
    assert m.push("anything") == "" and m.flush() == ""


def test_held_text_is_released_when_it_is_not_a_stop() -> None:
    m = StopMatcher(["abc"])
    assert m.push("xab") == "x"
    assert m.push("d") == "abd"
    assert m.push("a") == ""
    assert m.flush() == "a"
    assert m.matched is None


def test_include_stop_str_and_the_earliest_stop_wins() -> None:
    m = StopMatcher(["cd", "b"], include_stop_str=True)
    assert m.push("abcd") == "ab"
    assert m.matched == "b"


def _reference(deltas: list[str], stops: list[str]) -> str:
    """What OpenAI's rule shows: after each delta, the text so far is checked; the first
    delta that completes a stop ends the text just before that stop's earliest start."""
    text = ""
    for delta in deltas:
        text += delta
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return text[: min(hits)]
    return text


@settings(max_examples=300, deadline=None)
@given(
    deltas=st.lists(st.text(alphabet="abc ", max_size=4), max_size=12),
    stops=st.lists(st.text(alphabet="abc ", min_size=1, max_size=3), min_size=1, max_size=3),
)
def test_stop_matcher_equals_the_reference(deltas: list[str], stops: list[str]) -> None:
    m = StopMatcher(stops)
    shown = ""
    for delta in deltas:
        out = m.push(delta)
        shown += out
        assert not any(s in shown for s in stops)  # a stop string is never shown
    shown += m.flush()
    assert shown == _reference(deltas, stops)


# ---------------------------------------------------------------------- answers
def _opts(**kw: object) -> Options:
    base = {
        "stream": True,
        "include_usage": True,
        "stops": (),
        "include_stop_str": False,
        "return_token_ids": True,
    }
    return Options(**{**base, **kw})  # type: ignore[arg-type]


def _tok(i: int, text: str, depth: int = 4) -> TokenEvent:
    return TokenEvent(request_id="r", index=i, token_id=100 + i, exit_depth=depth, text=text)


def _fin(n: int, reason: str = "length", text: str = "") -> FinishedEvent:
    return FinishedEvent(
        request_id="r",
        finish_reason=reason,
        token_ids=[100 + i for i in range(n)],
        exit_depths=[4] * n,
        num_prompt_tokens=7,
        num_cached_tokens=4,
        text=text,
        prefill_rows=12,
        draft_tokens=5,
        accepted_draft_tokens=3,
    )


def test_answer_counts_usage_with_loop_extensions() -> None:
    a = Answer("r", _opts())
    for i, (text, depth) in enumerate([("a", 2), ("b", 3), ("c", 4)]):
        a.on_event(_tok(i, text, depth))
    a.on_event(_fin(3, "length", "abc"))
    assert (a.text, a.finish_reason, a.token_ids) == ("abc", "length", [100, 101, 102])
    assert a.usage().body() == {
        "prompt_tokens": 7,
        "completion_tokens": 3,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 4},
        "mean_exit_depth": 3.0,
        "core_loops": 9,
        "shed_tokens": 0,
        "prefill_rows": 12,  # the prompt's rows as the engine computed them
        # drafts of self-speculative decoding, in OpenAI's predicted-output names
        "completion_tokens_details": {
            "accepted_prediction_tokens": 3,
            "rejected_prediction_tokens": 2,
        },
    }
    body = a.body(chat=True, model="toy", created=1)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "abc"}
    assert body["choices"][0]["token_ids"] == [100, 101, 102]


def test_a_stop_string_ends_the_answer_and_asks_for_an_abort() -> None:
    a = Answer("r", _opts(stops=("END",)))
    a.on_event(_tok(0, "one E"))
    assert not a.needs_abort
    deltas = a.on_event(_tok(1, "ND two"))
    assert deltas[-1].finish_reason == "stop" and a.needs_abort
    assert a.text == "one "
    assert a.on_event(_tok(2, "ignored")) == []  # the engine ran on: not shown, not counted
    a.on_event(_fin(3, "abort"))
    assert not a.needs_abort and a.finish_reason == "stop"
    assert a.usage().body()["completion_tokens"] == 2  # up to the token that made the stop
    assert a.usage().body()["prompt_tokens"] == 7


def test_an_error_is_kept_unless_a_stop_string_ended_the_answer_first() -> None:
    a = Answer("r", _opts())
    a.on_event(ErrorEvent(request_id="r", code="overloaded", message="busy"))
    assert a.error is not None and a.done
    b = Answer("r", _opts(stops=("x",)))
    b.on_event(_tok(0, "x"))
    b.on_event(ErrorEvent(request_id="r", code="internal", message="late"))
    assert b.error is None and b.finish_reason == "stop"


def _frames(data: bytes) -> list[dict]:
    parts = [p for p in data.split(b"\n\n") if p]
    assert all(p.startswith(b"data: ") for p in parts)
    return [json.loads(p[6:]) for p in parts if p != b"data: [DONE]"]


def test_sse_frames_for_chat_and_completions() -> None:
    a = Answer("r", _opts())
    chat = SseEncoder(True, "r", "toy", 1, a.options)
    out = chat.deltas(a.on_event(_tok(0, "")))  # text held by the detokenizer
    out += chat.deltas(a.on_event(_tok(1, "hé")))
    out += chat.deltas(a.on_event(_fin(2, "stop", "hé")))
    frames = _frames(out)
    assert frames[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert frames[1]["choices"][0]["delta"] == {"content": "hé"}
    # the held token goes out with the next frame that shows text
    assert frames[1]["choices"][0]["token_ids"] == [100, 101]
    assert frames[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(f["object"] == "chat.completion.chunk" and f["usage"] is None for f in frames)
    usage = _frames(chat.usage(a.usage()))[0]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 2

    b = Answer("r", _opts(include_usage=False, return_token_ids=False))
    comp = SseEncoder(False, "r", "toy", 1, b.options)
    frames = _frames(comp.deltas(b.on_event(_tok(0, "x"))) + DONE_FRAME)
    assert frames == [
        {
            "id": "r",
            "object": "text_completion",
            "created": 1,
            "model": "toy",
            "choices": [{"index": 0, "text": "x", "logprobs": None, "finish_reason": None}],
        }
    ]


def _lp_tok(i: int, text: str, token: str, logprob: float, top: list[tuple[str, float]]):
    event = _tok(i, text)
    event.logprobs = TokenLogprobs(
        token_id=event.token_id,
        logprob=logprob,
        token=token,
        top_logprobs=[TopLogprob(token_id=j, logprob=v, token=t) for j, (t, v) in enumerate(top)],
    )
    return event


def test_logprobs_requests_reach_the_nats_api() -> None:
    comp = parse_completion(_body(prompt="x", logprobs=3))
    assert options(comp).logprobs == 3 and to_generate(comp, "r").logprobs == 3
    chat = parse_chat(_body(messages=[{"role": "user", "content": "x"}], logprobs=True))
    assert options(chat).logprobs == 0 and to_generate(chat, "r").logprobs == 0
    chat = parse_chat(
        _body(messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=4)
    )
    assert options(chat).logprobs == 4 and to_generate(chat, "r").logprobs == 4
    plain = parse_completion(_body(prompt="x"))
    assert options(plain).logprobs is None and to_generate(plain, "r").logprobs is None
    plain = parse_chat(_body(messages=[{"role": "user", "content": "x"}], logprobs=False))
    assert to_generate(plain, "r").logprobs is None


def test_logprobs_in_openais_two_shapes() -> None:
    events = [
        _lp_tok(0, "", "\ufffd", -0.5, [("\ufffd", -0.5), ("b", -1.5)]),  # text held back
        _lp_tok(1, "hé", "é", -0.25, [("é", -0.25), ("x", -2.0)]),
        _lp_tok(2, " a", " a", -3.0, [("z", -0.1), ("y", -0.2)]),  # sampled, not in the top
    ]
    comp = Answer("r", _opts(logprobs=2, stream=False))
    for e in events:
        comp.on_event(e)
    comp.on_event(_fin(3, "length"))
    body = comp.body(chat=False, model="toy", created=1)["choices"][0]["logprobs"]
    assert body == {
        "tokens": ["\ufffd", "é", " a"],
        "token_logprobs": [-0.5, -0.25, -3.0],
        # the token itself is always in its map (up to logprobs + 1 entries)
        "top_logprobs": [
            {"\ufffd": -0.5, "b": -1.5},
            {"é": -0.25, "x": -2.0},
            {"z": -0.1, "y": -0.2, " a": -3.0},
        ],
        "text_offset": [0, 1, 2],  # where each starts in the tokens' own texts joined
    }
    chat = Answer("r", _opts(logprobs=2, stream=False))
    for e in events:
        chat.on_event(e)
    content = chat.body(chat=True, model="toy", created=1)["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["\ufffd", "é", " a"]
    assert content[1] == {
        "token": "é",
        "logprob": -0.25,
        "bytes": [0xC3, 0xA9],
        "top_logprobs": [
            {"token": "é", "logprob": -0.25, "bytes": [0xC3, 0xA9]},
            {"token": "x", "logprob": -2.0, "bytes": [0x78]},
        ],
    }
    # asked for none: null, as OpenAI answers
    none = Answer("r", _opts(stream=False))
    none.on_event(events[0])
    assert none.body(chat=True, model="toy", created=1)["choices"][0]["logprobs"] is None
    # a shard that computed none (an older worker): each token is still listed, unknown
    old = Answer("r", _opts(logprobs=2, stream=False))
    old.on_event(_tok(0, "x"))
    old.on_event(events[1])
    body = json.loads(msgspec.json.encode(old.body(chat=False, model="toy", created=1)))
    assert body["choices"][0]["logprobs"]["tokens"] == ["x", "é"]
    assert body["choices"][0]["logprobs"]["token_logprobs"] == [None, -0.25]


def _prompt_entries() -> list[TokenLogprobs]:
    return [
        TokenLogprobs(token_id=7, logprob=None, token="Hi"),
        TokenLogprobs(
            token_id=8,
            logprob=-2.0,
            token=" there",
            top_logprobs=[
                TopLogprob(token_id=9, logprob=-0.5, token="!"),
                TopLogprob(token_id=8, logprob=-2.0, token=" there"),
            ],
        ),
    ]


def test_echo_and_prompt_logprobs_reach_the_engine() -> None:
    echo = parse_completion(_body(prompt="Hi there", echo=True, logprobs=1))
    assert options(echo).echo_text == "Hi there"
    assert to_generate(echo, "r").prompt_logprobs == 1  # the prompt's, for the echo
    listed = parse_completion(_body(prompt=["Hi there"], echo=True))
    assert options(listed).echo_text == "Hi there"
    # an echo without logprobs costs the engine nothing: token ids are decoded here
    ids = parse_completion(_body(prompt=[7, 8], echo=True))
    assert options(ids, decode=lambda t: f"<{t}>").echo_text == "<[7, 8]>"
    assert to_generate(ids, "r").prompt_logprobs is None
    with pytest.raises(ApiError) as err:  # no tokenizer to decode them with
        options(ids)
    assert err.value.param == "echo"
    assert options(parse_completion(_body(prompt="x"))).echo_text is None
    both = parse_completion(_body(prompt="x", echo=True, logprobs=1, prompt_logprobs=3))
    assert to_generate(both, "r").prompt_logprobs == 3
    chat = parse_chat(_body(messages=[{"role": "user", "content": "x"}], prompt_logprobs=2))
    assert options(chat).prompt_logprobs == 2 and to_generate(chat, "r").prompt_logprobs == 2
    plain = parse_completion(_body(prompt="x", logprobs=2))
    assert to_generate(plain, "r").prompt_logprobs is None


def test_an_echo_puts_the_prompt_first() -> None:
    first = _lp_tok(0, " you", " you", -0.1, [(" you", -0.1)])
    first.prompt_logprobs = _prompt_entries()
    a = Answer("r", _opts(stream=False, echo_text="Hi there", logprobs=1))
    a.on_event(first)
    a.on_event(_fin(1, "length"))
    choice = a.body(chat=False, model="toy", created=1)["choices"][0]
    assert choice["text"] == "Hi there you"
    assert choice["logprobs"] == {
        "tokens": ["Hi", " there", " you"],
        "token_logprobs": [None, -2.0, -0.1],
        # nothing predicts the first prompt token; then at most logprobs alternatives + itself
        "top_logprobs": [None, {"!": -0.5, " there": -2.0}, {" you": -0.1}],
        "text_offset": [0, 2, 8],
    }
    # the request's own text is echoed as it was sent; a stop string never matches it
    b = Answer("r", _opts(stream=False, echo_text="Hi  there", stops=("there",)))
    b.on_event(first)
    assert b.text == "Hi  there you" and b.finish_reason is None


def test_vllm_prompt_logprobs_come_with_the_first_frame() -> None:
    first = _lp_tok(0, "!", "!", -0.1, [])
    first.prompt_logprobs = _prompt_entries()
    best = {"logprob": -0.5, "decoded_token": "!"}
    own = {"logprob": -2.0, "decoded_token": " there"}
    a = Answer("r", _opts(stream=False, prompt_logprobs=1))
    a.on_event(first)
    # one alternative asked for: the best, and the prompt token itself; where vLLM puts
    # them: in a completion's choice, in a chat response itself
    assert a.body(chat=False, model="toy", created=1)["choices"][0]["prompt_logprobs"] == [
        None,
        {"9": best, "8": own},
    ]
    chat = a.body(chat=True, model="toy", created=1)
    assert chat["prompt_logprobs"] == [None, {"9": best, "8": own}]
    assert "prompt_logprobs" not in chat["choices"][0]
    for is_chat in (False, True):
        s = Answer("r", _opts(prompt_logprobs=0, return_token_ids=False))
        enc = SseEncoder(is_chat, "r", "toy", 1, s.options)
        out = enc.deltas(s.on_event(first)) + enc.deltas(s.on_event(_tok(1, "?")))
        frames = _frames(out)[1:] if is_chat else _frames(out)  # (chat: the role chunk)
        where = frames[0] if is_chat else frames[0]["choices"][0]
        assert where["prompt_logprobs"] == [None, {"8": own}]
        assert all("prompt_logprobs" not in f and "prompt_logprobs" not in f["choices"][0]
                   for f in frames[1:])  # fmt: skip


def test_streamed_logprobs_ride_with_their_tokens_text() -> None:
    a = Answer("r", _opts(logprobs=1, return_token_ids=False))
    enc = SseEncoder(False, "r", "toy", 1, a.options)
    out = enc.deltas(a.on_event(_lp_tok(0, "", "\ufffd", -0.5, [("\ufffd", -0.5)])))
    out += enc.deltas(a.on_event(_lp_tok(1, "hé", "é", -0.25, [("é", -0.25)])))
    out += enc.deltas(a.on_event(_lp_tok(2, "!", "!", -1.0, [("?", -0.5)])))
    out += enc.deltas(a.on_event(_fin(3, "length")))
    frames = [f["choices"][0] for f in _frames(out)]
    assert [f["text"] for f in frames] == ["hé", "!", ""]
    # the held-back token's log-probability goes out with the frame that shows its text
    assert frames[0]["logprobs"]["tokens"] == ["\ufffd", "é"]
    assert frames[0]["logprobs"]["text_offset"] == [0, 1]
    assert frames[1]["logprobs"]["tokens"] == ["!"]
    assert frames[1]["logprobs"]["text_offset"] == [2]
    assert frames[1]["logprobs"]["top_logprobs"] == [{"?": -0.5, "!": -1.0}]
    assert frames[2]["logprobs"] is None and frames[2]["finish_reason"] == "length"

    c = Answer("r", _opts(logprobs=0, return_token_ids=False))
    chat = SseEncoder(True, "r", "toy", 1, c.options)
    frames = _frames(chat.deltas(c.on_event(_lp_tok(0, "é", "é", -0.25, []))))
    assert frames[0]["choices"][0]["logprobs"] is None  # the role chunk
    assert frames[1]["choices"][0]["logprobs"] == {
        "content": [{"token": "é", "logprob": -0.25, "bytes": [0xC3, 0xA9], "top_logprobs": []}],
        "refusal": None,
    }


def test_options_from_requests() -> None:
    o = options(parse_completion(_body(prompt="x", stop="a", stream=True)))
    assert o.stops == ("a",) and o.stream and not o.include_usage
    o = options(parse_chat(_body(messages=[{"role": "user", "content": "x"}], stop=["a", "b"])))
    assert o.stops == ("a", "b") and not o.stream


# ---------------------------------------------------------------------- tracing
def test_traceparent_parsing() -> None:
    good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    ctx = parse_traceparent(good)
    assert ctx == TraceContext("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", True)
    assert ctx.traceparent == good
    assert parse_traceparent(good[:-2] + "00").sampled is False  # type: ignore[union-attr]
    # a later version may carry more fields
    assert parse_traceparent("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-xx")
    for bad in (
        None,
        "",
        "garbage",
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",  # upper case
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # zero trace id
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # zero span id
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # forbidden version
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
    ):
        assert parse_traceparent(bad) is None, bad


def test_without_an_exporter_spans_only_carry_the_context() -> None:
    tracing.uninstall_exporters()
    parent = parse_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    span = Tracer("gateway").start("x", parent)
    assert span.context == parent and not span.recording
    fresh = Tracer("gateway").start("x", None, trace_id="ab" * 16)
    assert fresh.trace_id == "ab" * 16 and len(fresh.context.span_id) == 16
    span.end()  # harmless


def test_with_an_exporter_spans_form_one_trace() -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracing.install_exporter(exporter)
    try:
        caller = parse_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
        first = Tracer("gateway").start("gateway.request", caller, attributes={"a": 1})
        second = Tracer("admission").start("admission.admit", first.context)
        second.end()
        first.end(**{"http.status_code": 200})
        spans = {s.name: s for s in exporter.get_finished_spans()}
        assert set(spans) == {"gateway.request", "admission.admit"}
        gw, adm = spans["gateway.request"], spans["admission.admit"]
        assert {format(s.context.trace_id, "032x") for s in (gw, adm)} == {caller.trace_id}
        assert format(gw.parent.span_id, "016x") == caller.span_id
        assert adm.parent.span_id == gw.context.span_id
        assert gw.resource.attributes["service.name"] == "rlt-gateway"
        assert adm.resource.attributes["service.name"] == "rlt-admission"
        assert gw.attributes["http.status_code"] == 200
    finally:
        tracing.uninstall_exporters()


# ---------------------------------------------------------------------- metrics
def _instance_text(running: int, successes: int, ttft: list[float]) -> str:
    r = CollectorRegistry()
    Gauge("rlt:num_requests_running", "running", registry=r).set(running)
    c = Counter("rlt:request_success", "ok", ["finished_reason"], registry=r)
    c.labels("length").inc(successes)
    h = Histogram("rlt:time_to_first_token_seconds", "ttft", buckets=(0.1, 1.0), registry=r)
    for v in ttft:
        h.observe(v)
    return generate_latest(r).decode()


def test_cluster_metrics_label_and_keep_every_instance() -> None:
    cluster = ClusterMetrics("toy", stale_after_s=10.0)
    now = time.monotonic()
    cluster.update("scheduler", "a", _instance_text(2, 3, [0.05, 0.5]), shard="0", now=now - 5)
    cluster.update("scheduler", "b", _instance_text(1, 4, [2.0]), shard="1", now=now)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(cluster)
    text = generate_latest(registry).decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }

    def value(name: str, instance: str, **labels: str) -> float:
        shard = {"a": "0", "b": "1"}[instance]
        key = {"service": "scheduler", "instance": instance, "shard": shard, "model_name": "toy"}
        return samples[(name, tuple(sorted({**key, **labels}.items())))]

    assert value("rlt:num_requests_running", "a") == 2
    assert value("rlt:num_requests_running", "b") == 1
    total = sum(value("rlt:request_success_total", i, finished_reason="length") for i in ("a", "b"))
    assert total == 7  # what `sum(rlt:request_success_total)` gives
    assert value("rlt:time_to_first_token_seconds_count", "a") == 2
    assert value("rlt:time_to_first_token_seconds_bucket", "b", le="1.0") == 0
    # an instance that stopped publishing goes away
    assert cluster.instances(now=now + 6) == [("scheduler", "b")]


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("include_usage", [True, False])
def test_text_frames_built_by_concatenation_equal_the_general_ones(
    chat: bool, include_usage: bool
) -> None:
    opts = _opts(include_usage=include_usage, return_token_ids=False)
    fast = SseEncoder(chat, "r", "toy", 1, opts)
    fast.deltas([])  # past the chat role frame
    text = 'quote " backslash \\ newline \n é \u2028'
    got = _frames(fast.deltas(Answer("r", opts).on_event(_tok(0, text))))
    general = SseEncoder(chat, "r", "toy", 1, opts)
    want = _frames(general._frame({"content": text} if chat else text, None))
    assert got == want
