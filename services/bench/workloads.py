"""Seeded benchmark workloads: who arrives when, with which prompt, for how many tokens.

A workload is plain data, identical for every arm of a comparison, so the arms differ only in
the engine configuration. Every random draw comes from a ``random.Random`` seeded with the
bench seed and the workload name (string seeds hash the same in every process).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from enum import StrEnum


class LoopMode(StrEnum):
    CLOSED = "closed"  # a fixed number of clients, each sends its next request when one ends
    OPEN = "open"  # Poisson arrivals at a fixed rate, whatever the engine's progress


@dataclass(frozen=True)
class ExitPolicy:
    exit_threshold: float
    min_loops: int = 1

    @property
    def label(self) -> str:
        if self.exit_threshold >= 1.0:
            return "forced depth"
        return f"early exit {self.exit_threshold:g}/min {self.min_loops}"


EARLY_EXIT = ExitPolicy(exit_threshold=0.7, min_loops=1)  # toy gates spread exit depths
FORCED_DEPTH = ExitPolicy(exit_threshold=1.0, min_loops=1)  # control: every token full depth


@dataclass(frozen=True)
class RequestSpec:
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_s: float = 0.0  # open loop only: offset from the start of the run
    # an answer that may end early, where the model emits one of these (same in every arm)
    stop_token_ids: tuple[int, ...] = ()
    # a class the metrics also report on its own ("long", "short"; "" for none)
    kind: str = ""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    mode: LoopMode
    requests: list[RequestSpec]
    exit: ExitPolicy
    concurrency: int = 1  # closed loop
    rate: float | None = None  # open loop, requests/s
    seed: int = 0
    params: dict[str, object] = field(default_factory=dict)  # what it was built from

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def max_request_tokens(self) -> int:
        return max(r.num_prompt_tokens + r.max_tokens for r in self.requests)

    def with_rate(self, rate: float, name: str | None = None) -> Workload:
        """The same requests, arriving as a Poisson process at ``rate`` requests/s (the same
        arrival pattern, time-scaled, for every rate of one workload)."""
        if rate <= 0 or not math.isfinite(rate):
            raise ValueError(f"arrival rate must be a positive number, got {rate}")
        times = poisson_arrivals(len(self.requests), rate, _rng(self.seed, self.name, "arrivals"))
        reqs = [replace(r, arrival_s=t) for r, t in zip(self.requests, times, strict=True)]
        return Workload(
            name=name or self.name,
            description=self.description,
            mode=LoopMode.OPEN,
            requests=reqs,
            exit=self.exit,
            concurrency=self.concurrency,
            rate=rate,
            seed=self.seed,
            params=self.params,
        )

    def summary(self) -> dict[str, object]:
        prompts = [r.num_prompt_tokens for r in self.requests]
        outputs = [r.max_tokens for r in self.requests]
        return {
            "name": self.name,
            "description": self.description,
            "mode": str(self.mode),
            "num_requests": self.num_requests,
            "concurrency": self.concurrency if self.mode == LoopMode.CLOSED else None,
            "rate": self.rate,
            "seed": self.seed,
            "exit_threshold": self.exit.exit_threshold,
            "min_loops": self.exit.min_loops,
            "prompt_tokens": {"min": min(prompts), "max": max(prompts), "total": sum(prompts)},
            "output_tokens": {"min": min(outputs), "max": max(outputs), "total": sum(outputs)},
            **self.params,
        }


@dataclass(frozen=True)
class LengthMix:
    """Prompt and output lengths, each uniform in an inclusive range."""

    prompt: tuple[int, int]
    output: tuple[int, int]

    def draw(self, rng: random.Random, vocab: TokenRange) -> RequestSpec:
        n = rng.randint(*self.prompt)
        return RequestSpec(vocab.tokens(rng, n), rng.randint(*self.output))


@dataclass(frozen=True)
class TokenRange:
    """Token ids prompts are drawn from: [low, high), never an EOS id."""

    low: int
    high: int
    eos_token_ids: tuple[int, ...] = ()

    def tokens(self, rng: random.Random, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            t = rng.randrange(self.low, self.high)
            if t not in self.eos_token_ids:
                out.append(t)
        return out


def _rng(seed: int, *parts: str) -> random.Random:
    return random.Random(":".join([str(seed), *parts]))


def poisson_arrivals(n: int, rate: float, rng: random.Random) -> list[float]:
    """Arrival offsets of a Poisson process: exponential gaps with mean 1/rate; first at 0."""
    times, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        times.append(t)
    return times


# ---------------------------------------------------------------------- scales
@dataclass(frozen=True)
class Scale:
    """Sizes of every workload: full (the committed report) or quick (tests, smoke runs)."""

    chat: LengthMix
    rag: LengthMix
    # closed loop: requests = this x concurrency; the more per client, the less the final
    # drain (clients running out of work) weighs against the steady state
    chat_requests_per_client: int
    mixed_requests: int
    mixed_rag_fraction: float
    prefix_groups: int
    prefix_tokens: int
    prefix_suffix: tuple[int, int]
    prefix_output: tuple[int, int]
    prefix_requests: int
    # KV pressure: every request asks for the same max_tokens; the short ones stop early
    pressure_prompt: tuple[int, int] = (16, 48)
    pressure_max_tokens: int = 64
    pressure_short_fraction: float = 0.6


FULL = Scale(
    chat=LengthMix(prompt=(16, 48), output=(24, 48)),
    rag=LengthMix(prompt=(256, 512), output=(8, 16)),
    chat_requests_per_client=3,
    mixed_requests=24,
    mixed_rag_fraction=0.25,
    prefix_groups=4,
    prefix_tokens=256,
    prefix_suffix=(16, 48),
    prefix_output=(16, 32),
    prefix_requests=32,
)

QUICK = Scale(
    chat=LengthMix(prompt=(6, 12), output=(3, 6)),
    rag=LengthMix(prompt=(40, 64), output=(2, 4)),
    chat_requests_per_client=2,
    mixed_requests=8,
    mixed_rag_fraction=0.25,
    prefix_groups=2,
    prefix_tokens=32,
    prefix_suffix=(4, 8),
    prefix_output=(2, 4),
    prefix_requests=8,
    pressure_prompt=(6, 12),
    pressure_max_tokens=12,
)


# ---------------------------------------------------------------------- builders
def chat_closed(
    scale: Scale,
    vocab: TokenRange,
    concurrency: int,
    exit: ExitPolicy,
    seed: int,
    requests_per_client: int | None = None,
) -> Workload:
    """Short chat turns from ``concurrency`` closed-loop clients."""
    name = "chat_" + ("forced" if exit.exit_threshold >= 1.0 else "early")
    rng = _rng(seed, "chat")  # same prompts for the early-exit and forced-depth variants
    n = (requests_per_client or scale.chat_requests_per_client) * concurrency
    return Workload(
        name=name,
        description=f"short chat, closed loop x{concurrency}, {exit.label}",
        mode=LoopMode.CLOSED,
        requests=[scale.chat.draw(rng, vocab) for _ in range(n)],
        exit=exit,
        concurrency=concurrency,
        seed=seed,
        params={"prompt_range": scale.chat.prompt, "output_range": scale.chat.output},
    )


def mixed(scale: Scale, vocab: TokenRange, concurrency: int, seed: int) -> Workload:
    """Short chat with long RAG-like prompts mixed in (closed loop until given a rate)."""
    rng = _rng(seed, "mixed")
    n_rag = max(1, round(scale.mixed_requests * scale.mixed_rag_fraction))
    reqs = [scale.rag.draw(rng, vocab) for _ in range(n_rag)]
    reqs += [scale.chat.draw(rng, vocab) for _ in range(scale.mixed_requests - n_rag)]
    rng.shuffle(reqs)
    return Workload(
        name="mixed",
        description=f"chat + {n_rag} long RAG-like prompts, {EARLY_EXIT.label}",
        mode=LoopMode.CLOSED,
        requests=reqs,
        exit=EARLY_EXIT,
        concurrency=concurrency,
        seed=seed,
        params={
            "rag_requests": n_rag,
            "rag_prompt_range": scale.rag.prompt,
            "chat_prompt_range": scale.chat.prompt,
        },
    )


def shared_prefix(scale: Scale, vocab: TokenRange, concurrency: int, seed: int) -> Workload:
    """Requests that share one of a few long system prompts, each with its own question."""
    rng = _rng(seed, "shared_prefix")
    prefixes = [vocab.tokens(rng, scale.prefix_tokens) for _ in range(scale.prefix_groups)]
    reqs = []
    for _ in range(scale.prefix_requests):
        prefix = rng.choice(prefixes)
        suffix = vocab.tokens(rng, rng.randint(*scale.prefix_suffix))
        reqs.append(RequestSpec(prefix + suffix, rng.randint(*scale.prefix_output)))
    return Workload(
        name="shared_prefix",
        description=(
            f"{scale.prefix_groups} shared {scale.prefix_tokens}-token prefixes, "
            f"closed loop x{concurrency}, {EARLY_EXIT.label}"
        ),
        mode=LoopMode.CLOSED,
        requests=reqs,
        exit=EARLY_EXIT,
        concurrency=concurrency,
        seed=seed,
        params={"prefix_groups": scale.prefix_groups, "prefix_tokens": scale.prefix_tokens},
    )


# a short answer stops at the first generated token in this share of the vocabulary: on the
# small checkpoint's greedy outputs that ends half of them within ~5 tokens, a few run long
STOP_FRACTION = 0.2


def kv_pressure(scale: Scale, vocab: TokenRange, concurrency: int, seed: int) -> Workload:
    """Chat prompts that all ask for ``pressure_max_tokens``: the long answers use them all,
    the short ones stop early at a stop id, as a client's max_tokens cap usually goes."""
    rng = _rng(seed, "kv_pressure")
    stop = tuple(t for t in range(vocab.low, vocab.high) if rng.random() < STOP_FRACTION)
    reqs = []
    for _ in range(scale.chat_requests_per_client * concurrency):
        prompt = vocab.tokens(rng, rng.randint(*scale.pressure_prompt))
        short = rng.random() < scale.pressure_short_fraction
        reqs.append(RequestSpec(prompt, scale.pressure_max_tokens, 0.0, stop if short else ()))
    n_short = sum(1 for r in reqs if r.stop_token_ids)
    return Workload(
        name="kv_pressure",
        description=(
            f"chat, closed loop x{concurrency}, max_tokens {scale.pressure_max_tokens}: "
            f"{n_short} short answers (stop ids), {len(reqs) - n_short} long, {EARLY_EXIT.label}"
        ),
        mode=LoopMode.CLOSED,
        requests=reqs,
        exit=EARLY_EXIT,
        concurrency=concurrency,
        seed=seed,
        params={
            "short_requests": n_short,
            "stop_vocab_fraction": STOP_FRACTION,
            "prompt_range": scale.pressure_prompt,
        },
    )


