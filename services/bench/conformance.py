"""Structured outputs' conformance, measured without a model: JSON schemas with valid and
invalid instances (JSONSchemaBench's MaskBench cases) run through the worker's own grammar
path (``GrammarBook``, ``RequestGrammar``) against a checkpoint's tokenizer.

Each instance is serialised as the engine lets a model write it (compact by default: no
whitespace, separators "," and ":"; with ``any_whitespace`` the separators ", " and ": "),
tokenized, and fed token by token: every token must be allowed by the mask the worker
would apply, then accepted; at the end a stop token must be allowed. A valid instance that
is refused somewhere is over-constraining; an invalid one that gets to its stop token is
under-constraining. A schema the engine refuses to compile (a 400 naming the feature) has
no outcomes. Beside the cases' own instances, each valid instance is probed once more with
a raw control character (U+0016) in place of a string's first character: no JSON parser
reads that, so it must be refused too.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from messages.errors import RequestError
from messages.sampling import StructuredOutput, StructuredOutputsBackend
from services.common.tokenizer import TextCodec
from services.worker.sampling.grammar import BITS, GrammarBook, RequestGrammar

# the raw control character probes put in a string (its escaped form must not be in the text)
PROBE_CHARACTER = "\x16"
# probes per valid instance (the first strings in document order)
PROBES_PER_INSTANCE = 3


@dataclass(frozen=True)
class Instance:
    description: str
    valid: bool
    data: object


@dataclass(frozen=True)
class SchemaCase:
    """One file: a schema (JSON text, key order kept), its features and its instances."""

    name: str
    features: tuple[str, ...]
    schema: str
    instances: tuple[Instance, ...]


def load_cases(folder: Path) -> list[SchemaCase]:
    """Every ``*.json`` case in ``folder`` (``{"meta": {"features"}, "schema", "tests"}``),
    by file name."""
    cases = []
    for path in sorted(folder.glob("*.json")):
        raw = json.loads(path.read_text(encoding="utf-8"))
        instances = tuple(
            Instance(str(t.get("description", "")), bool(t["valid"]), t["data"])
            for t in raw["tests"]
        )
        features = tuple(raw.get("meta", {}).get("features", ()))
        schema = json.dumps(raw["schema"], separators=(",", ":"), ensure_ascii=False)
        cases.append(SchemaCase(path.stem, features, schema, instances))
    return cases


def serialise(data: object, any_whitespace: bool) -> str:
    """``data`` as the engine lets a model write it (UTF-8 as is, never ``\\u`` escaped)."""
    separators = (", ", ": ") if any_whitespace else (",", ":")
    return json.dumps(data, separators=separators, ensure_ascii=False)


def control_character_probes(data: object, any_whitespace: bool) -> Iterator[str]:
    """``data`` serialised with a raw control character as the first character of one of its
    string values (keys stay), for its first ``PROBES_PER_INSTANCE`` non-empty strings."""
    escaped = json.dumps(PROBE_CHARACTER)[1:-1]  # "\\u0016"
    if escaped in serialise(data, any_whitespace):
        return
    for path in list(_string_paths(data, ()))[:PROBES_PER_INSTANCE]:
        probed = _replaced(data, path)
        yield serialise(probed, any_whitespace).replace(escaped, PROBE_CHARACTER, 1)


def _string_paths(node: object, at: tuple[object, ...]) -> Iterator[tuple[object, ...]]:
    if isinstance(node, str) and node:
        yield at
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from _string_paths(value, (*at, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _string_paths(value, (*at, i))


def _replaced(node: object, path: tuple[object, ...]) -> object:
    if not path:
        assert isinstance(node, str)
        return PROBE_CHARACTER + node[1:]
    head, rest = path[0], path[1:]
    if isinstance(node, dict):
        return {k: _replaced(v, rest) if k == head else v for k, v in node.items()}
    assert isinstance(node, list) and isinstance(head, int)
    return [_replaced(v, rest) if i == head else v for i, v in enumerate(node)]


@dataclass
class Run:
    """One text fed through a request's grammar: ``refused_at`` is the index of the first
    token the mask did not allow (the text's length in tokens: its stop token), or None
    when the text got to its stop token."""

    text: str
    num_tokens: int
    refused_at: int | None
    mask_seconds: list[float] = field(default_factory=list)

    @property
    def accepted(self) -> bool:
        return self.refused_at is None


@dataclass
class CaseResult:
    case: SchemaCase
    refusal: str | None  # why the schema did not compile (None: it did)
    compile_seconds: float
    valid: list[Run] = field(default_factory=list)
    invalid: list[Run] = field(default_factory=list)
    probes: list[Run] = field(default_factory=list)

    @property
    def over(self) -> list[Run]:
        return [r for r in self.valid if not r.accepted]

    @property
    def under(self) -> list[Run]:
        return [r for r in self.invalid if r.accepted]

    @property
    def probes_accepted(self) -> list[Run]:
        return [r for r in self.probes if r.accepted]


class ConformanceRun:
    """One engine (and whitespace setting) against one vocabulary."""

    def __init__(
        self,
        codec: TextCodec,
        vocab_size: int,
        stop_token_ids: list[int],
        backend: StructuredOutputsBackend,
        any_whitespace: bool = False,
    ) -> None:
        self.codec = codec
        self.backend = backend
        self.any_whitespace = any_whitespace
        # every compile is new (no cache hits between cases), one at a time
        self.book = GrammarBook(codec, vocab_size, stop_token_ids, cache_size=1)
        self.stop_token_ids = stop_token_ids
        self._mask = np.zeros(self.book.words, dtype=np.int32)

    def warm_up(self) -> None:
        """Imports the engine and builds its view of the vocabulary, so that no compile
        time below counts them."""
        self.book.compile(self._constraint('{"type": "integer"}')).result()

    def run_case(self, case: SchemaCase) -> CaseResult:
        constraint = self._constraint(case.schema)
        start = time.perf_counter()
        compiled = self.book.compile(constraint)
        try:
            compiled.result()
        except RequestError as exc:
            return CaseResult(case, exc.message, time.perf_counter() - start)
        result = CaseResult(case, None, time.perf_counter() - start)
        for instance in case.instances:
            text = serialise(instance.data, self.any_whitespace)
            (result.valid if instance.valid else result.invalid).append(self.feed(compiled, text))
            if instance.valid:
                for probe in control_character_probes(instance.data, self.any_whitespace):
                    result.probes.append(self.feed(compiled, probe))
        return result

    def feed(self, compiled: object, text: str) -> Run:
        """``text`` token by token through a new request's grammar, then a stop token."""
        tokens = self.codec.encode(text)
        grammar = RequestGrammar(self.book, compiled, [])  # type: ignore[arg-type]
        run = Run(text, len(tokens), None)
        for index, token in enumerate([*tokens, None]):
            start = time.perf_counter()
            filled = grammar.fill_mask(self._mask)
            run.mask_seconds.append(time.perf_counter() - start)
            allowed = self.stop_token_ids if token is None else [token]
            chosen = next((t for t in allowed if filled and self._allows(t)), None)
            if chosen is None:
                run.refused_at = index
                return run
            problem = grammar.accept(chosen, index)
            # the mask allowed it, so the matcher must take it: anything else is a bug here
            assert problem is None, (problem, text[:200])
        assert grammar.ended
        return run

    def _allows(self, token: int) -> bool:
        return bool((int(self._mask[token // BITS]) >> (token % BITS)) & 1)

    def _constraint(self, schema: str) -> StructuredOutput:
        return StructuredOutput(
            kind="json_schema",
            spec=schema,
            backend=self.backend,
            any_whitespace=self.any_whitespace,
        )

    def close(self) -> None:
        self.book.close()
