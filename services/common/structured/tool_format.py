"""What a tool call looks like in a model's output, and the spec a tool-call grammar is
compiled from (``StructuredOutputKind.TOOL_CALLS``).

rlt writes and reads the Hermes/Qwen form, which Qwen2.5's and Qwen3's chat templates
teach and rlt's own checkpoints carry (``services/worker/model/toy.py``)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, a newline between two blocks. The grammar writes the JSON as a
template's ``tojson`` does (``grammar_llguidance_tools.py``) and ``name`` before
``arguments``, so a reader (``services/gateway/constrained/tool_parser.py``) knows the
name before the first byte of the arguments and can stream them as they come. A chat
template whose calls look otherwise is found out by ``tool_template.py``.

The spec travels as JSON in ``StructuredOutput.spec``; it is checked here (names, markers,
sizes) before a grammar is written from it, since a NATS client may send one directly.
"""

from __future__ import annotations

import json
import re
from enum import StrEnum
from typing import Any

import msgspec

from messages.errors import RequestError
from messages.sampling import StructuredOutput, StructuredOutputKind

# OpenAI's rule for a function name, and the dot BFCL's names use (``math.factorial``); no
# quote or backslash, so a name is written into a grammar and JSON as it is
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
MAX_FUNCTIONS = 128  # OpenAI's bound on ``tools``
# markers are short printable text (a newline allowed): they are written into grammars
_MARKER = re.compile(r"^[\x20-\x7e\n]{0,32}$")
# a function without ``parameters`` takes none, as OpenAI reads it
NO_PARAMETERS = '{"type":"object","properties":{}}'


class ToolMode(StrEnum):
    REQUIRED = "required"  # only calls (one, or several with ``parallel``)
    AUTO = "auto"  # free text, and once the model writes ``trigger``, calls


class ToolFormat(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The text around a call's JSON."""

    trigger: str = "<tool_call>"  # a call starts here (with ``auto``: the free text ends)
    begin: str = "\n"  # between the trigger and the JSON
    end: str = "\n</tool_call>"  # after the JSON
    separator: str = "\n"  # between two calls


HERMES = ToolFormat()


class FunctionSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str
    parameters: str = NO_PARAMETERS  # a JSON schema as JSON text (its key order kept)


class ToolCallSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    functions: list[FunctionSpec]
    mode: ToolMode = ToolMode.REQUIRED
    parallel: bool = True  # several calls in one answer
    format: ToolFormat = HERMES

    def constraint(self) -> StructuredOutput:
        return StructuredOutput(
            kind=StructuredOutputKind.TOOL_CALLS, spec=msgspec.json.encode(self).decode()
        )

    def schemas(self) -> list[Any]:
        """Each function's parameters schema, parsed (checked by ``tool_call_spec``)."""
        return [json.loads(f.parameters) for f in self.functions]


_DECODER = msgspec.json.Decoder(ToolCallSpec)


def tool_call_spec(spec: str) -> ToolCallSpec:
    """The spec of a TOOL_CALLS format, checked; ``RequestError`` naming what is wrong."""
    try:
        parsed = _DECODER.decode(spec)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise RequestError(f"structured_output (tool_calls): invalid spec: {exc}") from None
    if not 1 <= len(parsed.functions) <= MAX_FUNCTIONS:
        raise RequestError(
            f"structured_output (tool_calls): 1 to {MAX_FUNCTIONS} functions, got "
            f"{len(parsed.functions)}"
        )
    names = [f.name for f in parsed.functions]
    for name in names:
        if not FUNCTION_NAME.match(name):
            raise RequestError(
                f"function name {name[:80]!r} must be 1-64 characters of a-z, A-Z, 0-9, "
                "'_', '-' and '.'"
            )
    if len(set(names)) != len(names):
        raise RequestError("function names must be unique")
    fmt = parsed.format
    for marker in (fmt.trigger, fmt.begin, fmt.end, fmt.separator):
        if not _MARKER.match(marker):
            raise RequestError("structured_output (tool_calls): invalid format markers")
    if not fmt.trigger:
        raise RequestError("structured_output (tool_calls): the format needs a trigger")
    for function in parsed.functions:
        try:
            schema = json.loads(function.parameters)
        except (ValueError, RecursionError):
            schema = None
        if not isinstance(schema, dict | bool):
            raise RequestError(
                f"function {function.name!r}: parameters must be a JSON schema object"
            )
    return parsed