def long_and_short(
    vocab: TokenRange,
    concurrency: int,
    seed: int,
    *,
    long: LengthMix,
    short: LengthMix,
    long_share: float,
    num_requests: int,
    name: str = "long_short",
) -> Workload:
    """Long requests (long prompts and answers) among short ones, from ``concurrency``
    closed-loop clients, marked ``kind`` "long" / "short" so each class is measured on its
    own. Longs stay long: under KV pressure they fill the pool and wait for it."""
    rng = _rng(seed, name)
    reqs = [
        replace(long.draw(rng, vocab), kind="long")
        if rng.random() < long_share
        else replace(short.draw(rng, vocab), kind="short")
        for _ in range(num_requests)
    ]
    n_long = sum(1 for r in reqs if r.kind == "long")
    return Workload(
        name=name,
        description=(
            f"{n_long} long (prompt {long.prompt[0]}–{long.prompt[1]}, output "
            f"{long.output[0]}–{long.output[1]}) among {len(reqs) - n_long} short (prompt "
            f"{short.prompt[0]}–{short.prompt[1]}, output {short.output[0]}–{short.output[1]}), "
            f"closed loop x{concurrency}, {EARLY_EXIT.label}"
        ),
        mode=LoopMode.CLOSED,
        requests=reqs,
        exit=EARLY_EXIT,
        concurrency=concurrency,
        seed=seed,
        params={
            "long_requests": n_long,
            "long_prompt_range": long.prompt,
            "long_output_range": long.output,
            "short_prompt_range": short.prompt,
            "short_output_range": short.output,
        },
    )


