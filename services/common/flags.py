"""The shared command-line flags and the configs built from them (and from the environment).

The CLI, the launcher, the bench and the offline tools all build their engine and request
settings here, and a deployment's (shards, the bus, the HTTP edge) in ``service_flags.py``,
so a flag means the same everywhere and exists once.
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from messages.sampling import SamplingParams, StructuredOutputsBackend
from services.common.config import (
    KV_CACHE_DTYPES,
    KVAdmission,
    KVLayout,
    OverloadPolicy,
    SchedulerConfig,
)
from services.common.sparse_prefill import DEFAULT_SPARSE_WINDOW

if TYPE_CHECKING:
    import torch

PREFILL_MODES = ("atomic", "split", "wavefront")
# torch is imported only by what runs a model: `rlt service scheduler` (admission,
# prefix-cache) parses these flags too, and starts in a fraction of the time and memory
DTYPE_NAMES = ("float32", "bfloat16", "float16")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a ``--dtype`` name."""
    import torch

    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPE_NAMES)}")
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch_dtype`` inverted."""
    return next(name for name in DTYPE_NAMES if torch_dtype(name) == dtype)


def add_request_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("requests")
    g.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    g.add_argument(
        "--prompt-ids", action="append", default=[], help="comma-separated token ids (repeatable)"
    )
    # unset (None) takes the checkpoint's default: generation_config.json, else the API's
    g.add_argument("--max-tokens", type=int, default=None, help="default: the checkpoint's")
    g.add_argument("--temperature", type=float, default=0.0, help="default: 0 (greedy)")
    g.add_argument("--top-p", type=float, default=None, help="default: the checkpoint's")
    g.add_argument("--top-k", type=int, default=None, help="default: the checkpoint's")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--min-loops", type=int, default=2)
    g.add_argument("--max-loops", type=int, default=None)
    g.add_argument(
        "--exit-threshold",
        type=float,
        default=None,
        help="default: the checkpoint's early_exit_threshold (config.json)",
    )
    g.add_argument("--ignore-eos", action="store_true")


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--checkpoint", default=None, help="checkpoint dir (default: toy checkpoint)")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--prefill-chunk-size", type=int, default=512)
    g.add_argument(
        "--prefill",
        choices=PREFILL_MODES,
        default=None,
        help="how prompts are prefilled: atomic (every depth of a chunk in one task), split "
        "(a task per depth), wavefront (split into chunk x depth tasks on anti-diagonals, "
        "sharing passes with decode rows). Default: wavefront (atomic with --kv-layout shared)",
    )
    g.add_argument(
        "--split-prefill",
        dest="prefill",
        action="store_const",
        const="split",
        help="same as --prefill split",
    )
    g.add_argument(
        "--wavefront-chunked-prefill",
        dest="prefill",
        action="store_const",
        const="wavefront",
        help="same as --prefill wavefront",
    )
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-blocks", type=int, default=4096)
    g.add_argument("--kv-layout", choices=[k.value for k in KVLayout], default="last_exited")
    g.add_argument(
        "--kv-cache-dtype",
        choices=list(KV_CACHE_DTYPES),
        default=os.environ.get("RLT_KV_CACHE_DTYPE", "auto"),
        help="how KV blocks store tokens: auto (the model dtype, exact), fp8 (e4m3 codes and "
        "a scale per token and kv head: ~0.52x the bytes of bf16), int4-delta (4-bit codes, "
        "each loop a delta from the loop below, full-precision tails: ~0.33x; last_exited "
        "layout only, no speculation or P/D) "
        "(default: $RLT_KV_CACHE_DTYPE, else auto)",
    )
    g.add_argument(
        "--kv-int4-anchor-every",
        type=int,
        default=int(
            os.environ.get("RLT_KV_INT4_ANCHOR_EVERY", SchedulerConfig.kv_int4_anchor_every)
        ),
        help="int4-delta: code every N-th loop's KV on its own instead of as a delta from "
        "the loop below, so a pass reads at most N planes of codes; 0 makes loop 0 the only "
        f"one (default: $RLT_KV_INT4_ANCHOR_EVERY, else "
        f"{SchedulerConfig.kv_int4_anchor_every})",
    )
    g.add_argument(
        "--no-refill",
        action="store_true",
        help="cohort decode baseline instead of continuous depth batching",
    )
    g.add_argument("--enable-prefix-caching", action="store_true")
    g.add_argument(
        "--no-share-inflight-prefill",
        action="store_true",
        help="prefix caching: a request whose prefix another is still prefilling computes it "
        "again instead of waiting for those blocks (the default waits and claims them)",
    )
    g.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="build the next batch while the current one runs (default: on; "
        "--no-async-scheduling waits for each result)",
    )
    g.add_argument(
        "--max-inflight-batches",
        type=int,
        default=2,
        help="batches submitted before the oldest result is applied (async scheduling)",
    )
    g.add_argument(
        "--overload-policy",
        choices=[p.value for p in OverloadPolicy],
        default=SchedulerConfig.overload_policy.value,
        help="when more arrives than the engine serves at full depth: reject (admission "
        "refuses once the queue is full) or shed-depth (fewer loops per generated token "
        "while the queue stays long, restored as it drains; a request may refuse with "
        "shed_depth: false) (default: %(default)s)",
    )
    g.add_argument(
        "--shed-min-loops",
        type=int,
        default=SchedulerConfig.shed_min_loops,
        metavar="N",
        help="shed-depth: the lowest depth budget (a request's own min_loops still wins) "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--shed-queue-high",
        type=float,
        default=SchedulerConfig.shed_queue_high,
        metavar="SHARE",
        help="shed-depth: shed while the waiting requests are at least this share of the "
        "running ones (default: %(default)s)",
    )
    g.add_argument(
        "--kv-admission",
        choices=[k.value for k in KVAdmission],
        default=SchedulerConfig.kv_admission.value,
        help="when a waiting request may start: reserve (its whole KV footprint fits, never "
        "preempts), incremental (seats only; a KV shortfall preempts and recomputes), "
        "watermark (its prompt fits and free KV still covers --kv-watermark of what running "
        "requests may write) (default: %(default)s)",
    )
    g.add_argument(
        "--kv-watermark",
        type=float,
        default=SchedulerConfig.kv_watermark,
        metavar="FRACTION",
        help="watermark admission: share in [0, 1] of the running requests' unwritten "
        "footprint kept free (0 = admit when the prompt fits, 1 = reserve) "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--max-admission-bypasses",
        type=int,
        default=SchedulerConfig.max_admission_bypasses,
        metavar="N",
        help="reserve/watermark admission: a waiting request whose KV does not fit may be "
        "passed by requests of its priority behind it that fit and are estimated to finish "
        "before it could start (backfill), and N times by others; 0 = strict queue order "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--structured-outputs-backend",
        choices=[b.value for b in StructuredOutputsBackend],
        default=SchedulerConfig.structured_outputs_backend.value,
        help="the grammar engine of structured outputs (response_format, structured_outputs): "
        "admission assigns it to each request and every worker compiles with it; the default "
        "is chosen by measured conformance (docs/benchmarks/structured_outputs.md) "
        "(default: %(default)s)",
    )
    add_speculative_flags(g)
    add_sparse_prefill_flags(g)
    add_device_flags(g)


def speculative_tokens(text: str) -> str:
    """``--speculative-tokens``: a count >= 0 or ``auto``."""
    if text == "auto" or (text.isdigit() and int(text) >= 0):
        return text
    raise argparse.ArgumentTypeError(f"expected a count >= 0 or auto, got {text!r}")


# what ``--speculative-tokens auto`` chooses up to
AUTO_MAX_SPECULATIVE_TOKENS = 8


def add_speculative_flags(g: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--speculative-tokens",
        type=speculative_tokens,
        default=str(SchedulerConfig.speculative_tokens),
        metavar="K|auto",
        help="self-speculative decoding: draft up to K tokens with the first "
        "--draft-loops loops and verify them with the others in one pass (the same tokens "
        "as plain decoding; a request may refuse with speculative: false); auto chooses K "
        f"per step (up to {AUTO_MAX_SPECULATIVE_TOKENS}) from the acceptance rate and the "
        "batch; 0 = off (default: %(default)s)",
    )
    g.add_argument(
        "--draft-loops",
        type=int,
        default=SchedulerConfig.draft_loops,
        metavar="d",
        help="self-speculative decoding: loops that draft a token (below the model's "
        "total_ut_steps) (default: %(default)s)",
    )


def speculative_config(text: str) -> dict[str, object]:
    """``--speculative-tokens``'s SchedulerConfig fields."""
    if text == "auto":
        return {"speculative_tokens": AUTO_MAX_SPECULATIVE_TOKENS, "speculative_auto": True}
    return {"speculative_tokens": int(text), "speculative_auto": False}


