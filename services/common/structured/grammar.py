"""Structured outputs' grammars: the one rule for what a format means, whichever grammar
engine compiles it.

A request's ``StructuredOutput`` names its engine (``backend``: llguidance or xgrammar,
filled in by admission or the in-process engine from ``--structured-outputs-backend``).
Admission checks a format with that engine before routing (a 400 that names the problem),
the in-process engine when a request is added, and the worker compiles it against the
checkpoint's vocabulary into token masks (what an engine provides:
``grammar_engine.py``). Grammars are never written by hand here: JSON schemas, regular
expressions and grammars go through the engine's own converters (``grammar_llguidance.py``,
``grammar_xgrammar.py``).

The engines are imported on the first request that carries a format, never at import
time (xgrammar imports torch, which admission and the gateway never load otherwise).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import msgspec

from messages.errors import RequestError
from messages.sampling import (
    DEFAULT_STRUCTURED_OUTPUTS_BACKEND,
    SamplingParams,
    StructuredOutput,
    StructuredOutputKind,
    StructuredOutputsBackend,
)
from services.common.structured.grammar_engine import GrammarEngine
from services.common.structured.tool_format import tool_call_spec

# a counted repetition ``{m,n}`` in a regular expression (a regex format, a JSON schema's
# ``pattern``, a grammar) may not go over this: xgrammar's parse grows with the square of
# the count (0.14 s at 1000, ~1 min at 20000) and would stall admission and the worker;
# one rule for both engines, so a format's validity does not depend on the server
MAX_REPEAT_COUNT = 1000
_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
# a JSON schema may nest its objects and arrays at most this deep: xgrammar's conversion
# grows with the cube of the depth (7 s at 600 levels, on the worker's one compile thread),
# llguidance refuses past about 124; real schemas nest under 20
MAX_SCHEMA_DEPTH = 100


def engine(backend: StructuredOutputsBackend) -> GrammarEngine:
    """The grammar engine ``backend`` names (imported on first use)."""
    if backend == StructuredOutputsBackend.LLGUIDANCE:
        from services.common.structured.grammar_llguidance import LLGUIDANCE

        return LLGUIDANCE
    if backend == StructuredOutputsBackend.XGRAMMAR:
        from services.common.structured.grammar_xgrammar import XGRAMMAR

        return XGRAMMAR
    raise RequestError(f"structured_output backend {backend!r} is not supported")


def backend_of(constraint: StructuredOutput) -> StructuredOutputsBackend:
    return StructuredOutputsBackend(constraint.backend or DEFAULT_STRUCTURED_OUTPUTS_BACKEND)


def with_backend(params: SamplingParams, backend: StructuredOutputsBackend) -> SamplingParams:
    """``params`` with its structured output's engine filled in (kept when it names one), so
    every worker a request ever runs on compiles it with the same engine."""
    constraint = params.structured_output
    if constraint is None or constraint.backend is not None:
        return params
    return msgspec.structs.replace(
        params, structured_output=msgspec.structs.replace(constraint, backend=backend)
    )


def check_structured_output(constraint: StructuredOutput) -> None:
    """Raises ``RequestError`` naming the problem when ``constraint`` does not compile with
    its engine."""
    constraint.validate()
    check_bounds(constraint)
    engine(backend_of(constraint)).check(constraint)


def check_bounds(constraint: StructuredOutput) -> None:
    """What would stall an engine is refused before either spends its time on it: a counted
    repetition over ``MAX_REPEAT_COUNT``, a schema nested over ``MAX_SCHEMA_DEPTH``. One
    rule for both engines, so a format's validity does not depend on the server."""
    kind = StructuredOutputKind(constraint.kind)
    if kind == StructuredOutputKind.TOOL_CALLS:
        for function in tool_call_spec(constraint.spec).functions:
            check_bounds(StructuredOutput(kind="json_schema", spec=function.parameters))
        return
    if kind == StructuredOutputKind.JSON_SCHEMA:
        schema = _schema(constraint.spec)
        depth = _depth(schema)
        if depth > MAX_SCHEMA_DEPTH:
            raise RequestError(
                f"structured_output (json_schema): the schema is nested {depth} levels deep, "
                f"at most {MAX_SCHEMA_DEPTH} are allowed"
            )
        texts = list(_schema_patterns(schema))
    elif kind in (StructuredOutputKind.REGEX, StructuredOutputKind.GRAMMAR):
        texts = [constraint.spec]
    else:
        return
    for text in texts:
        for match in _REPEAT.finditer(text):
            counts = [int(c) for c in match.groups() if c]
            if max(counts) > MAX_REPEAT_COUNT:
                raise RequestError(
                    f"structured_output ({kind}): the repetition {match.group(0)!r} counts "
                    f"over {MAX_REPEAT_COUNT}; use a smaller bound or an open one ({{m,}})"
                )


def _schema(spec: str) -> object:
    """A JSON schema spec parsed; None if it is not JSON (the engine names that)."""
    try:
        return json.loads(spec)
    except (ValueError, RecursionError):
        return None


def _depth(node: object) -> int:
    """How deep ``node``'s objects and arrays nest (a scalar: 0), without recursion."""
    deepest, stack = 0, [(node, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, level)
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, level + 1) for child in children)
    return deepest


def _schema_patterns(node: object) -> Iterator[str]:
    """Every regular expression of a JSON schema: ``pattern`` values and the keys of
    ``patternProperties``, at any depth."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "pattern" and isinstance(value, str):
                yield value
            elif key == "patternProperties" and isinstance(value, dict):
                yield from (k for k in value if isinstance(k, str))
            yield from _schema_patterns(value)
    elif isinstance(node, list):
        for item in node:
            yield from _schema_patterns(item)
