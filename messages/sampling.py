"""Per-request sampling and exit parameters (the part of a request every service sees)."""

from __future__ import annotations

import json
import math
from enum import StrEnum

import msgspec

from messages.errors import RequestError


class RequestDefaults(msgspec.Struct, frozen=True, kw_only=True):
    """What a request that leaves a field unset gets: the API's own defaults, replaced per
    checkpoint by its generation_config.json and config.json (``early_exit_threshold``)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    exit_threshold: float = 1.0


API_DEFAULTS = RequestDefaults()

# Sampling runs in float32 (services/common/sampling.py). Below these, a value cannot be
# computed there: logits / temperature overflows to inf once |logit| > 3.4e38 * temperature
# (NaN probabilities), and a top_p under float32's smallest normal number rounds to 0, which
# would drop every token. Both only ever mean "greedy": use temperature 0 for that.
MIN_TEMPERATURE = 1e-4
MIN_TOP_P = 1.2e-38
# the most alternatives a token may come with (``logprobs``), as vLLM's default max_logprobs
MAX_LOGPROBS = 20


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM-like sampling knobs plus the looped-model exit policy.

    ``None`` means "unset": ``resolve`` fills it from the model's ``RequestDefaults``
    (``max_loops=None`` becomes the model's total_ut_steps). A value the request sets always
    wins. ``top_k=0`` and ``top_p=1.0`` disable those filters; ``temperature=0`` is greedy.
    """

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    min_loops: int = 2
    max_loops: int | None = None
    exit_threshold: float | None = None
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    priority: int = 0
    # the output must follow this format (JSON schema, regex, choice, grammar); None: free
    structured_output: StructuredOutput | None = None
    # with each generated token, its log-probability and those of the ``logprobs`` most
    # likely tokens (0: the token's own only); None: no log-probabilities
    logprobs: int | None = None
    # the same for every prompt token after the first (the model's prediction of it from
    # the tokens before), sent with the first generated token; such a request computes its
    # whole prompt (no prefix-cache hit), as in vLLM
    prompt_logprobs: int | None = None
    # under overload (``--overload-policy shed-depth``) the scheduler may cap this request's
    # generated tokens at fewer loops than ``max_loops`` (never below ``min_loops``); false
    # keeps its full depth whatever the load
    shed_depth: bool = True
    # token-sparse prefill (docs/sparse_prefill.md): late loops run only the prompt tokens
    # whose hidden state still moves; None: the server's default (off unless it was started
    # with --token-sparse-prefill). It changes outputs, and needs every prompt position's
    # full-depth state for nothing, so it cannot be combined with prompt_logprobs
    token_sparse_prefill: bool | None = None
    # with it, each loop's retention (one entry per loop, in (0, 1], the first 1); None: the
    # server's. Given without token_sparse_prefill it turns it on
    prefill_retention: list[float] | None = None
    # self-speculative decoding where the server runs it (docs/speculative.md); false opts
    # this request out (its tokens are the same either way)
    speculative: bool = True

    def validate(self) -> None:
        """Model-independent range checks of the fields that are set; raises RequestError."""
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, lo=1, hi=2**31 - 1)
        if self.temperature is not None and (
            not math.isfinite(self.temperature) or self.temperature < 0
        ):
            raise RequestError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.temperature is not None and 0 < self.temperature < MIN_TEMPERATURE:
            raise RequestError(
                f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, got "
                f"{self.temperature} (smaller values overflow float32 sampling)"
            )
        if self.top_p is not None and not (MIN_TOP_P <= self.top_p <= 1.0):
            raise RequestError(
                f"top_p must be in [{MIN_TOP_P}, 1] (float32 sampling), got {self.top_p}"
            )
        if self.top_k is not None:
            _check_int("top_k", self.top_k, lo=0, hi=2**31 - 1)
        if self.seed is not None:
            _check_int("seed", self.seed, lo=0, hi=2**63 - 1)
        _check_int("min_loops", self.min_loops, lo=1, hi=2**31 - 1)
        if self.max_loops is not None:
            _check_int("max_loops", self.max_loops, lo=1, hi=2**31 - 1)
            if self.min_loops > self.max_loops:
                raise RequestError(
                    f"min_loops ({self.min_loops}) must not exceed max_loops ({self.max_loops})"
                )
        if self.exit_threshold is not None and not (0.0 <= self.exit_threshold <= 1.0):
            raise RequestError(f"exit_threshold must be in [0, 1], got {self.exit_threshold}")
        for tok in self.stop_token_ids:
            _check_int("stop_token_ids entry", tok, lo=0, hi=2**31 - 1)
        _check_int("priority", self.priority, lo=-(2**31), hi=2**31 - 1)
        if self.structured_output is not None:
            self.structured_output.validate()
            if self.ignore_eos:
                raise RequestError(
                    "ignore_eos cannot be combined with structured_output: the output ends "
                    "when it completes the format"
                )
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, lo=0, hi=MAX_LOGPROBS)
        if not isinstance(self.speculative, bool):
            raise RequestError(f"speculative must be true or false, got {self.speculative!r}")
        if not isinstance(self.shed_depth, bool):
            raise RequestError(f"shed_depth must be true or false, got {self.shed_depth!r}")
        self._validate_sparse_prefill()

    def _validate_sparse_prefill(self) -> None:
        sparse = self.token_sparse_prefill
        if sparse is not None and not isinstance(sparse, bool):
            raise RequestError(f"token_sparse_prefill must be true or false, got {sparse!r}")
        retention = self.prefill_retention
        if retention is not None:
            check_retention(retention, "prefill_retention")
            if sparse is False:
                raise RequestError(
                    "prefill_retention needs token_sparse_prefill (it was set to false)"
                )
        if self.wants_sparse_prefill is True and self.prompt_logprobs is not None:
            raise RequestError(
                "token_sparse_prefill cannot be combined with prompt_logprobs: frozen prompt "
                "tokens never run their late loops"
            )

    @property
    def wants_sparse_prefill(self) -> bool | None:
        """What the request itself asks: True/False, or None to take the server's default."""
        if self.token_sparse_prefill is None and self.prefill_retention is not None:
            return True
        return self.token_sparse_prefill

    def resolve(
        self, total_ut_steps: int, vocab_size: int, defaults: RequestDefaults = API_DEFAULTS
    ) -> SamplingParams:
        """Checks against the model; returns a copy with every unset field filled in from
        ``defaults`` (and ``max_loops`` from ``total_ut_steps``). Idempotent."""
        self.validate()
        max_loops = total_ut_steps if self.max_loops is None else self.max_loops
        if max_loops > total_ut_steps:
            raise RequestError(
                f"max_loops ({max_loops}) exceeds the model's total_ut_steps ({total_ut_steps})"
            )
        if self.min_loops > max_loops:
            raise RequestError(
                f"min_loops ({self.min_loops}) must not exceed max_loops ({max_loops})"
            )
        if self.prefill_retention is not None and len(self.prefill_retention) != total_ut_steps:
            raise RequestError(
                f"prefill_retention has {len(self.prefill_retention)} entries; the model runs "
                f"{total_ut_steps} loops (one entry per loop)"
            )
        for tok in self.stop_token_ids:
            if tok >= vocab_size:
                raise RequestError(f"stop token id {tok} is outside the vocabulary ({vocab_size})")
        resolved = msgspec.structs.replace(
            self,
            max_tokens=_or(self.max_tokens, defaults.max_tokens),
            temperature=_or(self.temperature, defaults.temperature),
            top_p=_or(self.top_p, defaults.top_p),
            top_k=_or(self.top_k, defaults.top_k),
            exit_threshold=_or(self.exit_threshold, defaults.exit_threshold),
            max_loops=max_loops,
        )
        resolved.validate()  # the defaults come from checkpoint files: check them too
        return resolved


