"""Scheduler configuration and the model facts the scheduler needs."""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from kernels.kv_codec import CODECS as KV_CACHE_DTYPES
from kernels.kv_codec import INT4_DELTA, BatchLimits
from messages.errors import RequestError
from messages.sampling import (
    API_DEFAULTS,
    DEFAULT_STRUCTURED_OUTPUTS_BACKEND,
    RequestDefaults,
    SamplingParams,
    StructuredOutputsBackend,
    check_retention,
)
from services.common.sparse_prefill import DEFAULT_SPARSE_WINDOW, SparseDefaults


def scheduler_lost_s() -> float:
    """``RLT_SCHEDULER_LOST_S`` (default 10 s): how long admission and the prefix cache hear
    nothing from a shard's scheduler before they take it for gone; the scheduler's fence
    check relies on the same value."""
    value = os.environ.get("RLT_SCHEDULER_LOST_S")
    return float(value) if value else 10.0


class KVLayout(StrEnum):
    LAST_EXITED = "last_exited"  # one plane per depth; exited tokens copied upwards
    SHARED = "shared"  # one plane overwritten by every loop


class OverloadPolicy(StrEnum):
    """What the scheduler does when more work arrives than it can serve at full depth
    (docs/ARCHITECTURE.md, "Overload")."""

    # keep every token at its request's depth; admission refuses (``overloaded``) once the
    # queue is full
    REJECT = "reject"
    # lower the depth budget of new decode tokens while the queue stays long, restore it as
    # the queue drains; ``overloaded`` still comes once the budget is at its floor
    SHED_DEPTH = "shed-depth"


class KVAdmission(StrEnum):
    """When a waiting request may start, given the KV it will need (docs/ARCHITECTURE.md).

    Footprint = ceil((prompt + max_tokens - 1) / block_size) blocks in every plane.
    """

    # only when its whole footprint fits beside every running request's unwritten footprint:
    # never preempts, but holds KV for tokens a request that stops early never writes
    RESERVE = "reserve"
    # on seats alone; KV is allocated task by task and a shortfall preempts (recompute)
    INCREMENTAL = "incremental"
    # when its prompt fits and the KV left still covers ``kv_watermark`` of what the
    # running requests (and its own decode) may still write: 0 = prompt fits, 1 = reserve
    WATERMARK = "watermark"


@dataclass(frozen=True)
class ModelLimits:
    total_ut_steps: int
    vocab_size: int
    max_position_embeddings: int
    # ids that end a request (unless ignore_eos): config.json's and generation_config.json's
    # eos; empty when neither names one (then only max_tokens and stop ids end a request)
    eos_token_ids: tuple[int, ...]
    # what a request that leaves a field unset gets (generation_config.json, config.json)
    defaults: RequestDefaults = API_DEFAULTS

    @classmethod
    def from_model_config(cls, cfg: Any) -> ModelLimits:
        """From an ``OuroConfig`` (read by attribute: the scheduler never imports the model)."""
        generation = cfg.generation
        api = API_DEFAULTS
        return cls(
            total_ut_steps=cfg.total_ut_steps,
            vocab_size=cfg.vocab_size,
            max_position_embeddings=cfg.max_position_embeddings,
            eos_token_ids=tuple(cfg.stop_token_ids),
            defaults=RequestDefaults(
                max_tokens=_first(generation.max_tokens, api.max_tokens),
                temperature=_first(generation.temperature, api.temperature),
                top_p=_first(generation.top_p, api.top_p),
                top_k=_first(generation.top_k, api.top_k),
                exit_threshold=cfg.early_exit_threshold,
            ),
        )

    def resolve(self, params: SamplingParams) -> SamplingParams:
        """The one place a request's unset fields get this model's defaults (admission and
        the scheduler both call it); raises RequestError for values the model cannot take."""
        if params.structured_output is not None and not self.eos_token_ids:
            # the grammar ends the output with an end of sequence: the model must have one
            raise RequestError(
                "structured_output needs a model with an end-of-sequence token, and this "
                "checkpoint names none (config.json / generation_config.json eos_token_id)"
            )
        return params.resolve(self.total_ut_steps, self.vocab_size, self.defaults)


def _first(value: Any, default: Any) -> Any:
    return default if value is None else value


