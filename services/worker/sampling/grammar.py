"""Structured outputs on the worker: compiled grammars, each constrained request's matcher,
and the token masks a pass applies to its coda rows' logits before sampling.

A request's matcher (its grammar engine's, ``services/common/structured/grammar.py``) has accepted
exactly the tokens the request generated: it is built from the compiled grammar and the
generated tokens its ``NewRequest`` carries (on admission none; after a preemption, a
worker loss or a move to another shard all that are known), then advances by each token
the worker samples for it. The request names its engine, so every worker it runs on
rebuilds the same state. The mask of its next token is filled on the host once per token
(a pass may plan the coda of a row that does not exit yet), sent with the pass's other
masks in one copy, and applied on the device. The stop tokens (the model's EOS ids) are
allowed exactly when the output is complete, and nothing else is then: so the
scheduler's EOS rule ends the request when the grammar ends.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Protocol

import msgspec
import numpy as np
import torch

from messages.errors import RequestError
from messages.sampling import StructuredOutput, StructuredOutputsBackend
from services.common.structured.grammar import backend_of, check_bounds, engine
from services.common.structured.grammar_engine import (
    CompiledGrammar,
    GrammarCompiler,
    TokenMatcher,
    Vocabulary,
)
from services.common.tokenizer import TextCodec

# compiled grammars kept per worker: compiling is the expensive part (xgrammar precomputes
# token masks per grammar state; llguidance builds its lexer), so a service answering one
# schema compiles it once
COMPILED_CACHE_SIZE = 128
# ...and at most this many bytes of them (a large schema against a 150k vocabulary compiles
# to tens of MB with xgrammar)
COMPILED_CACHE_BYTES = 1 << 30
# the most a pass waits for a request's grammar to compile: past it that request fails and
# the pass goes on (a thread cannot be stopped, so a pathological format costs this once)
COMPILE_WAIT_S = 10.0
BITS = 32  # token ids per bitmask word (the engines' int32 bitmask)


def mask_words(vocab_size: int) -> int:
    return -(-vocab_size // BITS)


class GrammarBook:
    """The checkpoint's vocabulary and the grammars compiled for it, by format (kind, spec,
    whitespace and engine) in an LRU. Compiling runs on a thread of its own: a new schema
    compiles while its request's prompt is prefilled. ``backend``: the engine of a format
    that names none."""

    def __init__(
        self,
        codec: TextCodec,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        cache_size: int = COMPILED_CACHE_SIZE,
        cache_bytes: int = COMPILED_CACHE_BYTES,
        backend: StructuredOutputsBackend | None = None,
    ) -> None:
        # the model's vocabulary: the masks cover every id the lm_head can score, which may be
        # more than the tokenizer has (padded vocabularies)
        self.vocab_size = vocab_size
        self.words = mask_words(vocab_size)
        self.stop_token_ids = tuple(stop_token_ids)
        # the matcher ends exactly when it accepts one of these (a set: asked per token)
        self.stop_set = frozenset(self.stop_token_ids)
        self.backend = backend
        self._vocabulary = Vocabulary(codec, vocab_size, self.stop_token_ids)
        self._cache_size = cache_size
        self._cache_bytes = cache_bytes
        self._cache: OrderedDict[StructuredOutput, Future[CompiledGrammar]] = OrderedDict()
        self._sizes: dict[StructuredOutput, int] = {}  # of the compiled entries
        self._bytes = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rlt-grammar")
        # made on first use, on the compile thread: importing an engine takes seconds
        self._compilers: dict[StructuredOutputsBackend, GrammarCompiler] = {}
        # what a request whose output is complete may still be sent: its stop tokens
        self.stop_mask = torch.zeros(self.words, dtype=torch.int32)
        for token in self.stop_token_ids:
            if token < vocab_size:
                self.stop_mask[token // BITS] |= _bit(token % BITS)

    @property
    def compiling(self) -> bool:
        """Whether some grammar is still compiling (a pass may wait for it)."""
        with self._lock:
            return any(not compiled.done() for compiled in self._cache.values())

    def compile(self, constraint: StructuredOutput) -> Future[CompiledGrammar]:
        """The compiled grammar of ``constraint`` (a future: it may still be compiling). A
        spec that does not compile fails the future with ``RequestError``."""
        if constraint.backend is None and self.backend is not None:
            constraint = msgspec.structs.replace(constraint, backend=self.backend)
        key = constraint
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
            compiled = self._pool.submit(self._compile, constraint)
            self._cache[key] = compiled
            self._evict(keep=key)
        # outside the lock: a future already done runs its callback here, which takes it
        compiled.add_done_callback(lambda done, key=key: self._compiled(key, done))
        return compiled

    def _compiled(self, key: StructuredOutput, done: Future[CompiledGrammar]) -> None:
        """Counts a compiled grammar's bytes; forgets a compile that crashed (not a spec's
        fault, e.g. out of memory), so the next request with it tries again."""
        with self._lock:
            if self._cache.get(key) is not done:
                return  # evicted meanwhile
            exc = done.exception()
            if exc is not None and not isinstance(exc, RequestError):
                del self._cache[key]
                return
            size = 0 if exc is not None else int(done.result().memory_size_bytes)
            self._sizes[key] = size
            self._bytes += size
            self._evict(keep=key)

    def _evict(self, keep: StructuredOutput) -> None:
        """Least recently used first, never ``keep`` (its request is about to use it)."""
        while len(self._cache) > 1 and (
            len(self._cache) > self._cache_size or self._bytes > self._cache_bytes
        ):
            oldest = next(iter(self._cache))
            if oldest == keep:
                self._cache.move_to_end(keep)
                continue
            del self._cache[oldest]
            self._bytes -= self._sizes.pop(oldest, 0)

    def _compile(self, constraint: StructuredOutput) -> CompiledGrammar:
        constraint.validate()
        check_bounds(constraint)
        backend = backend_of(constraint)
        compiler = self._compilers.get(backend)
        if compiler is None:
            compiler = self._compilers[backend] = engine(backend).compiler(self._vocabulary)
        return compiler.compile(constraint)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class RequestGrammar:
    """One request's grammar state: its matcher, built when first needed from the compiled
    grammar and the tokens the request had generated, and the mask of its next token."""

    def __init__(
        self,
        book: GrammarBook | None,
        compiled: Future[CompiledGrammar] | None,
        generated: Sequence[int],
    ) -> None:
        self._book = book
        self._stop_set = book.stop_set if book is not None else frozenset()
        self._compiled = compiled
        self._generated = list(generated)
        self._matcher: TokenMatcher | None = None
        self.num_accepted = 0  # tokens of the output the matcher has accepted
        self.ended = False  # it accepted a stop token: the output is complete
        # a speculative cycle's draft tokens past the accepted ones, in order, each with
        # whether the matcher advanced by it (not after a drafted stop token): the
        # matcher's state is the accepted tokens' and then these
        self._drafts: list[tuple[int, bool]] = []
        self._drafts_ended = False  # a drafted stop token ended the output
        self._moves = 0  # counts the matcher's state changes (the mask cache's key)
        self.error: str | None = None  # why this request's tokens cannot be constrained
        if book is None:
            self.error = (
                "structured outputs need the checkpoint's tokenizer, and this worker has none"
            )
        # the next token's mask, int32 [1, words] (the engine fills a tensor; the pass buffer
        # copies it through a numpy view), valid while ``_moves == _mask_at``
        self._mask: torch.Tensor | None = None
        self._mask_words: np.ndarray | None = None
        self._mask_at = -1

    def _ready(self) -> TokenMatcher | None:
        """The matcher (waiting for its grammar to compile); None once ``error`` is set."""
        if self.error is not None:
            return None
        if self._matcher is not None:
            return self._matcher
        assert self._compiled is not None
        try:
            matcher = self._compiled.result(timeout=COMPILE_WAIT_S).matcher()
        except RequestError as exc:
            self.error = exc.message
            return None
        except FutureTimeout:
            self.error = (
                f"structured output: the format did not compile within {COMPILE_WAIT_S:g} s "
                "on the worker; simplify it"
            )
            return None
        except Exception as exc:  # e.g. the vocabulary could not be read: this request fails
            self.error = f"structured output unavailable: {exc!r}"[:500]
            return None
        for index, token in enumerate(self._generated):
            if self.ended or not matcher.accept_token(token):
                self.error = (
                    f"structured output: generated token {index} (id {token}) does not follow "
                    "the format"
                )
                return None
            self.ended = token in self._stop_set
        self.num_accepted = len(self._generated)
        self._matcher = matcher
        return matcher

    def fill_mask(self, out: np.ndarray) -> bool:
        """Writes the next token's bitmask into ``out`` (int32 [words]). False when the
        grammar failed: the row samples unconstrained and fails when its token comes back."""
        matcher = self._ready()
        if matcher is None:
            return False
        if self._mask_at != self._moves:
            assert self._book is not None
            if self._mask is None:
                self._mask = torch.empty((1, self._book.words), dtype=torch.int32)
                self._mask_words = self._mask.numpy()[0]
            if self._drafts_ended if self._drafts else self.ended:
                # the output ended with a stop token, so the request has ended: this is a
                # follow-on row sent before the scheduler knew, and its token is dropped
                self._mask[0] = self._book.stop_mask
            else:
                matcher.fill_next_token_bitmask(self._mask)
                if not self._mask_words.any():  # type: ignore[union-attr]
                    # a language with no next token (e.g. an empty regex class): fail with
                    # that, not with whatever an all -inf row samples
                    self.error = "structured output: the format allows no next token"
                    return False
            self._mask_at = self._moves
        out[:] = self._mask_words
        return True

    def speculate(self, token: int) -> str | None:
        """Advances by a draft token past the accepted ones (the next draft position's mask
        is then ``fill_mask``'s); None, or why the draft cannot follow the format."""
        matcher = self._ready()
        if matcher is None:
            return self.error
        if self._drafts_ended if self._drafts else self.ended:
            self._drafts.append((token, False))  # past the output's end: never committed
            return None
        if not matcher.accept_token(token):
            return f"structured output: draft token {token} does not follow the format"
        self._drafts.append((token, True))
        self._drafts_ended = token in self._stop_set
        self._moves += 1
        return None

    def position_mask(self) -> PositionMask:
        """The next token's mask as it is now (a copy: the matcher moves on with drafts)."""
        if self._book is None:
            return PositionMask(None)
        words = np.empty(self._book.words, dtype=np.int32)
        return PositionMask(words if self.fill_mask(words) else None)

    def rollback(self) -> None:
        """Back to the accepted tokens' state: the drafts are gone."""
        advanced = sum(1 for _, moved in self._drafts if moved)
        if advanced:
            assert self._matcher is not None
            self._matcher.rollback(advanced)
            self._moves += 1
        self._drafts.clear()
        self._drafts_ended = False

    def commit(self, token: int, output_index: int) -> str | None:
        """A speculative cycle committed ``token`` as output ``output_index``: the first
        draft if it is that token (the matcher has advanced by it already), else the drafts
        roll back and the token is accepted. None, or why the row fails."""
        if self._drafts and self._drafts[0][0] == token and not self.ended:
            if output_index != self.num_accepted:
                return self.accept(token, output_index)  # out of step: says so
            self._drafts.pop(0)
            self.num_accepted += 1
            self.ended = token in self._stop_set
            return None
        self.rollback()
        return self.accept(token, output_index)

    def accept(self, token: int, output_index: int) -> str | None:
        """Advances by ``token``, the request's output ``output_index``. None when the
        output goes on; else why this row fails."""
        matcher = self._ready()
        if matcher is None:
            return self.error
        if self.ended:
            return None  # a row after the request's end (see fill_mask): never applied
        if output_index != self.num_accepted:
            return (
                f"structured output out of step: token {output_index} was sampled, the "
                f"grammar has accepted {self.num_accepted}"
            )
        if not matcher.accept_token(token):
            return f"structured output: token {token} does not follow the format"
        self.num_accepted += 1
        self.ended = token in self._stop_set
        self._moves += 1
        return None


@dataclass
class PassMasks:
    """The token masks of one pass on the device: ``count`` coda row indices, then their
    bitmasks (int32 [count, words]), in one buffer. ``every_row``: the pass's coda rows are
    exactly rows 0..count-1, so no gather is needed."""

    count: int
    words: torch.Tensor
    every_row: bool = False

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [C, V] with the ids each masked row's grammar forbids at -inf (a new
        tensor: the log-probabilities a request asks for stay the model's own). Each mask
        byte looks up its 8 tokens' penalties (0 or -inf), which are added: a few kernels
        whatever the vocabulary, where unpacking bit by bit costs ~10x on a CPU."""
        count, vocab = self.count, logits.shape[-1]
        mask_bytes = self.words[count:].view(torch.uint8).view(count, -1).int()
        table = _byte_penalties(logits.dtype, logits.device)
        penalty = torch.nn.functional.embedding(mask_bytes, table).view(count, -1)[:, :vocab]
        if self.every_row:
            return logits + penalty
        return logits.index_add(0, self.words[:count].long(), penalty)


class MaskSource(Protocol):
    def fill_mask(self, out: np.ndarray) -> bool: ...


class PositionMask:
    """A speculative position's mask, taken while its grammar state was the matcher's (the
    matcher moves on with the drafts after it). ``words`` None: the grammar failed."""

    def __init__(self, words: np.ndarray | None) -> None:
        self.words = words

    def fill_mask(self, out: np.ndarray) -> bool:
        if self.words is None:
            return False
        out[:] = self.words
        return True


def fill_pass_masks(
    host_words: np.ndarray, rows: list[tuple[int, MaskSource]], words_per_mask: int
) -> None:
    """Fills ``host_words`` (``len(rows) * (1 + words_per_mask)`` int32 words, a
    ``PassMasks`` buffer) with the coda row index and the mask of each (coda row, grammar)."""
    count = len(rows)
    masks = host_words[count:].reshape(count, words_per_mask)
    for i, (coda_row, grammar) in enumerate(rows):
        host_words[i] = coda_row
        if not grammar.fill_mask(masks[i]):
            masks[i] = -1  # every id: the row fails when its token comes back


_PENALTIES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _byte_penalties(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 8]: for each byte value, 0 where bit j is set (token allowed), -inf where not
    (little-endian words: a word's first byte holds its first 8 tokens). Made once."""
    key = (dtype, device)
    table = _PENALTIES.get(key)
    if table is None:
        bits = (torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1
        table = torch.zeros(256, 8).masked_fill(bits == 0, float("-inf"))
        table = _PENALTIES[key] = table.to(dtype=dtype, device=device)
    return table


def _bit(position: int) -> int:
    """The int32 word with bit ``position`` set (bit 31 is the sign bit)."""
    return int(np.array(1 << position, dtype=np.uint32).view(np.int32))
