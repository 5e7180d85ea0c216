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

    if kind == StructuredOutputKind.JSON_SCHEMA:
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
        return xgr.Grammar.from_regex(spec)
    if kind == StructuredOutputKind.CHOICE:
        return xgr.Grammar.from_ebnf(choice_ebnf(json.loads(spec)))
    if kind == StructuredOutputKind.GRAMMAR:
        return xgr.Grammar.from_ebnf(spec)
    raise RequestError(f"structured_output kind {kind!r} is not supported")


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (JSON string escapes are EBNF
    string literals; non-ASCII stays literal, so no surrogate pairs)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def xgrammar_message(exc: Exception) -> str:
    """An xgrammar error as a client may read it: without the C++ source location."""
    text = _CHECK_FAILED.sub("", _CPP_PREFIX.sub("", str(exc))).strip()
    return " ".join(text.split())[:500] or type(exc).__name__