def warmup_workload(workload: Workload, whole: bool = False) -> Workload:
    """What runs untimed before a measurement, so first-use costs stay off the clock: two
    short requests of the workload's kind, or (``whole``, on a GPU) the workload itself,
    since a fresh CUDA process loads kernels lazily and picks GEMM algorithms per new batch
    shape, for many batches."""
    if whole:
        return replace(workload, name="warmup", description="warm-up (the whole workload)")
    reqs = [RequestSpec(r.prompt_token_ids, min(r.max_tokens, 2)) for r in workload.requests[:2]]
    return Workload("warmup", "warm-up", LoopMode.CLOSED, reqs, workload.exit, concurrency=2)


# ---------------------------------------------------------------------- shards
def prefix_groups(
    vocab: TokenRange,
    concurrency: int,
    seed: int,
    *,
    groups: int,
    prefix_tokens: int,
    suffix: tuple[int, int],
    output: tuple[int, int],
    num_requests: int,
    hot_share: float = 0.0,
    name: str = "prefix_groups",
) -> Workload:
    """Requests over ``groups`` long shared prefixes (system prompts), each with its own
    question; with ``hot_share`` that share of them uses the first prefix (one hot prompt)
    and the rest spread evenly over the others."""
    rng = _rng(seed, name)
    prefixes = [vocab.tokens(rng, prefix_tokens) for _ in range(groups)]
    reqs = []
    for _ in range(num_requests):
        if hot_share and rng.random() < hot_share:
            prefix = prefixes[0]
        else:
            prefix = rng.choice(prefixes[1:] if hot_share and groups > 1 else prefixes)
        question = vocab.tokens(rng, rng.randint(*suffix))
        reqs.append(RequestSpec(prefix + question, rng.randint(*output)))
    hot = f", {hot_share:.0%} on one hot prefix" if hot_share else ""
    return Workload(
        name=name,
        description=(
            f"{groups} shared {prefix_tokens}-token prefixes{hot}, closed loop x{concurrency}, "
            f"{EARLY_EXIT.label}"
        ),
        mode=LoopMode.CLOSED,
        requests=reqs,
        exit=EARLY_EXIT,
        concurrency=concurrency,
        seed=seed,
        params={"prefix_groups": groups, "prefix_tokens": prefix_tokens, "hot_share": hot_share},
    )


def long_decode(
    vocab: TokenRange,
    concurrency: int,
    seed: int,
    *,
    prompt: tuple[int, int],
    output: tuple[int, int],
    requests_per_client: int,
    name: str = "long_decode",
) -> Workload:
    """Chat prompts with long answers (decode-bound), ``concurrency`` closed-loop clients."""
    rng = _rng(seed, "long_decode")  # the same prompts at every concurrency
    mix = LengthMix(prompt=prompt, output=output)
    return Workload(
        name=name,
        description=f"long answers, closed loop x{concurrency}, {EARLY_EXIT.label}",
        mode=LoopMode.CLOSED,
        requests=[mix.draw(rng, vocab) for _ in range(requests_per_client * concurrency)],
        exit=EARLY_EXIT,
        concurrency=concurrency,
        seed=seed,
        params={"prompt_range": prompt, "output_range": output},
    )
