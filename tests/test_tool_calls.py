"""Tool calling, without services: the tool-call grammar (required, a named function, auto;
parallel or not) accepts exactly well-formed calls; the toy chat template renders tools as
transformers does and as rlt's default prompt; the template probe; the parser that reads
calls back (any chunking gives the same calls); the gateway's checks and answers; and the
in-process engine on the toy model, whose every finished call validates."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path
from typing import Any

import jsonschema
import llguidance as llg
import pytest

from messages.api import FinishedEvent, TokenEvent
from messages.errors import RequestError
from messages.sampling import SamplingParams, StructuredOutputsBackend
from services.common.config import SchedulerConfig
from services.common.structured.grammar import check_structured_output
from services.common.structured.grammar_llguidance import grammar_text
from services.common.structured.tool_format import HERMES, FunctionSpec, ToolCallSpec, ToolMode
from services.common.tokenizer import TextCodec, _compile_template
from services.common.tool_template import chat_for_template, default_chat, template_tools
from services.engine.engine import LLMEngine
from services.gateway.constrained.tool_parser import ToolCallParser
from services.gateway.errors import ApiError
from services.gateway.protocol import parse_chat, parse_completion
from services.gateway.stream import Answer, SseEncoder
from services.gateway.translate import options, to_generate
from services.worker.model.toy import CHAT_TEMPLATE
from tests.gateway_helpers import json_body, token_events

pytestmark = pytest.mark.unit

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
COUNT = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["n"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get.weather", "parameters": CITY}},
    {
        "type": "function",
        "function": {"name": "count", "description": "count", "parameters": COUNT},
    },
]
CALL_A = '<tool_call>\n{"name": "get.weather", "arguments": {"city": "Pa}r\\"is"}}\n</tool_call>'
CALL_B = '<tool_call>\n{"name": "count", "arguments": {"n": 3}}\n</tool_call>'
# Ouro's ChatML template as it was before tools: what a checkpoint without tools carries
PLAIN_CHATML = """{% for message in messages %}
{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}
{% if add_generation_prompt %}
{{ '<|im_start|>assistant\\n' }}{% endif %}
"""
CONVERSATIONS = [
    [{"role": "user", "content": "Weather in Paris?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get.weather", "arguments": '{"city": "Paris"}'},
                },
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "get.weather", "arguments": '{"city": "Rome"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
        {"role": "assistant", "content": "Sunny, then rain."},
        {"role": "user", "content": "Thanks"},
    ],
]


def _spec(mode: ToolMode, parallel: bool, functions: list[dict] | None = None) -> ToolCallSpec:
    named = functions or [t["function"] for t in TOOLS]
    return ToolCallSpec(
        functions=[FunctionSpec(name=f["name"], parameters=json.dumps(f["parameters"]))
                   for f in named],
        mode=mode,
        parallel=parallel,
    )  # fmt: skip


def _accepts(codec: TextCodec, spec: ToolCallSpec, text: str) -> bool:
    """Whether the grammar takes ``text``'s tokens and may end after them."""
    tokenizer = llg.LLTokenizer(codec.tokenizer_json(), n_vocab=512, eos_token=[0])
    matcher = llg.LLMatcher(tokenizer, grammar_text(spec.constraint()), log_level=0)
    for token in codec.encode(text):
        if not matcher.consume_token(token) or matcher.is_error():
            return False
    return matcher.is_accepting()


# ---------------------------------------------------------------------- the grammar
@pytest.mark.parametrize("parallel", [True, False])
def test_required_takes_only_whole_calls_of_offered_functions(codec, parallel: bool) -> None:
    spec = _spec(ToolMode.REQUIRED, parallel)
    assert _accepts(codec, spec, CALL_A) and _accepts(codec, spec, CALL_B)
    assert _accepts(codec, spec, CALL_A + "\n" + CALL_B) is parallel
    for text in (
        "Sure. " + CALL_A,  # no text before a call
        CALL_A[:-4],  # not finished
        CALL_B.replace("count", "counter"),  # not offered
        CALL_B.replace("3", "12"),  # out of the schema
        CALL_B.replace('"n": 3', '"n": 3, "m": 1'),  # a property the schema forbids
        CALL_A.replace('{"city"', '{"town"'),  # a required property missing
        "",
    ):
        assert not _accepts(codec, spec, text), text