def _env_switch(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def add_sparse_prefill_flags(g: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Token-sparse prefill's server defaults (a request may choose for itself); each also
    reads the environment, which is how compose sets them."""
    g.add_argument(
        "--token-sparse-prefill",
        action=argparse.BooleanOptionalAction,
        default=_env_switch("RLT_SPARSE_PREFILL"),
        help="late loops of a prompt run only the tokens whose hidden state still moves "
        "(FlashLoop's LoopFreeze per window; docs/sparse_prefill.md) for requests that do "
        "not choose (token_sparse_prefill). It changes outputs: off by default "
        "(default: $RLT_SPARSE_PREFILL, else off). Needs split or wavefront prefill",
    )
    g.add_argument(
        "--prefill-retention",
        default=os.environ.get("RLT_PREFILL_RETENTION") or None,
        metavar="R0,R1,...",
        help="token-sparse prefill: the share of a window's tokens each loop keeps, one per "
        "loop, the first 1 (default: $RLT_PREFILL_RETENTION, else FlashLoop's 1,1,0.25,0.1 "
        "for four loops)",
    )
    g.add_argument(
        "--sparse-window",
        type=int,
        default=int(os.environ.get("RLT_SPARSE_WINDOW") or DEFAULT_SPARSE_WINDOW),
        metavar="W",
        help="token-sparse prefill: prompt tokens per window (anchored at 0, W, 2W, ...); "
        "a loop keeps the highest-scoring tokens of each window "
        "(default: $RLT_SPARSE_WINDOW, else %(default)s)",
    )


def parse_retention(text: str | None) -> tuple[float, ...] | None:
    """``--prefill-retention``'s value as numbers (checked by ``SchedulerConfig``); empty:
    the model's default."""
    if not text or not text.strip():
        return None
    try:
        return tuple(float(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise SystemExit(
            f"--prefill-retention must be comma-separated numbers, got {text!r}"
        ) from None


def add_device_flags(g: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--device",
        default=os.environ.get("RLT_DEVICE", "cpu"),
        help="torch device of the model and KV cache (default: $RLT_DEVICE, else cpu); "
        "'sim' is a simulated device for scale benchmarks only (no model, every output "
        "marked simulated; docs/sharding.md)",
    )
    g.add_argument(
        "--dtype",
        choices=list(DTYPE_NAMES),
        default=os.environ.get("RLT_DTYPE", "float32"),
        help="model and KV dtype (default: $RLT_DTYPE, else float32)",
    )
    g.add_argument(
        "--no-cuda-graphs",
        action="store_true",
        default=os.environ.get("RLT_DECODE_MODE") == "eager",
        help="run every decode pass eagerly (default on CUDA: each row-count bucket's decode "
        "pass is captured as a CUDA graph at start-up and replayed)",
    )


def scheduler_config_from_args(args: argparse.Namespace) -> SchedulerConfig:
    mode = args.prefill
    unset = {} if args.async_scheduling is None else {"async_scheduling": args.async_scheduling}
    return SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_chunk_size=args.prefill_chunk_size,
        split_prefill=None if mode is None else mode != "atomic",
        wavefront_chunked_prefill=None if mode is None else mode == "wavefront",
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_layout=KVLayout(args.kv_layout),
        kv_cache_dtype=args.kv_cache_dtype,
        kv_int4_anchor_every=args.kv_int4_anchor_every,
        refill=not args.no_refill,
        enable_prefix_caching=args.enable_prefix_caching,
        share_inflight_prefill=not args.no_share_inflight_prefill,
        max_inflight_batches=args.max_inflight_batches,
        overload_policy=OverloadPolicy(args.overload_policy),
        shed_min_loops=args.shed_min_loops,
        shed_queue_high=args.shed_queue_high,
        kv_admission=KVAdmission(args.kv_admission),
        kv_watermark=args.kv_watermark,
        max_admission_bypasses=args.max_admission_bypasses,
        structured_outputs_backend=StructuredOutputsBackend(args.structured_outputs_backend),
        token_sparse_prefill=args.token_sparse_prefill,
        prefill_retention=parse_retention(args.prefill_retention),
        sparse_window=args.sparse_window,
        draft_loops=args.draft_loops,
        **speculative_config(args.speculative_tokens),
        **unset,
    )


def engine_args(config: SchedulerConfig) -> list[str]:
    """The engine flags that rebuild ``config`` (``scheduler_config_from_args`` inverted),
    for starting ``rlt service`` processes with a given config."""
    args = [
        f"--max-num-seqs={config.max_num_seqs}",
        f"--max-num-batched-tokens={config.max_num_batched_tokens}",
        f"--prefill-chunk-size={config.prefill_chunk_size}",
        f"--block-size={config.block_size}",
        f"--num-blocks={config.num_blocks}",
        f"--kv-layout={config.kv_layout.value}",
        f"--kv-cache-dtype={config.kv_cache_dtype}",
        f"--kv-int4-anchor-every={config.kv_int4_anchor_every}",
        f"--max-inflight-batches={config.max_inflight_batches}",
        f"--overload-policy={config.overload_policy.value}",
        f"--shed-min-loops={config.shed_min_loops}",
        f"--shed-queue-high={config.shed_queue_high!r}",
        f"--kv-admission={config.kv_admission.value}",
        f"--kv-watermark={config.kv_watermark!r}",
        f"--max-admission-bypasses={config.max_admission_bypasses}",
        f"--structured-outputs-backend={config.structured_outputs_backend.value}",
        f"--sparse-window={config.sparse_window}",
        "--speculative-tokens="
        + ("auto" if config.speculative_auto else str(config.speculative_tokens)),
        f"--draft-loops={config.draft_loops}",
    ]
    # explicit either way: a child service reads the environment for what it is not told
    # (an empty retention is the model's default)
    retention = config.prefill_retention or ()
    args += ["--prefill-retention=" + ",".join(repr(r) for r in retention)]
    args += [
        "--token-sparse-prefill" if config.token_sparse_prefill else "--no-token-sparse-prefill"
    ]
    mode = prefill_mode(config)
    args += [f"--prefill={mode}"]
    args += ["--async-scheduling" if config.async_scheduling else "--no-async-scheduling"]
    switches = {
        "--no-refill": not config.refill,
        "--enable-prefix-caching": config.enable_prefix_caching,
        "--no-share-inflight-prefill": not config.share_inflight_prefill,
    }
    return args + [flag for flag, on in switches.items() if on]


def prefill_mode(config: SchedulerConfig) -> str:
    if config.wavefront_chunked_prefill:
        return "wavefront"
    return "split" if config.split_prefill else "atomic"


def device_from_args(args: argparse.Namespace) -> tuple[str, torch.dtype]:
    """(device, dtype) of the model, from ``--device`` / ``--dtype``. ``--no-cuda-graphs``
    sets ``RLT_DECODE_MODE`` for the runners made after this (and child processes)."""
    if getattr(args, "no_cuda_graphs", False):
        os.environ["RLT_DECODE_MODE"] = "eager"
    return getattr(args, "device", "cpu"), torch_dtype(getattr(args, "dtype", "float32"))


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        min_loops=args.min_loops,
        max_loops=args.max_loops,
        exit_threshold=args.exit_threshold,
        ignore_eos=args.ignore_eos,
    )


def parse_prompt_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError as exc:
        raise SystemExit(f"--prompt-ids must be comma-separated integers: {text!r}") from exc
