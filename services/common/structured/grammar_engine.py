"""What a grammar engine provides (``services/common/structured/grammar.py`` picks one per request):
a check of a format without a vocabulary, and a compiler bound to one checkpoint's
vocabulary whose compiled grammars start a matcher per request."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from messages.sampling import StructuredOutput

if TYPE_CHECKING:
    import torch

    from services.common.tokenizer import TextCodec

# JSON with ``any_whitespace`` takes whitespace where JSON allows it, but at most this many
# characters in a row: a model cannot spend its max_tokens on blanks between two tokens
JSON_MAX_WHITESPACE = 16
# parsed grammars kept per process and engine (a bound on memory: each spec <= 64 KiB)
PARSE_CACHE_SIZE = 256


class TokenMatcher(Protocol):
    """One output's position in its grammar."""

    def accept_token(self, token_id: int) -> bool:
        """Advances by ``token_id``; False when the grammar does not allow it."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last ``num_tokens`` accepted tokens (a speculative cycle's drafts)."""
        ...

    def fill_next_token_bitmask(self, bitmask: torch.Tensor) -> None:
        """Writes the allowed next tokens into ``bitmask`` (int32 [1, words], bit ``i % 32``
        of word ``i // 32`` for token ``i``): the stop tokens exactly when the output is
        complete."""
        ...


class CompiledGrammar(Protocol):
    """A format compiled against one vocabulary: what each request's matcher starts from."""

    @property
    def memory_size_bytes(self) -> int: ...

    def matcher(self) -> TokenMatcher: ...


class GrammarCompiler(Protocol):
    """An engine bound to one checkpoint's vocabulary."""

    def compile(self, constraint: StructuredOutput) -> CompiledGrammar:
        """``RequestError`` naming the problem when ``constraint`` does not compile."""
        ...


class GrammarEngine(Protocol):
    def check(self, constraint: StructuredOutput) -> None:
        """``RequestError`` naming the problem when ``constraint`` does not compile."""
        ...

    def compiler(self, vocabulary: Vocabulary) -> GrammarCompiler: ...


@dataclasses.dataclass(frozen=True)
class Vocabulary:
    """What an engine compiles against: the checkpoint's tokenizer, the model's vocabulary
    size (masks cover every id the lm_head scores, which may be more than the tokenizer
    has) and the stop tokens a complete output may end with."""

    codec: TextCodec
    size: int
    stop_token_ids: Sequence[int]


def one_line(text: str, fallback: str) -> str:
    """An engine's error as a client may read it: one line, bounded."""
    return " ".join(text.split())[:500] or fallback
