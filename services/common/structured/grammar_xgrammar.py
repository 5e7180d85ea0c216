"""xgrammar as a grammar engine: formats as xgrammar ``Grammar``s, compiled per vocabulary
into grammars whose token masks are precomputed per state.

One gap of xgrammar's JSON schema converter (0.2.x) is closed here: a string bounded by
``minLength``/``maxLength`` compiles to a character class that admits raw control
characters (U+0000-U+001F but CR and LF) and no escapes, where JSON needs every control
character escaped; such an output fails a strict JSON parser. The converted grammar's text
is rewritten so that class is a JSON string character or escape
(``_json_string_classes``), and compiled from that text. The rewrite matches the text
xgrammar writes, so what the result accepts is checked once per process
(``json_strings_problem``): an xgrammar whose JSON strings still take a raw control
character, whatever the reason, gets JSON formats refused rather than served.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import re
from typing import TYPE_CHECKING, Any

from messages.errors import RequestError
from messages.sampling import StructuredOutput, StructuredOutputKind
from services.common.structured.grammar_engine import (
    JSON_MAX_WHITESPACE,
    PARSE_CACHE_SIZE,
    CompiledGrammar,
    TokenMatcher,
    Vocabulary,
    one_line,
)

if TYPE_CHECKING:
    import xgrammar

# xgrammar's C++ errors start with a timestamp and a source location, and checks with the
# condition that failed: the client needs neither
_CPP_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s+\S+:\d+:\s*")
_CHECK_FAILED = re.compile(r"Check failed: .*? is false:\s*")

# the class xgrammar writes for a length-bounded string's characters, and what it must be:
# any character but a control character, a quote or a backslash, or an escape (one
# character of the decoded string, as minLength/maxLength count)
_LENGTH_BOUNDED_CHAR = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CHAR = (
    '([^\\0-\\x1f\\"\\\\] | "\\\\" ([\\"\\\\/bfnrt] | "u" [A-Fa-f0-9] [A-Fa-f0-9] '
    "[A-Fa-f0-9] [A-Fa-f0-9]))"
)


class XGrammarEngine:
    def check(self, constraint: StructuredOutput) -> None:
        grammar_of(constraint)

    def compiler(self, vocabulary: Vocabulary) -> XGrammarCompiler:
        return XGrammarCompiler(vocabulary)


XGRAMMAR = XGrammarEngine()


def grammar_of(constraint: StructuredOutput) -> xgrammar.Grammar:
    """The grammar of ``constraint`` (cached); ``RequestError`` when its spec is not a
    valid schema, regular expression or grammar."""
    try:
        return _parse(
            StructuredOutputKind(constraint.kind), constraint.spec, constraint.any_whitespace
        )
    except RequestError:
        raise
    except Exception as exc:  # xgrammar raises RuntimeError (and ValueError) from C++
        raise RequestError(
            f"structured_output ({constraint.kind}) does not compile: {xgrammar_message(exc)}"
        ) from None


@functools.lru_cache(maxsize=PARSE_CACHE_SIZE)
def _parse(kind: StructuredOutputKind, spec: str, any_whitespace: bool) -> xgrammar.Grammar:
    import xgrammar as xgr

    if kind in (StructuredOutputKind.JSON_SCHEMA, StructuredOutputKind.JSON_OBJECT):
        problem = json_strings_problem()
        if problem is not None:
            raise RequestError(f"structured_output ({kind}) is not served: {problem}")
        return _json_grammar(kind, spec, any_whitespace)
    if kind == StructuredOutputKind.REGEX:
        return xgr.Grammar.from_regex(spec)
    if kind == StructuredOutputKind.CHOICE:
        return xgr.Grammar.from_ebnf(choice_ebnf(json.loads(spec)))
    if kind == StructuredOutputKind.GRAMMAR:
        return xgr.Grammar.from_ebnf(spec)
    if kind == StructuredOutputKind.TOOL_CALLS:
        # its auto mode needs a lexeme that ends at the first trigger, which llguidance has
        raise RequestError(
            "tool calls need the llguidance grammar engine (--structured-outputs-backend "
            "llguidance, the default)"
        )
    raise RequestError(f"structured_output kind {kind!r} is not supported")


def _json_grammar(kind: StructuredOutputKind, spec: str, any_whitespace: bool) -> xgrammar.Grammar:
    import xgrammar as xgr

    whitespace: dict[str, Any] = (
        {"any_whitespace": True, "max_whitespace_cnt": JSON_MAX_WHITESPACE}
        if any_whitespace
        else {"any_whitespace": False, "separators": (",", ":")}
    )
    if kind == StructuredOutputKind.JSON_OBJECT:
        # any object: properties beyond those named are allowed (not strict)
        grammar = xgr.Grammar.from_json_schema(
            '{"type": "object"}', strict_mode=False, **whitespace
        )
    else:
        grammar = xgr.Grammar.from_json_schema(spec, **whitespace)
    return xgr.Grammar.from_ebnf(_json_string_classes(str(grammar)))


# where a JSON string may start, as each kind of string xgrammar compiles: each prefix,
# followed by a raw control character, must be refused
_STRING_PROBES = (
    ("a length-bounded string (maxLength)", '{"type": "string", "maxLength": 4}', '"a'),
    ("a string", '{"type": "string"}', '"a'),
    (
        "a patternProperties key",
        '{"type": "object", "patternProperties": {".*": {"type": "string"}}}',
        '{"a',
    ),
    ("a string with a pattern", '{"type": "string", "pattern": "^.+$"}', '"a'),
)


@functools.cache
def json_strings_problem() -> str | None:
    """Why this xgrammar's JSON grammars (rewritten as above) are not served, or None: each
    probe is fed byte by byte through a matcher over a one-byte-per-token vocabulary, and a
    raw U+0016 after its prefix must be refused."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo(
        [bytes([b]) for b in range(256)], xgr.VocabType.RAW, vocab_size=257, stop_token_ids=[256]
    )
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    for what, schema, prefix in _STRING_PROBES:
        grammar = _json_grammar(StructuredOutputKind.JSON_SCHEMA, schema, False)
        matcher = xgr.GrammarMatcher(compiler.compile_grammar(grammar))
        if all(matcher.accept_token(byte) for byte in (prefix + "\x16").encode()):
            return (
                f"xgrammar {importlib.metadata.version('xgrammar')} lets a raw control "
                f"character into {what}, which no strict JSON parser reads; rlt needs "
                "xgrammar >= 0.2.6 (or --structured-outputs-backend llguidance)"
            )
    return None


