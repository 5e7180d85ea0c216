"""What a checkpoint's chat template does with tools, and rlt's default where it does
nothing.

A template gets ``tools`` as transformers passes them (OpenAI's function entries) and
renders assistant messages' ``tool_calls`` and ``tool`` messages its own way. Whether it
does, and in which form it writes a call, is found by rendering a probe
(``template_tools``): a template that shows the probe tool and writes the probe call as a
Hermes/Qwen ``<tool_call>`` block (``tool_format.py``) is used as it is; one that ignores
tools gets rlt's default (``default_chat``): the tools listed in the system message, past
calls written into the assistant's content as ``<tool_call>`` blocks and tool results as a
user turn of ``<tool_response>`` blocks, so an Ouro ChatML template that knows no tools
still shows the model what it may call. A template that writes calls in another form
(Qwen3-coder's XML, Llama's ``<|python_tag|>``) has no format rlt reads yet.

Assistant calls' ``arguments`` come from OpenAI clients as JSON text; templates expect an
object (transformers' convention, vLLM converts them too), so they are parsed first.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.common.structured.tool_format import HERMES, ToolFormat
from services.common.tokenizer import TextCodec

# the default's system text, before the tools (one JSON signature a line) and after them
TOOLS_INTRO = "# Tools\n\nYou may call these functions (JSON signatures, one a line):\n<tools>\n"
TOOLS_OUTRO = (
    "</tools>\n\nTo call a function, write a <tool_call></tool_call> block holding a JSON "
    "object with its name and arguments:\n<tool_call>\n"
    '{"name": <function name>, "arguments": <arguments as a JSON object>}\n'
    "</tool_call>\nWrite one block per call."
)

_PROBE_NAME = "rlt_probe_function"
_PROBE_ARGUMENTS = {"rlt_probe_argument": 7}
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": _PROBE_NAME,
        "description": "a probe",
        "parameters": {"type": "object", "properties": {"rlt_probe_argument": {"type": "integer"}}},
    },
}
_PROBE_CALL = {
    "id": "call_probe",
    "type": "function",
    "function": {"name": _PROBE_NAME, "arguments": _PROBE_ARGUMENTS},
}


@dataclass(frozen=True)
class TemplateTools:
    renders_tools: bool  # the template itself shows the tools (else: rlt's default)
    format: ToolFormat | None  # how calls are written; None: a form rlt does not read
    description: str  # for ``rlt check-checkpoint`` and errors


def template_tools(codec: TextCodec) -> TemplateTools:
    """What ``codec``'s chat template does with tools (probed once per template)."""
    if codec.chat_template is None:
        return TemplateTools(False, None, "no chat template")
    return _probe(codec.chat_template, codec)


@functools.lru_cache(maxsize=8)
def _probe(template: str, codec: TextCodec) -> TemplateTools:
    user = {"role": "user", "content": "hello"}
    try:
        shown = codec.apply_chat_template([user], True, [_PROBE_TOOL])
    except Exception as exc:  # checkpoint code: any failure means no usable tool support
        return TemplateTools(True, None, f"the chat template fails with tools: {exc}"[:200])
    if _PROBE_NAME not in shown:
        return TemplateTools(
            False, HERMES, "none in the chat template: rlt's default (Hermes/Qwen <tool_call>)"
        )
    called = {"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]}
    try:
        history = codec.apply_chat_template([user, called], False, [_PROBE_TOOL])
    except Exception as exc:
        return TemplateTools(True, None, f"the chat template fails on a tool call: {exc}"[:200])
    if _writes_hermes(history):
        return TemplateTools(True, HERMES, "the chat template's (Hermes/Qwen <tool_call>)")
    return TemplateTools(
        True,
        None,
        "the chat template writes calls in a form rlt does not read (it reads the "
        "Hermes/Qwen <tool_call> JSON form)",
    )


def _writes_hermes(text: str) -> bool:
    """The probe call appears as a ``<tool_call>`` block holding its name and arguments."""
    start = text.rfind(HERMES.trigger)  # the last: a system text may show an example
    end = text.find(HERMES.end.strip(), start)
    if start < 0 or end < 0:
        return False
    try:
        call = json.loads(text[start + len(HERMES.trigger) : end])
    except ValueError:
        return False
    return call == {"name": _PROBE_NAME, "arguments": _PROBE_ARGUMENTS}


def chat_for_template(
    codec: TextCodec,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and tools to render: as they are for a template that renders tools,
    else rlt's default written into the messages (and no tools)."""
    prepared = [_with_argument_objects(m) for m in messages]
    uses_tools = tools or any(_has_tool_parts(m) for m in prepared)
    if not uses_tools or template_tools(codec).renders_tools:
        return prepared, [dict(t) for t in tools] if tools else None
    return default_chat(prepared, tools or []), None


def default_chat(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """rlt's default tool prompt, as plain messages any template renders."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role, content = message.get("role"), message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            blocks = [call_block(c) for c in message["tool_calls"]]
            text = "\n".join(filter(None, [content, *blocks]))
            out.append({"role": "assistant", "content": text})
        elif role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("rlt_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "rlt_tool_results": True})
        else:
            out.append(dict(message))
    out = [{k: v for k, v in m.items() if k != "rlt_tool_results"} for m in out]
    if tools:
        listed = TOOLS_INTRO + "".join(_json(t) + "\n" for t in tools) + TOOLS_OUTRO
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{listed}"}
        else:
            out.insert(0, {"role": "system", "content": listed})
    return out


def call_block(call: Mapping[str, Any]) -> str:
    """A past call as the format writes it (the JSON as ``tojson`` writes it)."""
    function = call.get("function") or {}
    body = {"name": function.get("name"), "arguments": function.get("arguments")}
    return f"{HERMES.trigger}{HERMES.begin}{_json(body)}{HERMES.end}"


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)  # what transformers' tojson writes


def _has_tool_parts(message: Mapping[str, Any]) -> bool:
    return message.get("role") == "tool" or bool(message.get("tool_calls"))


def _with_argument_objects(message: Mapping[str, Any]) -> dict[str, Any]:
    """The message with each call's ``arguments`` an object where it is JSON text (and the
    content of a turn that only called tools "", as OpenAI clients send it null)."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return dict(message)
    if message.get("content") is None:
        message = {**message, "content": ""}
    fixed = []
    for call in calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        arguments = function.get("arguments") if isinstance(function, Mapping) else None
        if isinstance(arguments, str):
            with contextlib.suppress(ValueError):  # not JSON: the template gets the text
                call = {**call, "function": {**function, "arguments": json.loads(arguments)}}
        fixed.append(call)
    return {**message, "tool_calls": fixed}
