"""Argument definitions for ``rlt bench`` (import-light: the CLI builds its parser eagerly)."""

from __future__ import annotations

import argparse

from services.worker.model.sizes import CHECKPOINT_SIZES

# kept here (not in comparisons/registry.py) so building the parser imports nothing heavy
COMPARISON_NAMES = (
    "depth_batching",
    "wcpb",
    "pipeline",
    "prefix_cache",
    "kv_pressure",
    "scheduler",  # the scheduler step alone (services/bench/comparisons/scheduler_step.py)
)
# many OS processes per run (minutes each): only when asked for with --only
SHARD_COMPARISON_NAMES = ("routing", "scaling")
# long requests under KV pressure (admission order; ~5 min on toy, far more on small): only
# when asked for with --only
BYPASS_COMPARISON_NAMES = ("admission_bypass",)
# open-loop overload on this machine's model and the simulated H200 (services/bench/
# comparisons/overload.py, ~5 min on two cores): only when asked for with --only
# token-sparse prefill against dense on 1-4k prompts, this machine's model and the simulated
# H200 (services/bench/comparisons/sparse_prefill.py, ~10 min on small): only when asked
# for with --only
# prefill/decode disaggregation: simulated shards, KV moved with NIXL (~3 min): when asked
OPT_IN_COMPARISON_NAMES = (
    *SHARD_COMPARISON_NAMES,
    *BYPASS_COMPARISON_NAMES,
    "overload",
    "sparse_prefill",
    "disaggregation",
)


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    known = COMPARISON_NAMES + OPT_IN_COMPARISON_NAMES
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown comparison(s) {unknown or text!r}; choose from {', '.join(known)}"
        )
    return names


def _arm_names(text: str) -> list[str]:
    """Arm names are the comparisons' own; ``run_bench`` checks them once those are built."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError("name at least one arm")
    return names


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="tiny settings, seconds not minutes")
    p.add_argument(
        "--size",
        choices=list(CHECKPOINT_SIZES),
        default="small",
        help="random checkpoint to write (once, into the cache) and use when --checkpoint is "
        "not given; 1.4b is the Ouro-1.4B shape, for a GPU",
    )
    p.add_argument("--checkpoint", default=None, help="an Ouro-format checkpoint directory")
    p.add_argument("--device", default="cpu", help="torch device for the model (cpu, cuda)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument(
        "--repeats", type=_positive, default=3, help="repeats per arm, interleaved A B A B"
    )
    p.add_argument(
        "--only",
        type=_names,
        default=list(COMPARISON_NAMES),
        metavar="NAMES",
        help=f"comma-separated subset of: {', '.join(COMPARISON_NAMES)} (the default), "
        f"and {', '.join(SHARD_COMPARISON_NAMES)} (shards as OS processes), admission_bypass "
        "(long requests under KV pressure) and overload (shed-depth vs reject under "
        "open-loop overload): only when named",
    )
    p.add_argument(
        "--arms",
        type=_arm_names,
        default=None,
        help="comma-separated arms to run (default: all of each comparison's); a ratio "
        "runs only when both of its arms do (e.g. a time-boxed GPU lease)",
    )
    p.add_argument("--out", default="docs/benchmarks", help="output directory for the report")
    p.add_argument(
        "--concurrency",
        type=_positive,
        default=32,
        help="closed-loop clients in flight (also the engine's max_num_seqs)",
    )
    p.add_argument(
        "--rate",
        type=float,
        default=None,
        help="open-loop arrivals/s for the WCPB comparison (default: 60%% of measured capacity)",
    )
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument(
        "--threads",
        type=_positive,
        default=None,
        help="torch CPU threads (default 1 on cpu: a busy core stalls every multi-threaded op)",
    )
    p.add_argument(
        "--routing-kv-prefixes",
        type=_positive_float,
        default=None,
        metavar="N",
        help="routing: KV room per shard for N of the 8 shared prefixes, beyond its clients' own "
        "blocks (default: its share, 2 with 4 shards: together they hold each prefix once)",
    )
    p.add_argument("--no-plots", action="store_true", help="skip the matplotlib PNGs")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