def test_a_named_function_takes_only_its_calls(codec) -> None:
    spec = _spec(ToolMode.REQUIRED, True, [TOOLS[1]["function"]])
    assert _accepts(codec, spec, CALL_B) and _accepts(codec, spec, CALL_B + "\n" + CALL_B)
    assert not _accepts(codec, spec, CALL_A)


@pytest.mark.parametrize("parallel", [True, False])
def test_auto_is_free_text_until_a_call_opens_and_then_a_whole_call(codec, parallel) -> None:
    spec = _spec(ToolMode.AUTO, parallel)
    for text in ("", "Just text, <tool no call.", "Let me look.\n" + CALL_A, CALL_B):
        assert _accepts(codec, spec, text), text
    assert _accepts(codec, spec, CALL_A + "\n" + CALL_B) is parallel
    for text in (
        "text <tool_call>\nnot a call",
        "text <tool_call>\n" + '{"name": "nope", "arguments": {}}\n</tool_call>',
        CALL_B + " and text after",
        "Let me look.\n" + CALL_B.replace("3", "x"),
    ):
        assert not _accepts(codec, spec, text), text


def test_a_parameters_schema_the_engine_refuses_is_named_as_for_response_format() -> None:
    bad = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    spec = _spec(ToolMode.AUTO, True, [TOOLS[0]["function"], {"name": "tag", "parameters": bad}])
    with pytest.raises(RequestError) as err:
        check_structured_output(spec.constraint())
    assert err.value.message == (
        "tools[1].function.parameters (tag): structured_output (json_schema) does not "
        'compile: Unimplemented keys: ["uniqueItems"]'
    )
    xgrammar = spec.constraint().__class__(
        kind="tool_calls", spec=spec.constraint().spec, backend=StructuredOutputsBackend.XGRAMMAR
    )
    with pytest.raises(RequestError, match="need the llguidance grammar engine"):
        check_structured_output(xgrammar)


def test_a_tool_spec_from_a_client_is_checked_before_a_grammar_is_written() -> None:
    base = json.loads(_spec(ToolMode.AUTO, True).constraint().spec)
    for change, words in (
        ({"functions": []}, "1 to 128 functions"),
        ({"functions": [{"name": 'a"b'}]}, "function name"),
        ({"functions": [{"name": "a"}, {"name": "a"}]}, "unique"),
        ({"format": {"trigger": ""}}, "needs a trigger"),
        ({"format": {"trigger": "\x00"}}, "invalid format markers"),
        ({"functions": [{"name": "a", "parameters": "[1]"}]}, "JSON schema object"),
    ):
        spec = json.dumps({**base, **change})
        constraint = _spec(ToolMode.AUTO, True).constraint().__class__(kind="tool_calls", spec=spec)
        with pytest.raises(RequestError, match=words):
            check_structured_output(constraint)


# ---------------------------------------------------------------------- the template
def _render(template: str, messages: list[dict], tools: list | None, gen: bool) -> str:
    return _compile_template(template).render(
        messages=messages, tools=tools, add_generation_prompt=gen
    )


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_the_toy_template_writes_rlts_default_tool_prompt(codec, messages: list[dict]) -> None:
    """The shipped template and the default prompt (for templates without tools) are one
    prompt; without tools the template is Ouro's ChatML as it was."""
    prepared, _ = chat_for_template(codec, messages, TOOLS)  # as admission renders them
    for gen in (True, False):
        for tools in (None, TOOLS):
            ours = _render(CHAT_TEMPLATE, prepared, tools, gen)
            assert ours == _render(PLAIN_CHATML, default_chat(prepared, tools or []), None, gen)
    plain = [m for m in prepared if "tool_calls" not in m and m["role"] != "tool"]
    assert _render(CHAT_TEMPLATE, plain, None, True) == _render(PLAIN_CHATML, plain, None, True)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="no transformers")
def test_the_toy_template_renders_tools_as_transformers_does(
    toy_checkpoint: Path, codec: TextCodec
) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(toy_checkpoint))
    for messages in CONVERSATIONS:
        prepared, tools = chat_for_template(codec, messages, TOOLS)
        ours = codec.apply_chat_template(prepared, True, tools)
        theirs = hf.apply_chat_template(
            prepared, tools=TOOLS, tokenize=False, add_generation_prompt=True
        )
        assert ours == theirs
        assert (
            '{"name": "get.weather", "arguments": {"city": "Paris"}}' in ours or len(messages) == 1
        )