class StructuredOutputKind(StrEnum):
    """What a ``StructuredOutput``'s ``spec`` holds."""

    JSON_SCHEMA = "json_schema"  # a JSON schema (JSON text); the output is JSON it validates
    JSON_OBJECT = "json_object"  # spec unused (""): the output is any JSON object
    REGEX = "regex"  # the output matches this regular expression
    CHOICE = "choice"  # a JSON array of strings: the output is exactly one of them
    GRAMMAR = "grammar"  # a grammar (GBNF as llama.cpp's, or Lark with llguidance): its root
    # tool calls (services/common/structured/tool_format.py's ``ToolCallSpec`` as JSON): calls whose
    # arguments follow each function's schema, alone or after free text
    TOOL_CALLS = "tool_calls"


class StructuredOutputsBackend(StrEnum):
    """The grammar engine that turns a format into token masks
    (services/common/structured/grammar.py). The default is chosen by measured conformance
    (docs/benchmarks/structured_outputs.md)."""

    LLGUIDANCE = "llguidance"
    XGRAMMAR = "xgrammar"


DEFAULT_STRUCTURED_OUTPUTS_BACKEND = StructuredOutputsBackend.LLGUIDANCE
_JSON_KINDS = ("json_schema", "json_object")

# a spec is compiled into a grammar on the worker and held in its cache: bounded like a prompt
MAX_STRUCTURED_SPEC_CHARS = 64 * 1024


