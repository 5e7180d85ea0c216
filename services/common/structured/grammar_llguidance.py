"""llguidance as a grammar engine: formats as llguidance grammars (its JSON schema compiler,
its regular expressions, Lark, and GBNF through its converter), matched against the
vocabulary by its lexer and Earley parser, which compute each token mask on demand.

A JSON schema keyword llguidance does not enforce (``uniqueItems``, ``not``, ``if``, an
unknown ``format``, ``oneOf`` that it would only approximate) is refused by name instead of
ignored (its compiler's strict default), so an output that finishes always validates.
"""

from __future__ import annotations

import functools
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
from services.common.structured.grammar_llguidance_tools import tool_calls_lark
from services.common.structured.tool_format import tool_call_spec

if TYPE_CHECKING:
    import llguidance
    import torch

# JSON whitespace: none between tokens (separators "," and ":"), or JSON's four blanks in
# runs of at most JSON_MAX_WHITESPACE
_COMPACT: dict[str, Any] = {"whitespace_flexible": False}
_ANY_WHITESPACE: dict[str, Any] = {
    "whitespace_pattern": f"[\\x20\\x0A\\x0D\\x09]{{0,{JSON_MAX_WHITESPACE}}}"
}
# its errors may start with a location in the grammar, and go on over lines that echo the
# grammar: the first line and the ``error:`` line (a regex's) are the client's
_LOCATION = re.compile(r"^at \d+\(\d+\):\s*")


class LLGuidanceEngine:
    def check(self, constraint: StructuredOutput) -> None:
        grammar_text(constraint)

    def compiler(self, vocabulary: Vocabulary) -> LLGuidanceCompiler:
        return LLGuidanceCompiler(vocabulary)


LLGUIDANCE = LLGuidanceEngine()


def grammar_text(constraint: StructuredOutput) -> str:
    """llguidance's grammar for ``constraint`` (cached; checked without a vocabulary);
    ``RequestError`` naming the problem when it does not compile."""
    return _grammar(
        StructuredOutputKind(constraint.kind), constraint.spec, constraint.any_whitespace
    )


@functools.lru_cache(maxsize=PARSE_CACHE_SIZE)
def _grammar(kind: StructuredOutputKind, spec: str, any_whitespace: bool) -> str:
    import llguidance as llg

    try:
        if kind == StructuredOutputKind.JSON_OBJECT:
            spec = '{"type": "object"}'
            kind = StructuredOutputKind.JSON_SCHEMA
        if kind == StructuredOutputKind.JSON_SCHEMA:
            options = _ANY_WHITESPACE if any_whitespace else _COMPACT
            grammar = llg.LLMatcher.grammar_from_json_schema(spec, overrides=options)
        elif kind == StructuredOutputKind.REGEX:
            grammar = llg.LLMatcher.grammar_from_regex(spec)
        elif kind == StructuredOutputKind.CHOICE:
            lark = "start: " + " | ".join(json.dumps(c) for c in json.loads(spec))
            grammar = llg.LLMatcher.grammar_from_lark(lark)
        elif kind == StructuredOutputKind.GRAMMAR:
            grammar = llg.grammar_from("grammar", spec)  # Lark, or GBNF converted to it
        elif kind == StructuredOutputKind.TOOL_CALLS:
            grammar = _tool_calls_grammar(spec)
        else:
            raise RequestError(f"structured_output kind {kind!r} is not supported")
        error = llg.LLMatcher.validate_grammar(grammar)
    except RequestError:
        raise
    except Exception as exc:  # a spec that is not JSON, a GBNF the converter refuses
        error = str(exc) or type(exc).__name__
    if error:
        raise RequestError(
            f"structured_output ({kind}) does not compile: {llguidance_message(error)}"
        )
    return grammar


def _tool_calls_grammar(spec: str) -> str:
    """Each function's parameters checked alone first, so a schema llguidance refuses is
    named with its function and in a json_schema format's words."""
    tools = tool_call_spec(spec)
    for i, function in enumerate(tools.functions):
        try:
            _grammar(StructuredOutputKind.JSON_SCHEMA, function.parameters, False)
        except RequestError as exc:
            raise RequestError(
                f"tools[{i}].function.parameters ({function.name}): {exc.message}"
            ) from None
    return tool_calls_lark(tools)


def llguidance_message(error: str) -> str:
    """An llguidance error as a client may read it: its first line, without a location,
    and the ``error:`` line that says what is wrong where there is one."""
    lines = error.strip().splitlines() or [""]
    said = [lines[0]] + [line for line in lines[1:] if line.strip().startswith("error:")]
    return one_line(_LOCATION.sub("", " ".join(said)), "invalid grammar")


class LLGuidanceCompiler:
    """llguidance's tokenizer for one vocabulary (built on first use: about a second for a
    large vocabulary)."""

    def __init__(self, vocabulary: Vocabulary) -> None:
        self._vocabulary = vocabulary
        self._tokenizer: llguidance.LLTokenizer | None = None

    def compile(self, constraint: StructuredOutput) -> CompiledGrammar:
        import llguidance as llg

        grammar = grammar_text(constraint)
        if self._tokenizer is None:
            vocabulary = self._vocabulary
            self._tokenizer = llg.LLTokenizer(
                vocabulary.codec.tokenizer_json(),
                n_vocab=vocabulary.size,
                eos_token=list(vocabulary.stop_token_ids),
            )
        # the parser and lexer built once here; each request's matcher is a copy
        matcher = llg.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise RequestError(
                f"structured_output ({constraint.kind}) does not compile for this model's "
                f"vocabulary: {llguidance_message(matcher.get_error())}"
            )
        return _Compiled(matcher, len(grammar))


class _Compiled:
    def __init__(self, initial: llguidance.LLMatcher, grammar_bytes: int) -> None:
        self._initial = initial
        # llguidance builds its lexer's states as masks are asked for (bounded by its
        # parser limits) and says nothing of its size: the grammar's text is what is known
        self.memory_size_bytes = grammar_bytes

    def matcher(self) -> TokenMatcher:
        return _Matcher(self._initial.deep_copy())


class _Matcher:
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher
        # per accepted token, whether llguidance counts it for rollback: a token taken once
        # the matcher has stopped (a stop token after a complete output) is not
        self._counted: list[bool] = []

    def accept_token(self, token_id: int) -> bool:
        counted = not self._matcher.is_stopped()
        # a matcher in its error state still takes a stop token: that is no complete output
        ok = self._matcher.consume_token(token_id) and not self._matcher.is_error()
        if ok:
            self._counted.append(counted)
        return ok

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > len(self._counted):
            raise ValueError(f"cannot roll back {num_tokens} of {len(self._counted)} tokens")
        undone = self._counted[len(self._counted) - num_tokens :]
        del self._counted[len(self._counted) - num_tokens :]
        if any(undone) and not self._matcher.rollback(sum(undone)):
            raise RuntimeError(f"llguidance: {self._matcher.get_error()}"[:500])

    def fill_next_token_bitmask(self, bitmask: torch.Tensor) -> None:
        # llguidance's words are xgrammar's: int32, bit i % 32 of word i // 32 for token i
        assert bitmask.is_contiguous() and bitmask.dtype.itemsize == 4
        self._matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)
        if self._matcher.is_error():
            # no next token (e.g. a language with no string at all), where llguidance
            # would offer the stop tokens
            bitmask.zero_()