def test_the_probe_finds_what_a_template_does_with_tools(toy_checkpoint: Path, tmp_path) -> None:
    def codec_with(template: str) -> TextCodec:
        found = TextCodec.from_checkpoint(toy_checkpoint)
        assert found is not None
        found.chat_template = template
        return found

    shipped = template_tools(codec_with(CHAT_TEMPLATE))
    assert shipped.renders_tools and shipped.format == HERMES
    plain = template_tools(codec_with(PLAIN_CHATML))
    assert not plain.renders_tools and plain.format == HERMES  # rlt's default
    xml = PLAIN_CHATML.replace(
        "{% for message in messages %}",
        "{% for t in tools or [] %}{{ t.function.name }}{% endfor %}"
        "{% for message in messages %}{% for c in message.tool_calls or [] %}"
        "<tool_call><function={{ c.function.name }}></function></tool_call>{% endfor %}",
    )
    other = template_tools(codec_with(xml))
    assert other.renders_tools and other.format is None and "does not read" in other.description
    # a template without tools: the default prompt is written into the messages
    codec = codec_with(PLAIN_CHATML)
    prepared, tools = chat_for_template(codec, CONVERSATIONS[1], TOOLS)
    assert tools is None and "# Tools" in prepared[0]["content"]
    assert prepared[0]["content"].startswith("Be brief.\n\n")
    assert '"arguments": {"city": "Rome"}}\n</tool_call>' in prepared[2]["content"]
    assert prepared[3] == {
        "role": "user",
        "content": "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n"
        "</tool_response>",
    }


# ---------------------------------------------------------------------- reading calls back
def _parse(pieces: list[str]) -> tuple[str, list[dict], dict[int, str]]:
    parser = ToolCallParser(HERMES, "chatcmpl-1")
    content, streamed = "", {}
    for piece in pieces:
        text, deltas = parser.push(piece)
        content += text
        for d in deltas:
            streamed[d.index] = streamed.get(d.index, "") + d.arguments
    content += parser.flush()
    return content, [c.body() for c in parser.calls], streamed


