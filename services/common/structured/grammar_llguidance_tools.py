"""A tool-call spec (``tool_format.py``) as an llguidance Lark grammar.

Each call is the format's text around ``{"name": "<name>", "arguments": <arguments>}``, one
alternative per function, its arguments held to the function's schema by llguidance's own
JSON schema compiler (``%json``). The JSON is written as a chat template's ``tojson``
writes a call into the history (Python's ``json.dumps``: ", " and ": ", no other
whitespace), so the model is asked for exactly the text it was shown. ``required``: the
output is a call (several, separated, with ``parallel``) and nothing else. ``auto``: free
text, which is complete at any point; the rule that ends the text at the format's trigger
is lazy, so the moment the text holds the trigger the lexer takes it as the call's start
and the rest must be a well-formed call: a call that starts is always a whole one. After
the calls only the end of the output may follow.
"""

from __future__ import annotations

import json
from typing import Any

from services.common.structured.tool_format import ToolCallSpec, ToolMode

# llguidance's JSON options: json.dumps' separators and no other whitespace
_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def tool_calls_lark(spec: ToolCallSpec) -> str:
    fmt = spec.format
    calls = " | ".join(f"call_{i}" for i in range(len(spec.functions)))
    rules = [
        "%llguidance {}",
        f"body: {_literals(fmt.begin)} call {_literals(fmt.end)}",
        f"call: {calls}",
    ]
    more = f" ({_literals(fmt.separator + fmt.trigger)} body)*" if spec.parallel else ""
    if spec.mode == ToolMode.REQUIRED:
        rules.append(f"start: {_literal(fmt.trigger)} body{more}")
    else:
        rules += [
            f"start: TEXT | opened body{more}",
            f"opened[lazy]: TEXT {_literal(fmt.trigger)}",
            "TEXT: /(.|\\n)*/",
        ]
    for i, (function, schema) in enumerate(zip(spec.functions, spec.schemas(), strict=True)):
        head = f'{{"name": "{function.name}", "arguments": '  # names hold no quote (checked)
        rules.append(f"call_{i}: {_literal(head)} args_{i} {_literal('}')}")
        rules.append(f"args_{i}: %json {json.dumps(_styled(schema))}")
    return "\n".join(rules) + "\n"


def _styled(schema: Any) -> Any:
    """The schema with llguidance's JSON options (``true`` is any value)."""
    if schema is True:
        schema = {}
    if schema is False:
        return {"not": {}}  # no value: llguidance refuses it by name, as for a format
    # a client's own llguidance options (``lenient`` would ignore unknown keywords) are
    # replaced: the arguments must validate
    return {**schema, "x-guidance": _STYLE}


def _literals(text: str) -> str:
    """``text`` as a literal; nothing for an empty one (Lark has no empty literal)."""
    return _literal(text) if text else ""


def _literal(text: str) -> str:
    return json.dumps(text)