class StructuredOutput(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A constraint on what a request may generate (``SamplingParams.structured_output``):
    each token is sampled from those that keep the output a prefix of the format, and end of
    sequence is allowed exactly when the output is complete. These checks are of the shape
    only; whether the spec compiles is checked where the grammar engine lives (admission
    before routing, the in-process engine when a request is added)."""

    kind: StructuredOutputKind
    spec: str = ""
    # JSON kinds: whitespace between tokens (runs of at most 16 characters, e.g. indented
    # output); by default none, as OpenAI's structured outputs write JSON (a weak model
    # cannot then spend its tokens on blanks)
    any_whitespace: bool = False
    # the grammar engine; None until admission (or the in-process engine) fills in its own
    backend: StructuredOutputsBackend | None = None

    def validate(self) -> None:
        if not isinstance(self.spec, str):
            raise RequestError("structured_output.spec must be a string")
        if self.any_whitespace and self.kind not in _JSON_KINDS:
            raise RequestError(
                "structured_output.any_whitespace applies to json_schema and json_object only"
            )
        if self.backend is not None:
            try:
                StructuredOutputsBackend(self.backend)
            except ValueError:
                names = ", ".join(b.value for b in StructuredOutputsBackend)
                raise RequestError(
                    f"structured_output.backend must be one of {names}, got {self.backend!r}"
                ) from None
        if len(self.spec) > MAX_STRUCTURED_SPEC_CHARS:
            raise RequestError(
                f"structured_output.spec has {len(self.spec)} characters, at most "
                f"{MAX_STRUCTURED_SPEC_CHARS} are allowed"
            )
        try:
            kind = StructuredOutputKind(self.kind)
        except ValueError:
            kinds = ", ".join(k.value for k in StructuredOutputKind)
            raise RequestError(
                f"structured_output.kind must be one of {kinds}, got {self.kind!r}"
            ) from None
        if kind == StructuredOutputKind.JSON_OBJECT:
            if self.spec:
                raise RequestError("structured_output of kind json_object takes no spec")
            return
        if not self.spec:
            raise RequestError(f"structured_output of kind {kind.value} needs a spec")
        if kind == StructuredOutputKind.JSON_SCHEMA:
            schema = _json_spec(self.spec, "a JSON schema")
            if not isinstance(schema, dict | bool):
                raise RequestError("structured_output: a JSON schema must be an object")
        elif kind == StructuredOutputKind.TOOL_CALLS:
            if not isinstance(_json_spec(self.spec, "a tool-call spec"), dict):
                raise RequestError("structured_output: a tool-call spec must be a JSON object")
        elif kind == StructuredOutputKind.CHOICE:
            choices = _json_spec(self.spec, "a JSON array of strings")
            if (
                not isinstance(choices, list)
                or not choices
                or not all(isinstance(c, str) for c in choices)
            ):
                raise RequestError(
                    "structured_output: choice needs a non-empty JSON array of strings"
                )

    def choices(self) -> list[str]:
        """The strings of a CHOICE spec (validated)."""
        return list(json.loads(self.spec))


class SparsePrefill(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """Token-sparse prefill of one request (docs/sparse_prefill.md). The prompt is cut into
    windows of ``window`` tokens anchored at positions 0, W, 2W, ... (the last may be
    short). Loop l of a window keeps ``min(max(1, ceil(len * retention[l])), kept at
    l - 1)`` of its tokens active, nested in loop l - 1's; the loops before the first
    retention below 1 are dense. Which tokens is the worker's to choose (it holds the
    hidden states); how many is this arithmetic, which the scheduler charges."""

    window: int
    retention: tuple[float, ...]


class PrefillSetting(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """How a request's prompt is prefilled, as the shard that first ran it resolved it
    against its server defaults. A request resumed on another shard (a handoff to a decode
    shard, a move after a shard loss) carries it, so its prompt's KV, prefix keys and tokens
    are the same there whatever that shard's own defaults."""

    sparse_prefill: SparsePrefill | None = None  # None: every loop runs every prompt token


# a retention list has one entry per loop: bounded like any other list a client sends
MAX_RETENTION_LOOPS = 64


def check_retention(retention: object, name: str) -> None:
    """A retention list's shape: 1..64 numbers, each in (0, 1], the first exactly 1 (loop 0
    has no earlier loop to score its tokens by). Its length is checked against the model
    where the model is known."""
    if not isinstance(retention, list | tuple) or not 1 <= len(retention) <= MAX_RETENTION_LOOPS:
        raise RequestError(
            f"{name} must be a list of 1 to {MAX_RETENTION_LOOPS} numbers, got {retention!r}"
        )
    for r in retention:
        if isinstance(r, bool) or not isinstance(r, int | float) or not 0.0 < r <= 1.0:
            raise RequestError(f"{name} entries must be numbers in (0, 1], got {r!r}")
    if retention[0] != 1:
        raise RequestError(f"{name} must start with 1 (loop 0 is always dense), got {retention[0]}")


def _json_spec(spec: str, what: str) -> object:
    try:
        return json.loads(spec)
    except (ValueError, RecursionError) as exc:
        raise RequestError(f"structured_output: the spec is not {what}: {exc}") from None


def _or(value, default):  # type: ignore[no-untyped-def]
    return default if value is None else value


def _check_int(name: str, value: int, lo: int | None = None, hi: int | None = None) -> None:
    # bool is an int subclass in Python; a JSON `true` must not pass as 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name} must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise RequestError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise RequestError(f"{name} must be <= {hi}, got {value}")
