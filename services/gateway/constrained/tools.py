"""Tool calling in the HTTP API: OpenAI's ``tools``, ``tool_choice`` and
``parallel_tool_calls``, checked, and the tool-call format the engine holds the output to.
Pure: no HTTP, no NATS.

``check_tools`` refuses a malformed request by the field's name (``parse_chat``);
``tool_calling`` turns a checked one into what the call needs, given what the checkpoint's
chat template does with tools (``services/common/tool_template.py``): the tools for the
template, and unless ``tool_choice`` is ``none`` the format
(``services/common/structured/tool_format.py``): ``required`` and a named function allow
only calls, ``auto`` free text until the model opens a call. Whether each ``parameters``
schema compiles is admission's check, as for ``response_format``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from messages.errors import RequestError
from messages.sampling import StructuredOutput
from services.common.structured.tool_format import (
    FUNCTION_NAME,
    MAX_FUNCTIONS,
    NO_PARAMETERS,
    FunctionSpec,
    ToolCallSpec,
    ToolFormat,
    ToolMode,
)
from services.common.tool_template import TemplateTools
from services.gateway.errors import ApiError

_CHOICES = ("none", "auto", "required")


class ChatRequest(Protocol):
    """The fields of a chat request read here (``protocol.ChatRequest``'s)."""

    tools: Any
    tool_choice: Any
    parallel_tool_calls: Any


@dataclass(frozen=True)
class ToolCalling:
    """A request's tools, as the call needs them."""

    tools: list[dict[str, Any]]  # for the chat template, as sent
    # the output's format and how to read it back; None with tool_choice none (the output
    # is text, as the model writes it)
    constraint: StructuredOutput | None
    format: ToolFormat | None


def check_tools(req: ChatRequest) -> None:
    """Refuses what no checkpoint could answer: malformed tools, a tool_choice naming no
    offered function, tools with a format they conflict with."""
    tools = req.tools
    if tools is not None and not isinstance(tools, list):
        raise ApiError("tools must be a list of functions", param="tools")
    if tools is not None and len(tools) > MAX_FUNCTIONS:
        raise ApiError(f"at most {MAX_FUNCTIONS} tools, got {len(tools)}", param="tools")
    names = [_function_name(tool, i) for i, tool in enumerate(tools or [])]
    if len(set(names)) != len(names):
        raise ApiError("tools must have different function names", param="tools")
    if req.parallel_tool_calls is not None:
        if not isinstance(req.parallel_tool_calls, bool):
            raise ApiError("parallel_tool_calls must be true or false", param="parallel_tool_calls")
        if not names:
            raise ApiError(
                "parallel_tool_calls is only allowed when tools are given",
                param="parallel_tool_calls",
            )
    choice, _ = _choice(req.tool_choice, names)
    if choice != "none" and not names:
        raise ApiError("tool_choice needs tools", param="tool_choice")


def uses_format(req: ChatRequest) -> bool:
    """The request's tools (checked) hold its output to a tool-call format."""
    if not req.tools or not isinstance(req.tools, list):
        return False
    return _choice(req.tool_choice, [t["function"]["name"] for t in req.tools])[0] != "none"


def tool_calling(req: ChatRequest, template: TemplateTools | None) -> ToolCalling | None:
    """What the call does with ``req``'s tools (checked by ``check_tools``); None: none.
    ``template``: what the checkpoint's chat template does with tools (None: the
    checkpoint has no chat template)."""
    if not req.tools:
        return None
    tools: list[dict[str, Any]] = req.tools
    names = [t["function"]["name"] for t in tools]
    choice, named = _choice(req.tool_choice, names)
    if template is None:
        raise ApiError("tools need the checkpoint's tokenizer and chat template", param="tools")
    if choice == "none":
        return ToolCalling(tools, None, template.format)
    if template.format is None:
        raise ApiError(
            f"tools are not supported with this checkpoint: {template.description}",
            param="tools",
        )
    offered = [_function_spec(t["function"]) for t in tools]
    if named is None:
        functions, mode = offered, ToolMode(choice)
    else:  # one named function: a call of it
        functions, mode = [f for f in offered if f.name == named], ToolMode.REQUIRED
    parallel = req.parallel_tool_calls is not False  # OpenAI's default: allowed
    spec = ToolCallSpec(functions=functions, mode=mode, parallel=parallel, format=template.format)
    constraint = spec.constraint()
    try:
        constraint.validate()
    except RequestError as exc:
        raise ApiError(f"tools: {exc.message}", param="tools") from None
    return ToolCalling(tools, constraint, template.format)


def _function_name(tool: Any, index: int) -> str:
    param = f"tools[{index}]"
    if not isinstance(tool, dict):
        raise ApiError(f"{param} must be an object", param=param)
    if tool.get("type") != "function":
        raise ApiError(
            f"{param}.type {tool.get('type')!r} is not supported by rlt (only 'function')",
            param=f"{param}.type",
        )
    function = tool.get("function")
    if not isinstance(function, dict):
        raise ApiError(f"{param}.function must be an object", param=f"{param}.function")
    name = function.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.match(name):
        raise ApiError(
            f"{param}.function.name must be 1-64 characters of a-z, A-Z, 0-9, '_', '-' and '.'",
            param=f"{param}.function.name",
        )
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise ApiError(
            f"{param}.function.parameters must be a JSON schema object",
            param=f"{param}.function.parameters",
        )
    return name


def _choice(value: Any, names: list[str]) -> tuple[str, str | None]:
    """(``none``, ``auto`` or ``required``, None), or (``required``, the name of the
    function asked for, checked against ``names`` when they are given). Left out: ``auto``
    with tools, as OpenAI reads it."""
    if value is None:
        return ("auto" if names else "none"), None
    if isinstance(value, str):
        if value not in _CHOICES:
            raise ApiError(
                f"tool_choice {value[:80]!r} is not one of none, auto, required or a function",
                param="tool_choice",
            )
        return value, None
    function = value.get("function") if isinstance(value, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(name, str):
        raise ApiError(
            'tool_choice must be none, auto, required or {"type": "function", "function": '
            '{"name": ...}}',
            param="tool_choice",
        )
    if names and name not in names:
        raise ApiError(
            f"tool_choice names the function {name[:80]!r}, which is not in tools",
            param="tool_choice",
        )
    return "required", name


def _function_spec(function: dict[str, Any]) -> FunctionSpec:
    parameters = function.get("parameters")
    # key order kept: a schema's property order is the order the arguments are written in
    text = NO_PARAMETERS if parameters is None else msgspec.json.encode(parameters).decode()
    return FunctionSpec(name=function["name"], parameters=text)
