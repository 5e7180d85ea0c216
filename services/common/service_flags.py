"""The flags of a deployment: shards and their roles, the bus, the HTTP edge and its API keys,
and the command line of one ``rlt service`` child (``service_args``). The engine's and
requests' flags are ``flags.py``."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from services.common.config import SchedulerConfig
from services.common.flags import engine_args
from services.runtime.bus import DEFAULT_NATS_URL

ROUTER_POLICIES = ("prefix", "round-robin", "least-loaded")


SHARD_ROLES = ("both", "prefill", "decode")


def shard_roles(shards: int, prefill: int = 0, decode: int = 0) -> tuple[str, ...]:
    """Each shard's role, by shard id 0.. : ``--shards N`` colocated shards, or
    ``--prefill-shards P --decode-shards D`` (prefill 0..P-1, decode P..P+D-1)."""
    if not prefill and not decode:
        if shards < 1:
            raise ValueError(f"--shards must be >= 1, got {shards}")
        return ("both",) * shards
    if prefill < 1 or decode < 1:
        raise ValueError(
            f"disaggregation needs --prefill-shards and --decode-shards >= 1, got {prefill} "
            f"and {decode}"
        )
    if shards != 1:
        raise ValueError("--shards and --prefill-shards/--decode-shards are exclusive")
    return ("prefill",) * prefill + ("decode",) * decode


def add_shard_flags(p: argparse.ArgumentParser, *, many: bool) -> None:
    """``rlt up``: ``--shards N``; ``rlt service``: ``--shard ID`` (scheduler, worker).
    Both: ``--router`` (admission's routing policy)."""
    g = p.add_argument_group("shards")
    if many:
        g.add_argument(
            "--shards",
            type=int,
            default=1,
            metavar="N",
            help="engine shards (one scheduler + one worker each), ids 0..N-1 (default 1)",
        )
        g.add_argument(
            "--prefill-shards",
            type=int,
            default=0,
            metavar="P",
            help="prefill/decode disaggregation: P prefill shards (ids 0..P-1) that run prompts "
            "and first tokens, then hand each request to one of the --decode-shards (with its "
            "KV, over NIXL); replaces --shards",
        )
        g.add_argument(
            "--decode-shards",
            type=int,
            default=0,
            metavar="D",
            help="decode shards (ids P..P+D-1) that pull a request's prompt KV and decode it",
        )
    else:
        g.add_argument(
            "--shard",
            default="0",
            metavar="ID",
            help="the engine shard this scheduler or worker serves (default 0; a short "
            "string of [A-Za-z0-9_-])",
        )
        g.add_argument(
            "--role",
            choices=SHARD_ROLES,
            default="both",
            help="the shard's role (scheduler and worker): both (default: colocated), prefill "
            "(hands requests over after their first token) or decode (pulls their KV)",
        )
    g.add_argument(
        "--router",
        choices=ROUTER_POLICIES,
        default="prefix",
        help="admission's routing: prefix (cached prefix overlap against load, default), "
        "round-robin, least-loaded",
    )


def add_bus_flags(p: argparse.ArgumentParser, client: bool = False) -> None:
    if client:  # resolved later: $RLT_NATS_URL, else the file `rlt up` wrote, else local
        p.add_argument(
            "--nats-url",
            default=None,
            help="NATS server URL, or a comma-separated list for a cluster (default: "
            "$RLT_NATS_URL, else the client URL file of `rlt up`, else " + DEFAULT_NATS_URL + ")",
        )
        p.add_argument(
            "--tenant",
            default="",
            help="send as this tenant (rlt.v1.tenant.TENANT.*; its URL file is the client URL "
            "file + .TENANT)",
        )
        return
    p.add_argument(
        "--nats-url",
        default=os.environ.get("RLT_NATS_URL", DEFAULT_NATS_URL),
        help="NATS server URL, or a comma-separated list for a cluster (default: $RLT_NATS_URL)",
    )


# the gateway's keys when no flag names any: one key, or several one a line
API_KEY_ENV = "RLT_API_KEY"
METRICS_API_KEY_ENV = "RLT_METRICS_API_KEY"


def add_http_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("gateway (HTTP, OpenAI-compatible)")
    g.add_argument("--http-port", type=int, default=8000, help="default: 8000")
    g.add_argument("--http-host", default="127.0.0.1", help="default: 127.0.0.1 (loopback only)")
    g.add_argument(
        "--served-model-name",
        default=None,
        help="the model's name in the API (default: the checkpoint directory's name)",
    )
    g.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="every /v1/* request must send 'Authorization: Bearer KEY' (repeatable: any of "
        f"them; default: ${API_KEY_ENV}, one key a line; /health stays open). A command "
        "line shows in ps: prefer the environment or --api-key-file",
    )
    g.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="API keys, one a line (blank lines skipped; with --api-key: both)",
    )
    g.add_argument(
        "--metrics-api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="/metrics needs 'Authorization: Bearer KEY' (repeatable; default: "
        f"${METRICS_API_KEY_ENV}; without: /metrics is open)",
    )
    g.add_argument(
        "--no-api-key",
        action="store_true",
        help="serve the API without keys on a non-loopback --http-host (refused otherwise)",
    )


def api_keys_from_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The gateway's API keys: ``--api-key`` and ``--api-key-file``'s lines, else
    ``$RLT_API_KEY``'s lines; none: the API is open."""
    keys = list(args.api_key or ())
    if args.api_key_file is not None:
        try:
            lines = Path(args.api_key_file).read_text().splitlines()
        except OSError as exc:
            raise SystemExit(f"--api-key-file {args.api_key_file}: {exc.strerror}") from None
        from_file = [line.strip() for line in lines if line.strip()]
        if not from_file:  # an empty file must not leave the API open
            raise SystemExit(f"--api-key-file {args.api_key_file} holds no key")
        keys += from_file
    return _keys(keys, API_KEY_ENV, "--api-key")


def metrics_api_keys_from_args(args: argparse.Namespace) -> tuple[str, ...]:
    """``--metrics-api-key``, else ``$RLT_METRICS_API_KEY``'s lines; none: /metrics is open."""
    return _keys(list(args.metrics_api_key or ()), METRICS_API_KEY_ENV, "--metrics-api-key")


def _keys(given: list[str], env: str, flag: str) -> tuple[str, ...]:
    if not given:
        given = [line.strip() for line in os.environ.get(env, "").splitlines() if line.strip()]
    # a key travels in an HTTP header (and in rlt up's environment, one a line)
    if any(not key or any(c.isspace() or not c.isprintable() for c in key) for key in given):
        raise SystemExit(f"{flag}: a key is empty or holds whitespace or a control character")
    return tuple(given)


def service_args(
    name: str,
    checkpoint: str | Path | None,
    config: SchedulerConfig,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    shard: str | None = None,
    router: str = "prefix",
    role: str = "both",
) -> list[str]:
    """The flags of ``rlt service NAME`` (all but ``--nats-url``) that run it as part of a
    deployment with ``config``: ``rlt up``'s children and the bench's processes."""
    args = [] if name == "prefix-cache" else ["--checkpoint", str(checkpoint)]
    args += engine_args(config)
    args += ["--device", device, "--dtype", dtype]
    if os.environ.get("RLT_DECODE_MODE") == "eager":
        args.append("--no-cuda-graphs")
    if shard is not None:
        args += ["--shard", shard]
    if role != "both" and name in ("scheduler", "worker"):
        args += ["--role", role]
    if name == "admission":
        args += ["--router", router]
    return args
