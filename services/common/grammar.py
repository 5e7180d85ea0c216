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
from services.common.grammar_engine import GrammarEngine

# a counted repetition ``{m,n}`` in a regular expression (a regex format, a JSON schema's
# ``pattern``, a grammar) may not go over this: xgrammar's parse grows with the square of
# the count (0.14 s at 1000, ~1 min at 20000) and would stall admission and the worker;
# one rule for both engines, so a format's validity does not depend on the server
MAX_REPEAT_COUNT = 1000
_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def engine(backend: StructuredOutputsBackend) -> GrammarEngine:
    """The grammar engine ``backend`` names (imported on first use)."""
    if backend == StructuredOutputsBackend.LLGUIDANCE:
        from services.common.grammar_llguidance import LLGUIDANCE

        return LLGUIDANCE
    if backend == StructuredOutputsBackend.XGRAMMAR:
        from services.common.grammar_xgrammar import XGRAMMAR

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
    check_repeats(constraint)
    engine(backend_of(constraint)).check(constraint)


def check_repeats(constraint: StructuredOutput) -> None:
    """Counted repetitions are checked before an engine spends its time on them."""
    kind = StructuredOutputKind(constraint.kind)
    if kind == StructuredOutputKind.JSON_SCHEMA:
        texts = _schema_texts(constraint.spec)
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


def _schema_texts(spec: str) -> list[str]:
    """The regular expressions of a JSON schema spec; none if it is not JSON (the engine
    names that)."""
    try:
        return list(_schema_patterns(json.loads(spec)))
    except (ValueError, RecursionError):
        return []


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