@pytest.mark.parametrize("seed", range(8))
def test_any_chunking_reads_the_same_content_and_calls(seed: int) -> None:
    text = "I'll check <tool_ both.\n\n" + CALL_A + "\n" + CALL_B
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), rng.randrange(1, 40)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    content, calls, streamed = _parse(pieces)
    assert (content, calls, streamed) == _parse([text])
    assert content == "I'll check <tool_ both."
    assert [c["function"]["name"] for c in calls] == ["get.weather", "count"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": 'Pa}r"is'}
    assert streamed == {i: c["function"]["arguments"] for i, c in enumerate(calls)}
    assert calls[0]["id"] != calls[1]["id"] and calls[0]["id"].startswith("call_")


def test_text_without_calls_is_all_content_and_a_cut_call_stays_cut() -> None:
    assert _parse(["plain text ", "ending in <tool"]) == ("plain text ending in <tool", [], {})
    content, calls, _ = _parse([CALL_B[:-14]])
    assert content == "" and calls[0]["function"]["arguments"] == '{"n": 3}'
    content, calls, streamed = _parse([CALL_A[:53]])
    assert (
        calls[0]["function"]
        == {"name": "get.weather", "arguments": '{"ci'}
        == {
            "name": "get.weather",
            "arguments": streamed[0],
        }
    )


# ---------------------------------------------------------------------- the gateway
def _chat(**fields: Any) -> bytes:
    return json_body(**{"messages": [{"role": "user", "content": "hi"}], **fields})


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice", "'x', which is not in tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "not one of"),
        ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
        ({"parallel_tool_calls": False}, "parallel_tool_calls", "only allowed when tools"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "only 'function'"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]},
         "tools[0].function.name", "1-64 characters"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "different function names"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
         "tools[0].function.parameters", "JSON schema object"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format",
         "cannot be combined with tools"),
        ({"tools": TOOLS, "structured_outputs": {"regex": "a"}}, "structured_outputs",
         "cannot be combined with tools"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": "f"}]}]},
         "messages", "tool_calls must be"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400s_naming_the_problem(
    fields: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises(ApiError) as err:
        parse_chat(_chat(**fields))
    assert (err.value.status, err.value.param) == (400, param)
    assert words in err.value.message


def test_tools_and_a_format_go_together_when_tool_choice_is_none() -> None:
    req = parse_chat(
        _chat(tools=TOOLS, tool_choice="none", response_format={"type": "json_object"})
    )
    template = template_tools_of(CHAT_TEMPLATE)
    generate = to_generate(req, "r", options(req, None, template).tools)
    assert generate.tools == TOOLS and generate.structured_output.kind == "json_object"
    with pytest.raises(ApiError, match="tools"):
        parse_completion(json_body(prompt="x", tools=TOOLS))


def template_tools_of(template: str) -> Any:
    from services.common.tool_template import TemplateTools

    renders = template != PLAIN_CHATML
    return TemplateTools(renders, HERMES, "test")


@pytest.mark.parametrize(
    ("choice", "parallel", "mode", "names"),
    [
        (None, None, "auto", ["get.weather", "count"]),
        ("auto", False, "auto", ["get.weather", "count"]),
        ("required", True, "required", ["get.weather", "count"]),
        ({"type": "function", "function": {"name": "count"}}, False, "required", ["count"]),
    ],
)
def test_tool_choice_becomes_the_format(choice, parallel, mode: str, names: list[str]) -> None:
    fields: dict[str, Any] = {"tools": TOOLS}
    if choice is not None:
        fields["tool_choice"] = choice
    if parallel is not None:
        fields["parallel_tool_calls"] = parallel
    req = parse_chat(_chat(**fields))
    generate = to_generate(req, "r", options(req, None, template_tools_of(CHAT_TEMPLATE)).tools)
    spec = json.loads(generate.structured_output.spec)
    assert spec["mode"] == mode and [f["name"] for f in spec["functions"]] == names
    assert spec["parallel"] is (parallel is not False)
    assert generate.tools == TOOLS


def test_an_answer_with_calls_in_openais_shapes_streamed_and_whole() -> None:
    req = parse_chat(_chat(tools=TOOLS, stream=True))
    opts = options(req, None, template_tools_of(CHAT_TEMPLATE))
    text = "Checking.\n" + CALL_A + "\n" + CALL_B
    events = token_events("r", [text[i : i + 5] for i in range(0, len(text), 5)], finish=False)
    events.append(FinishedEvent(request_id="r", finish_reason="stop", token_ids=[],
                                exit_depths=[], num_prompt_tokens=3))  # fmt: skip
    answer, encoder = Answer("r", opts), SseEncoder(True, "r", "toy", 0, opts)
    sse = b"".join(encoder.deltas(answer.on_event(e)) for e in events).decode()
    choice = answer.choice(chat=True)
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Checking."
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [
        {"city": 'Pa}r"is'},
        {"n": 3},
    ]
    frames = [json.loads(f[6:]) for f in sse.split("\n\n") if f.startswith("data: {")]
    deltas = [f["choices"][0]["delta"] for f in frames]
    streamed: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        for piece in delta.get("tool_calls", []):
            call = streamed.setdefault(piece["index"], {"arguments": ""})
            if "id" in piece:
                call.update(id=piece["id"], name=piece["function"]["name"], type=piece["type"])
            call["arguments"] += piece["function"]["arguments"]
    assert [
        {"id": c["id"], "type": "function",
         "function": {"name": c["name"], "arguments": c["arguments"]}}
        for c in streamed.values()
    ] == message["tool_calls"]  # fmt: skip
    assert "".join(d.get("content", "") for d in deltas) == "Checking."
    assert frames[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_only_calls_mean_a_null_content_and_a_cut_answer_says_length() -> None:
    req = parse_chat(_chat(tools=TOOLS, tool_choice="required"))
    opts = options(req, None, template_tools_of(CHAT_TEMPLATE))
    for finish, text, reason in (
        ("stop", CALL_B, "tool_calls"),
        ("length", CALL_B[:-14], "length"),
    ):
        answer = Answer("r", opts)
        for event in [*token_events("r", [text], finish=False),
                      FinishedEvent(request_id="r", finish_reason=finish, token_ids=[],
                                    exit_depths=[], num_prompt_tokens=3)]:  # fmt: skip
            answer.on_event(event)
        choice = answer.choice(chat=True)
        assert choice["finish_reason"] == reason and choice["message"]["content"] is None


def test_tools_on_a_checkpoint_whose_calls_rlt_cannot_read_are_a_400() -> None:
    from services.common.tool_template import TemplateTools

    req = parse_chat(_chat(tools=TOOLS))
    with pytest.raises(ApiError, match="not supported with this checkpoint: xml") as err:
        options(req, None, TemplateTools(True, None, "xml"))
    assert err.value.param == "tools"
    with pytest.raises(ApiError, match="chat template"):
        options(req, None, None)


# ---------------------------------------------------------------------- the engine
def test_every_finished_call_of_the_toy_model_validates(toy_model, codec: TextCodec) -> None:
    """Random weights: the grammar does all the work, so every finished answer's calls
    parse and validate, required, named and auto, parallel or not, greedy and sampled."""
    engine = LLMEngine(toy_model, SchedulerConfig(max_num_seqs=16, num_blocks=1024), codec=codec)
    # a bounded city: a random model's strings would run past max_tokens
    city = {**CITY, "properties": {"city": {"type": "string", "maxLength": 6}},
            "additionalProperties": False}  # fmt: skip
    tools = [
        {"type": "function", "function": {"name": "get.weather", "parameters": city}},
        TOOLS[1],
    ]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    cases = []
    for mode, parallel, named in (
        (ToolMode.REQUIRED, True, None),
        (ToolMode.REQUIRED, False, None),
        (ToolMode.REQUIRED, False, TOOLS[1]["function"]),
        (ToolMode.AUTO, True, None),
    ):
        spec = _spec(mode, parallel, [named] if named else [t["function"] for t in tools])
        for seed in range(3):
            temperature = 0.0 if seed == 0 else 1.0
            cases.append((spec, SamplingParams(max_tokens=160, temperature=temperature,
                          seed=seed, structured_output=spec.constraint())))  # fmt: skip
    prompts = [codec.encode_chat(CONVERSATIONS[0], True, TOOLS)] * len(cases)
    finished = engine.generate(prompts, [params for _, params in cases])
    ended = 0
    for (spec, _), done in zip(cases, finished, strict=True):
        assert isinstance(done, FinishedEvent), done
        parser = ToolCallParser(HERMES, "r")
        parser.push(codec.decode(done.token_ids))
        parser.flush()
        if done.finish_reason != "stop":
            continue
        ended += 1
        if spec.mode == ToolMode.REQUIRED:
            assert parser.calls and (spec.parallel or len(parser.calls) == 1)
        allowed = {f.name for f in spec.functions}
        for call in parser.calls:
            assert call.complete and call.name in allowed
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    assert ended >= len(cases) // 2, ended


def test_token_events_make_the_same_answer_as_the_whole_text() -> None:
    """(TokenEvent texts of any split feed the parser as one text would.)"""
    req = parse_chat(_chat(tools=TOOLS))
    opts = options(req, None, template_tools_of(CHAT_TEMPLATE))
    whole, split = Answer("r", opts), Answer("r", opts)
    text = "Hm <tool_call>" + CALL_A[len("<tool_call>") :]
    whole.on_event(TokenEvent(request_id="r", index=0, token_id=1, exit_depth=1, text=text))
    for i, ch in enumerate(text):
        split.on_event(TokenEvent(request_id="r", index=i, token_id=1, exit_depth=1, text=ch))
    assert whole.tool_calls == split.tool_calls and whole.text == split.text == "Hm"


def test_jsonschemabench_function_schemas_take_their_valid_calls_only(codec: TextCodec) -> None:
    """The repository's Glaive and BFCL samples as tools: every schema compiles, and each
    instance written as a call is taken exactly when it is valid."""
    data = Path(__file__).parent / "data" / "jsonschemabench"
    checked = 0
    for path in sorted(data.glob("*.json")):
        if not path.name.startswith(("Glaiveai2K---", "BFCL_")):
            continue
        raw = json.loads(path.read_text())
        options = raw["schema"].get("anyOf", [raw["schema"]])
        if path.name.startswith("BFCL_"):
            functions = [
                {"name": n, "parameters": p} for o in options for n, p in o["properties"].items()
            ]
        else:
            functions = [{"name": path.name.split("---")[1][:-14], "parameters": raw["schema"]}]
        spec = _spec(ToolMode.REQUIRED, True, functions)
        check_structured_output(spec.constraint())
        for case in raw["tests"]:
            name, arguments = (
                next(iter(case["data"].items()))
                if path.name.startswith("BFCL_")
                else (functions[0]["name"], case["data"])
            )
            body = json.dumps({"name": name, "arguments": arguments})
            text = f"<tool_call>\n{body}\n</tool_call>"
            assert _accepts(codec, spec, text) is case["valid"], (path.name, case["description"])
            checked += 1
    assert checked >= 6
