"""The ``rlt`` command line: one entry point for users, compose and benchmarks."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from messages.sampling import SamplingParams
from services.scheduler.config import KVLayout, SchedulerConfig
from services.worker.model.sizes import CHECKPOINT_SIZES

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


def default_checkpoint_dir() -> Path:
    base = Path(os.environ.get("RLT_CACHE_DIR", Path.home() / ".cache" / "rlt"))
    return base / "toy-checkpoint"


def ensure_checkpoint(path: str | None, size: str = "toy") -> Path:
    """The given checkpoint, or a toy one written once into the cache directory."""
    if path:
        return Path(path)
    target = (
        default_checkpoint_dir()
        if size == "toy"
        else default_checkpoint_dir().with_name(f"{size}-checkpoint")
    )
    if not (target / "config.json").exists():
        from services.worker.model.toy import write_toy_checkpoint

        write_toy_checkpoint(target, seed=0, size=size)
    return target


# ---------------------------------------------------------------------- shared flags
def add_request_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("requests")
    g.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    g.add_argument(
        "--prompt-ids", action="append", default=[], help="comma-separated token ids (repeatable)"
    )
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--min-loops", type=int, default=2)
    g.add_argument("--max-loops", type=int, default=None)
    g.add_argument("--exit-threshold", type=float, default=1.0)
    g.add_argument("--ignore-eos", action="store_true")


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--checkpoint", default=None, help="checkpoint dir (default: toy checkpoint)")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--prefill-chunk-size", type=int, default=512)
    g.add_argument("--split-prefill", action="store_true")
    g.add_argument("--wavefront-chunked-prefill", action="store_true")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-blocks", type=int, default=4096)
    g.add_argument("--kv-layout", choices=[k.value for k in KVLayout], default="last_exited")
    g.add_argument(
        "--no-refill",
        action="store_true",
        help="cohort decode baseline instead of continuous depth batching",
    )
    g.add_argument("--enable-prefix-caching", action="store_true")
    g.add_argument("--async-scheduling", action="store_true")


def add_bus_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nats-url", default=os.environ.get("RLT_NATS_URL", DEFAULT_NATS_URL))


def scheduler_config_from_args(args: argparse.Namespace) -> SchedulerConfig:
    return SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_chunk_size=args.prefill_chunk_size,
        split_prefill=args.split_prefill,
        wavefront_chunked_prefill=args.wavefront_chunked_prefill,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_layout=KVLayout(args.kv_layout),
        refill=not args.no_refill,
        enable_prefix_caching=args.enable_prefix_caching,
        async_scheduling=args.async_scheduling,
    )


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


# ---------------------------------------------------------------------- commands
def cmd_toy_checkpoint(args: argparse.Namespace) -> int:
    from services.worker.model.toy import write_toy_checkpoint

    out = write_toy_checkpoint(args.dir, seed=args.seed, size=args.size)
    print(f"wrote {args.size} checkpoint to {out}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    if not args.offline:
        from services.launcher import main_generate_online

        return main_generate_online(args)
    from services.engine.offline import run_offline

    return run_offline(args)


def cmd_schedule_trace(args: argparse.Namespace) -> int:
    from services.engine.trace import run_schedule_trace

    return run_schedule_trace(args)


def cmd_up(args: argparse.Namespace) -> int:
    from services.launcher import main_up

    return main_up(args)


def cmd_service(args: argparse.Namespace) -> int:
    from services.launcher import main_service

    return main_service(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from services.bench.runner import main_bench

    return main_bench(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("toy-checkpoint", help="write a random Ouro-format checkpoint")
    p.add_argument("dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--size",
        choices=list(CHECKPOINT_SIZES),
        default="toy",
        help="toy and small are float32 and write in a second; 1.4b is the Ouro-1.4B shape "
        "in bfloat16 (2.9 GB, about 20 s)",
    )
    p.set_defaults(func=cmd_toy_checkpoint)

    p = sub.add_parser("generate", help="generate text (over NATS, or --offline in-process)")
    p.add_argument("text", nargs="*", help="prompt text (same as --prompt)")
    p.add_argument("--offline", action="store_true", help="run the in-process engine")
    p.add_argument("--json", action="store_true", help="print one finished event per request")
    p.add_argument("--timeout", type=float, default=60.0)
    add_request_flags(p)
    add_engine_flags(p)
    add_bus_flags(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("schedule-trace", help="offline run printing every batch")
    p.add_argument("--json", action="store_true", help="one JSON object per batch")
    p.add_argument("--diagram", action="store_true", help="per-request wavefront picture")
    add_request_flags(p)
    add_engine_flags(p)
    p.set_defaults(func=cmd_schedule_trace)

    p = sub.add_parser("up", help="embedded NATS + all four services")
    p.add_argument("--port", type=int, default=4222)
    p.add_argument("--host", default="127.0.0.1")
    add_engine_flags(p)
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("bench", help="benchmarks: engine comparisons side by side")
    from services.bench.args import add_bench_arguments

    add_bench_arguments(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("service", help="run one service (for compose)")
    p.add_argument("name", choices=["admission", "scheduler", "worker", "prefix-cache"])
    add_engine_flags(p)
    add_bus_flags(p)
    p.set_defaults(func=cmd_service)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from services.runtime.logging import configure_logging

    configure_logging()  # JSON log lines on stderr; stdout stays for results
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
