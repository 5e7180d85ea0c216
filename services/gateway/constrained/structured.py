"""Structured outputs in the HTTP API: OpenAI's ``response_format`` and vLLM's
``structured_outputs`` extra body, as the NATS API's ``structured_output`` (kind + spec).

Only the shape is checked here; whether a schema, regular expression or grammar compiles
is admission's check (its error is a 400 naming the problem, as every invalid request's).
"""

from __future__ import annotations

from typing import Any

import msgspec

from messages.errors import RequestError
from messages.sampling import StructuredOutput, StructuredOutputKind

# vLLM's StructuredOutputsParams: the fields that name a format (exactly one of them)
_FORMATS = {
    "json": StructuredOutputKind.JSON_SCHEMA,
    "regex": StructuredOutputKind.REGEX,
    "choice": StructuredOutputKind.CHOICE,
    "grammar": StructuredOutputKind.GRAMMAR,
    "json_object": StructuredOutputKind.JSON_OBJECT,
}
# its other fields, each with the values that ask for nothing rlt does not do: the server
# picks one grammar engine (so there is no fallback to disable), and any other value is
# refused by name. ``disable_any_whitespace``: JSON is compact unless it is false (then
# whitespace runs of at most 16 characters are allowed, as an indenting model writes)
_OPTIONS: dict[str, tuple[Any, ...]] = {
    "disable_fallback": (None, False, True),
    "disable_any_whitespace": (None, False, True),
    "disable_additional_properties": (None, False),
    "whitespace_pattern": (None,),
    "structural_tag": (None,),
}


_JSON_KINDS = (StructuredOutputKind.JSON_SCHEMA, StructuredOutputKind.JSON_OBJECT)


class FormatError(ValueError):
    """A format the API cannot take; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def structured_output(
    response_format: dict[str, Any] | None, structured_outputs: Any
) -> StructuredOutput | None:
    """The format a request asks for (None: free text); ``FormatError`` otherwise."""
    from_openai = _response_format(response_format)
    from_vllm = _structured_outputs(structured_outputs)
    if from_openai is not None and from_vllm is not None:
        raise FormatError(
            "set response_format or structured_outputs, not both", "structured_outputs"
        )
    found = from_openai or from_vllm
    if found is not None:
        constraint, param = found
        try:
            constraint.validate()
        except RequestError as exc:
            raise FormatError(exc.message, param) from None
        return constraint
    return None


def _response_format(value: dict[str, Any] | None) -> tuple[StructuredOutput, str] | None:
    kind = (value or {"type": "text"}).get("type")  # {} asks for nothing
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(kind=StructuredOutputKind.JSON_OBJECT), "response_format"
    if kind == "json_schema":
        param = "response_format.json_schema"
        spec = (value or {}).get("json_schema")
        if not isinstance(spec, dict):
            raise FormatError(f"{param} must be an object with a 'schema'", param)
        # "name", "description" and "strict" need nothing: the schema is always enforced
        schema = spec.get("schema")
        if not isinstance(schema, dict | bool):
            raise FormatError(f"{param}.schema must be a JSON schema object", f"{param}.schema")
        return _schema(schema), f"{param}.schema"
    raise FormatError(
        f"response_format {kind!r} is not supported by rlt: text, json_object or json_schema",
        "response_format",
    )


def _structured_outputs(value: Any) -> tuple[StructuredOutput, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise FormatError("structured_outputs must be an object", "structured_outputs")
    for name in value:
        if name not in _FORMATS and name not in _OPTIONS:
            raise FormatError(
                f"structured_outputs.{name} is not supported by rlt", f"structured_outputs.{name}"
            )
    for name, harmless in _OPTIONS.items():
        if not any(_same(value.get(name), h) for h in harmless):
            raise FormatError(
                f"structured_outputs.{name} is not supported by rlt", f"structured_outputs.{name}"
            )
    named = [n for n in _FORMATS if value.get(n) not in (None, False)]
    if len(named) != 1:
        raise FormatError(
            "structured_outputs needs exactly one of " + ", ".join(_FORMATS),
            "structured_outputs",
        )
    found = _vllm_format(named[0], value[named[0]])
    if value.get("disable_any_whitespace") is False and found[0].kind in _JSON_KINDS:
        return msgspec.structs.replace(found[0], any_whitespace=True), found[1]
    return found


def _vllm_format(name: str, spec: Any) -> tuple[StructuredOutput, str]:
    param = f"structured_outputs.{name}"
    if name == "json":
        if isinstance(spec, str):
            return StructuredOutput(kind=StructuredOutputKind.JSON_SCHEMA, spec=spec), param
        if not isinstance(spec, dict | bool):
            raise FormatError(f"{param} must be a JSON schema (object or string)", param)
        return _schema(spec), param
    if name == "json_object":
        if spec is not True:
            raise FormatError(f"{param} must be true", param)
        return StructuredOutput(kind=StructuredOutputKind.JSON_OBJECT), param
    if name == "choice":
        if not isinstance(spec, list) or not all(isinstance(c, str) for c in spec):
            raise FormatError(f"{param} must be a list of strings", param)
        text = msgspec.json.encode(spec).decode()
        return StructuredOutput(kind=StructuredOutputKind.CHOICE, spec=text), param
    if not isinstance(spec, str):
        raise FormatError(f"{param} must be a string", param)
    return StructuredOutput(kind=_FORMATS[name], spec=spec), param


def _schema(schema: dict[str, Any] | bool) -> StructuredOutput:
    # key order is kept: a schema's property order is the order the output writes them
    text = msgspec.json.encode(schema).decode()
    return StructuredOutput(kind=StructuredOutputKind.JSON_SCHEMA, spec=text)


def _same(value: Any, harmless: Any) -> bool:
    # True == 1 in Python: a boolean only stands for itself
    if isinstance(value, bool) or isinstance(harmless, bool):
        return value is harmless
    return bool(value == harmless)
