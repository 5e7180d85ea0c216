"""The ``rlt`` command line: one entry point for users, compose and benchmarks."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from services.common.flags import add_device_flags, add_engine_flags, add_request_flags
from services.common.service_flags import add_bus_flags, add_http_flags, add_shard_flags
from services.worker.model.sizes import CHECKPOINT_SIZES


# ---------------------------------------------------------------------- commands
def cmd_toy_checkpoint(args: argparse.Namespace) -> int:
    from services.worker.model.toy import write_toy_checkpoint

    out = write_toy_checkpoint(args.dir, seed=args.seed, size=args.size)
    print(f"wrote {args.size} checkpoint to {out}")
    return 0


def cmd_check_checkpoint(args: argparse.Namespace) -> int:
    from services.engine.check import run_check

    return run_check(args)


def cmd_generate(args: argparse.Namespace) -> int:
    if not args.offline:
        from services.launcher.generate import main_generate_online

        return main_generate_online(args)
    from services.engine.offline import run_offline

    return run_offline(args)


def cmd_schedule_trace(args: argparse.Namespace) -> int:
    from services.engine.trace import run_schedule_trace

    return run_schedule_trace(args)


def cmd_up(args: argparse.Namespace) -> int:
    from services.launcher.up import main_up

    return main_up(args)


def cmd_service(args: argparse.Namespace) -> int:
    from services.launcher.service import main_service

    return main_service(args)


def cmd_train(args: argparse.Namespace) -> int:
    from services.train.command import run_train

    return run_train(args)


def cmd_eval(args: argparse.Namespace) -> int:
    from services.evaluation.command import run_eval

    return run_eval(args)


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

    p = sub.add_parser(
        "check-checkpoint",
        help="load a checkpoint directory, print its resolved config, refuse what rlt cannot "
        "run as HF does, and generate one token",
    )
    p.add_argument("dir")
    add_device_flags(p)
    p.set_defaults(func=cmd_check_checkpoint)

    p = sub.add_parser("generate", help="generate text (over NATS, or --offline in-process)")
    p.add_argument("text", nargs="*", help="prompt text (same as --prompt)")
    p.add_argument("--offline", action="store_true", help="run the in-process engine")
    p.add_argument("--json", action="store_true", help="print one finished event per request")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument(
        "--retries",
        type=int,
        default=4,
        help="resend a request (same request_id: never a second generation) this many times "
        "when no service answered, it was unavailable, or its stream went silent",
    )
    add_request_flags(p)
    add_engine_flags(p)
    add_bus_flags(p, client=True)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("schedule-trace", help="offline run printing every batch")
    p.add_argument("--json", action="store_true", help="one JSON object per batch")
    p.add_argument("--diagram", action="store_true", help="per-request wavefront picture")
    add_request_flags(p)
    add_engine_flags(p)
    p.set_defaults(func=cmd_schedule_trace)

    p = sub.add_parser("up", help="embedded NATS + all services and the HTTP gateway")
    p.add_argument("--port", type=int, default=4222)
    p.add_argument(
        "--nats-cluster",
        type=int,
        default=1,
        metavar="N",
        help="run N nats-server nodes routed into one cluster on ports PORT..PORT+N-1 "
        "(3: the event stream is replicated R3 and survives losing a node)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument(
        "--client-url-file",
        metavar="PATH",
        help="write the client URL (with the client credentials) here, readable by you only "
        "(default: $RLT_CLIENT_URL_FILE, else ~/.rlt/client-url); `rlt generate` reads it",
    )
    p.add_argument(
        "--tenant",
        action="append",
        default=[],
        metavar="NAME",
        help="a tenant with its own NATS user, subjects rlt.v1.tenant.NAME.* and inboxes "
        "_INBOX.tenant.NAME.> (its URL goes to the client URL file + .NAME); repeatable",
    )
    p.add_argument(
        "--operator-url-file",
        metavar="PATH",
        help="also write the operator URL (every permission: nats micro ls, debugging) here",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="run NATS without authentication (every local process can read every stream and "
        "publish into the services' subjects)",
    )
    p.add_argument(
        "--one-process",
        action="store_true",
        help="run the engine's four services in this process instead of one process each "
        "(less memory; slower: a model pass then holds up the scheduler and the bus)",
    )
    add_engine_flags(p)
    add_http_flags(p)
    add_shard_flags(p, many=True)
    add_log_flags(p)
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("bench", help="benchmarks: engine comparisons side by side")
    from services.bench.args import add_bench_arguments

    add_bench_arguments(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("train", help="train a small looped model on the stdlib corpus")
    from services.train.command import add_train_arguments

    add_train_arguments(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="what depth buys a trained checkpoint (loss, exits, sparse)")
    from services.evaluation.args import add_eval_arguments

    add_eval_arguments(p)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("service", help="run one service (for compose)")
    p.add_argument("name", choices=["admission", "scheduler", "worker", "prefix-cache", "gateway"])
    add_engine_flags(p)
    add_shard_flags(p, many=False)
    add_bus_flags(p)
    add_http_flags(p)
    p.add_argument(
        "--http-fd",
        type=int,
        default=None,
        help="serve HTTP on this already-listening socket (how `rlt up` starts its gateway)",
    )
    add_log_flags(p)
    p.set_defaults(func=cmd_service)
    return parser


def add_log_flags(p: argparse.ArgumentParser) -> None:
    from services.runtime.logging import LOG_FORMATS

    p.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=None,
        help="log lines on stderr as JSON objects (the default when stderr is not a "
        "terminal) or short console lines (the default on a terminal); also $RLT_LOG_FORMAT",
    )


def main(argv: Sequence[str] | None = None) -> int:
    from services.runtime.logging import configure_logging

    parser = build_parser()
    args = parser.parse_args(argv)
    # log lines on stderr; stdout stays for results
    try:
        configure_logging(log_format=getattr(args, "log_format", None))
    except ValueError as exc:  # a bad $RLT_LOG_LEVEL or $RLT_LOG_FORMAT
        parser.error(str(exc))
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