@dataclass(frozen=True)
class SchedulerConfig:
    """The engine's settings. The defaults are the fast path, chosen by measurement
    (docs/benchmarks/README.md, "Defaults"): wavefront chunked prefill, so prompt rows share
    core passes with decode rows, and async scheduling, so the next batch is built while
    the current one runs. Prefill: left unset (None), it is WCPB, or atomic where the KV
    layout needs it (``shared``); ``split_prefill=False`` alone asks for atomic prefill,
    ``split_prefill=True`` alone for depth-serial split prefill."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    prefill_chunk_size: int = 512
    split_prefill: bool | None = None
    wavefront_chunked_prefill: bool | None = None
    block_size: int = 16
    num_blocks: int = 4096
    kv_layout: KVLayout = KVLayout.LAST_EXITED
    # how a KV block stores its tokens (kernels/kv_codec.py): "auto" (the model's dtype,
    # exact), "fp8" (e4m3 codes + a scale per token and kv head); one per server
    kv_cache_dtype: str = "auto"
    # int4-delta: every this many planes (loops) one is coded on its own, so a pass at loop
    # d reads the planes from the anchor at or below d up to d; 0 makes plane 0 the only
    # anchor (every later loop a delta from the one below). 2 (docs/kv_codecs.md): Ouro's
    # passes read 1.5 planes of codes, not 2.5, and the last loop's K/V stays a delta
    kv_int4_anchor_every: int = 2
    # continuous depth batching: an exited row starts its next token in the next pass
    refill: bool = True
    enable_prefix_caching: bool = False
    # prefix caching: a waiting request whose next prompt block a running prefill is
    # computing waits for it to be published instead of computing it a second time
    share_inflight_prefill: bool = True
    async_scheduling: bool = True
    # overload: shed loops per generated token (a looped model's own knob) before requests
    # are refused; the default is chosen by docs/benchmarks/overload.md
    overload_policy: OverloadPolicy = OverloadPolicy.REJECT
    # the lowest depth budget shedding goes to (a request's own min_loops still wins)
    shed_min_loops: int = 2
    # shed while the waiting requests are at least this share of the running ones (the
    # queue's tail then waits about that share of a request's lifetime for a seat)
    shed_queue_high: float = 0.5
    max_inflight_batches: int = 2
    kv_admission: KVAdmission = KVAdmission.WATERMARK
    kv_watermark: float = 0.25
    # under reserve/watermark: how many times a waiting request the KV policy refuses may
    # be passed by requests of its priority behind it that fit, besides backfills (those
    # estimated to finish before it could start). 0 = strict queue order, no backfill
    # either (services/scheduler/core/waiting.py, docs/benchmarks/admission_bypass.md)
    max_admission_bypasses: int = 4
    # the grammar engine of structured outputs: admission (or the in-process engine) writes
    # it into each request, so every worker the request runs on uses the same one; the
    # default is chosen by measured conformance (docs/benchmarks/structured_outputs.md)
    structured_outputs_backend: StructuredOutputsBackend = DEFAULT_STRUCTURED_OUTPUTS_BACKEND
    # token-sparse prefill (docs/sparse_prefill.md) for requests that do not choose: off
    # by default, as it changes outputs; the retention per loop (None: FlashLoop's
    # defaults for the model's loop count) and the window of prompt tokens it ranks within
    token_sparse_prefill: bool = False
    prefill_retention: tuple[float, ...] | None = None
    sparse_window: int = DEFAULT_SPARSE_WINDOW
    # self-speculative decoding (docs/speculative.md): draft up to this many tokens with
    # the first ``draft_loops`` loops and verify them with the others (0: off); with
    # ``speculative_auto`` the number is chosen per step, up to it
    speculative_tokens: int = 0
    speculative_auto: bool = False
    draft_loops: int = 1

    def __post_init__(self) -> None:
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "prefill_chunk_size",
            "block_size",
            "num_blocks",
            "max_inflight_batches",
            "sparse_window",
            "draft_loops",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        try:
            object.__setattr__(self, "overload_policy", OverloadPolicy(self.overload_policy))
        except ValueError:
            choices = ", ".join(p.value for p in OverloadPolicy)
            raise ValueError(
                f"overload_policy must be one of {choices}, got {self.overload_policy!r}"
            ) from None
        if self.speculative_tokens < 0:
            raise ValueError(f"speculative_tokens must be >= 0, got {self.speculative_tokens}")
        if self.shed_min_loops < 1:
            raise ValueError(f"shed_min_loops must be >= 1, got {self.shed_min_loops}")
        if not self.shed_queue_high > 0.0:
            raise ValueError(f"shed_queue_high must be > 0, got {self.shed_queue_high}")
        try:
            object.__setattr__(self, "kv_admission", KVAdmission(self.kv_admission))
        except ValueError:
            choices = ", ".join(k.value for k in KVAdmission)
            raise ValueError(
                f"kv_admission must be one of {choices}, got {self.kv_admission!r}"
            ) from None
        try:
            backend = StructuredOutputsBackend(self.structured_outputs_backend)
        except ValueError:
            choices = ", ".join(b.value for b in StructuredOutputsBackend)
            raise ValueError(
                f"structured_outputs_backend must be one of {choices}, "
                f"got {self.structured_outputs_backend!r}"
            ) from None
        object.__setattr__(self, "structured_outputs_backend", backend)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if not 0.0 <= self.kv_watermark <= 1.0:
            raise ValueError(f"kv_watermark must be in [0, 1], got {self.kv_watermark}")
        if self.max_admission_bypasses < 0:
            raise ValueError(
                f"max_admission_bypasses must be >= 0, got {self.max_admission_bypasses}"
            )
        wavefront = self.wavefront_chunked_prefill
        if wavefront is None:
            wavefront = self.split_prefill is None and self.kv_layout != KVLayout.SHARED
        # WCPB is a way of running split prefill; turning it on implies split.
        split = wavefront or bool(self.split_prefill)
        object.__setattr__(self, "wavefront_chunked_prefill", wavefront)
        object.__setattr__(self, "split_prefill", split)
        if self.kv_layout == KVLayout.SHARED and self.enable_prefix_caching:
            raise ValueError(
                "kv_layout=shared cannot use prefix caching: a hit moves the chunk boundaries "
                "that decide which KV version each chunk reads"
            )
        if self.kv_layout == KVLayout.SHARED and self.split_prefill:
            raise ValueError(
                "kv_layout=shared needs atomic prefill: with split/wavefront prefill the KV "
                "version a chunk reads would depend on timing"
            )
        self._check_int4_delta()
        self._check_sparse_prefill()

    def _check_int4_delta(self) -> None:
        """int4-delta seals a block once its tokens are final at a plane: the shared layout
        rewrites its one plane every loop."""
        if self.kv_int4_anchor_every < 0:
            raise ValueError(
                f"kv_int4_anchor_every must be >= 0 (0: plane 0 only), "
                f"got {self.kv_int4_anchor_every}"
            )
        if self.kv_int4 and self.kv_layout == KVLayout.SHARED:
            raise ValueError(
                "kv_cache_dtype=int4-delta needs kv_layout=last_exited: the shared layout "
                "overwrites its one plane every loop, so a sealed block would go stale"
            )

    def _check_sparse_prefill(self) -> None:
        if self.prefill_retention is not None:
            retention = tuple(float(r) for r in self.prefill_retention)
            try:
                check_retention(list(retention), "prefill_retention")
            except RequestError as exc:
                raise ValueError(str(exc)) from None
            object.__setattr__(self, "prefill_retention", retention)
        if self.token_sparse_prefill and not self.split_prefill:
            raise ValueError(
                "token_sparse_prefill needs split or wavefront prefill: atomic prefill runs "
                "every loop of a chunk in one task"
            )

    def sparse_defaults(self) -> SparseDefaults:
        """What a request that leaves token-sparse prefill unset gets."""
        return SparseDefaults(
            enabled=self.token_sparse_prefill,
            retention=self.prefill_retention,
            window=self.sparse_window,
        )

    def num_planes(self, total_ut_steps: int) -> int:
        return total_ut_steps if self.kv_layout == KVLayout.LAST_EXITED else 1

    @property
    def kv_int4(self) -> bool:
        """int4-delta: only sealed (full) blocks hold codes; an open block's tokens are
        exact in a tail that no other shard can read."""
        return self.kv_cache_dtype == INT4_DELTA

    @property
    def batch_limits(self) -> BatchLimits:
        """What bounds the blocks open at once (int4-delta's tail reserve)."""
        return BatchLimits(self.max_num_seqs, self.max_num_batched_tokens)
