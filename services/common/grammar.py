"""Structured outputs' grammars: a request's ``StructuredOutput`` as an xgrammar ``Grammar``.

This is the one rule for what a format means and whether it is valid: admission checks a
request with it (a 400 that names the problem), the in-process engine when a request is
added, and the worker compiles what it returns against the checkpoint's vocabulary
(``services/worker/grammar.py``). Grammars are never written by hand here: JSON schemas,
regular expressions and EBNF are xgrammar's own converters and parser.

xgrammar imports torch, which only the worker loads at start-up (admission and the gateway
start in a fraction of the memory without it), so it is imported on the first request that
carries a format, never at import time. Admission runs that first check off its event loop.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

from messages.errors import RequestError
from messages.sampling import StructuredOutput, StructuredOutputKind

if TYPE_CHECKING:
    import xgrammar

# JSON outputs take whitespace where JSON allows it (models indent), but at most this many
# characters in a row: a model cannot spend its max_tokens on blanks between two tokens
JSON_MAX_WHITESPACE = 16
# parsed grammars kept per process (a bound on memory: each spec is at most 64 KiB)
PARSE_CACHE_SIZE = 256

# a counted repetition ``{m,n}`` in a regular expression (a regex format, a JSON schema's
# ``pattern``, an EBNF grammar) may not go over this: xgrammar's parse grows with the square
# of the count (0.14 s at 1000, ~1 min at 20000) and would stall admission and the worker
MAX_REPEAT_COUNT = 1000
_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")

# xgrammar's C++ errors start with a timestamp and a source location, and checks with the
# condition that failed: the client needs neither
_CPP_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s+\S+:\d+:\s*")
_CHECK_FAILED = re.compile(r"Check failed: .*? is false:\s*")


def check_structured_output(constraint: StructuredOutput) -> None:
    """Raises ``RequestError`` naming the problem when ``constraint`` does not compile."""
    grammar_of(constraint)


def grammar_of(constraint: StructuredOutput) -> xgrammar.Grammar:
    """The grammar of ``constraint`` (cached by kind and spec); ``RequestError`` when its
    spec is not a valid schema, regular expression or grammar."""
    constraint.validate()
    try:
        return _parse(StructuredOutputKind(constraint.kind), constraint.spec)
    except RequestError:
        raise
    except Exception as exc:  # xgrammar raises RuntimeError (and ValueError) from C++
        raise RequestError(
            f"structured_output ({constraint.kind}) does not compile: {xgrammar_message(exc)}"
        ) from None


@functools.lru_cache(maxsize=PARSE_CACHE_SIZE)
def _parse(kind: StructuredOutputKind, spec: str) -> xgrammar.Grammar:
    import xgrammar as xgr

    # counted repetitions are checked before xgrammar spends its quadratic time on them
    if kind == StructuredOutputKind.JSON_SCHEMA:
        _check_repeats(kind, _schema_texts(spec))
        return xgr.Grammar.from_json_schema(
            spec, any_whitespace=True, max_whitespace_cnt=JSON_MAX_WHITESPACE
        )
    if kind == StructuredOutputKind.JSON_OBJECT:
        # any object: properties beyond those named are allowed (not strict)
        return xgr.Grammar.from_json_schema(
            '{"type": "object"}',
            any_whitespace=True,
            max_whitespace_cnt=JSON_MAX_WHITESPACE,
            strict_mode=False,
        )
    if kind == StructuredOutputKind.REGEX:
        _check_repeats(kind, [spec])
        return xgr.Grammar.from_regex(spec)
    if kind == StructuredOutputKind.CHOICE:
        return xgr.Grammar.from_ebnf(choice_ebnf(json.loads(spec)))
    if kind == StructuredOutputKind.GRAMMAR:
        _check_repeats(kind, [spec])
        return xgr.Grammar.from_ebnf(spec)
    raise RequestError(f"structured_output kind {kind!r} is not supported")


def _schema_texts(spec: str) -> list[str]:
    """The regular expressions of a JSON schema spec; none if it is not JSON (the parse
    names that)."""
    try:
        return list(_schema_patterns(json.loads(spec)))
    except ValueError:
        return []


def _check_repeats(kind: StructuredOutputKind, texts: list[str]) -> None:
    for text in texts:
        for match in _REPEAT.finditer(text):
            counts = [int(c) for c in match.groups() if c]
            if max(counts) > MAX_REPEAT_COUNT:
                raise RequestError(
                    f"structured_output ({kind}): the repetition {match.group(0)!r} counts "
                    f"over {MAX_REPEAT_COUNT}; use a smaller bound or an open one ({{m,}})"
                )


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


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (JSON string escapes are EBNF
    string literals; non-ASCII stays literal, so no surrogate pairs)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def xgrammar_message(exc: Exception) -> str:
    """An xgrammar error as a client may read it: without the C++ source location."""
    text = _CHECK_FAILED.sub("", _CPP_PREFIX.sub("", str(exc))).strip()
    return " ".join(text.split())[:500] or type(exc).__name__