def _json_string_classes(ebnf: str) -> str:
    """A JSON grammar's text with the length-bounded string's character class made a JSON
    string character (or escape). Literals (``"..."``, a ``Regex("...")``'s text, where
    xgrammar keeps a ``pattern``) are copied as they are, so a literal that spells the
    class is never touched."""
    out: list[str] = []
    i, n = 0, len(ebnf)
    while i < n:
        c = ebnf[i]
        if c == '"':  # a literal: up to its closing quote, escapes skipped
            j = i + 1
            while j < n and ebnf[j] != '"':
                j += 2 if ebnf[j] == "\\" else 1
            out.append(ebnf[i : j + 1])
            i = j + 1
        elif c == "[":  # a class: up to its closing bracket, escapes skipped
            j = i + 1
            while j < n and ebnf[j] != "]":
                j += 2 if ebnf[j] == "\\" else 1
            out.append(_json_string_class(ebnf[i : j + 1]))
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _json_string_class(cls: str) -> str:
    return _JSON_STRING_CHAR if cls == _LENGTH_BOUNDED_CHAR else cls


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (JSON string escapes are EBNF
    string literals; non-ASCII stays literal, so no surrogate pairs)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def xgrammar_message(exc: Exception) -> str:
    """An xgrammar error as a client may read it: without the C++ source location."""
    return one_line(_CHECK_FAILED.sub("", _CPP_PREFIX.sub("", str(exc))), type(exc).__name__)


class XGrammarCompiler:
    """xgrammar's compiler for one vocabulary (built on first use: its token table takes a
    while for a large vocabulary)."""

    def __init__(self, vocabulary: Vocabulary) -> None:
        self._vocabulary = vocabulary
        self._compiler: xgrammar.GrammarCompiler | None = None

    def compile(self, constraint: StructuredOutput) -> CompiledGrammar:
        grammar = grammar_of(constraint)
        if self._compiler is None:
            self._compiler = self._make_compiler()
        try:
            return _Compiled(self._compiler.compile_grammar(grammar))
        except Exception as exc:
            raise RequestError(
                f"structured_output ({constraint.kind}) does not compile for this "
                f"model's vocabulary: {xgrammar_message(exc)}"
            ) from None

    def _make_compiler(self) -> xgrammar.GrammarCompiler:
        import xgrammar as xgr

        vocabulary = self._vocabulary
        codec = vocabulary.codec
        if codec.is_byte_level:
            kind = xgr.VocabType.BYTE_LEVEL
        elif codec.byte_fallback:
            kind = xgr.VocabType.BYTE_FALLBACK
        else:
            kind = xgr.VocabType.RAW
        info = xgr.TokenizerInfo(
            codec.token_pieces(vocabulary.size),
            kind,
            vocab_size=vocabulary.size,
            stop_token_ids=list(vocabulary.stop_token_ids),
            add_prefix_space=codec.adds_prefix_space,
        )
        # the worker's LRU is the cache (xgrammar's own is unbounded by default)
        return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


class _Compiled:
    def __init__(self, compiled: xgrammar.CompiledGrammar) -> None:
        self.compiled = compiled
        self.memory_size_bytes = int(compiled.memory_size_bytes)

    def matcher(self) -> TokenMatcher:
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compiled)
