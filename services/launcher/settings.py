"""What ``rlt up``, ``rlt service`` and the online ``rlt generate`` were asked, read once from
their parsed flags. Each ``from_args`` reads exactly its own command's flags (those
``services/cli.py`` adds), so a flag that is renamed or dropped fails here, at start-up,
and the code below works with typed fields instead of the argparse namespace.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from services.common.config import SchedulerConfig
from services.common.flags import scheduler_config_from_args
from services.common.service_flags import (
    api_keys_from_args,
    metrics_api_keys_from_args,
    shard_roles,
)


@dataclass(frozen=True)
class HttpSettings:
    """The gateway's HTTP listener."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # None: the checkpoint directory's name
    # `rlt service gateway --http-fd`: a socket `rlt up` already bound and listens on
    listen_fd: int | None = None
    api_keys: tuple[str, ...] = ()  # none: /v1/* is open
    metrics_api_keys: tuple[str, ...] = ()  # none: /metrics is open
    no_api_key: bool = False  # serving without keys beyond loopback was asked for

    @classmethod
    def from_args(cls, args: argparse.Namespace, *, listen_fd: int | None = None) -> HttpSettings:
        return cls(
            args.http_host,
            args.http_port,
            args.served_model_name,
            listen_fd,
            api_keys=api_keys_from_args(args),
            metrics_api_keys=metrics_api_keys_from_args(args),
            no_api_key=args.no_api_key,
        )


@dataclass(frozen=True)
class UpSettings:
    """``rlt up``: the deployment to run on this machine."""

    checkpoint: str | None  # None: the toy checkpoint
    config: SchedulerConfig
    device: str
    dtype: str  # a --dtype name: children parse it, and only the worker imports torch
    shards: int
    router: str
    one_process: bool
    host: str  # NATS listens here
    port: int  # the first node's client port (the others': port + 1, ...)
    nats_nodes: int
    insecure: bool
    tenants: tuple[str, ...]  # as given: checked when the deployment starts
    client_url_file: Path | None  # None: $RLT_CLIENT_URL_FILE, else ~/.rlt/client-url
    operator_url_file: Path | None
    http: HttpSettings = field(default_factory=HttpSettings)
    roles: tuple[str, ...] = ()  # each shard's role (empty: all colocated)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> UpSettings:
        roles = shard_roles(args.shards, args.prefill_shards, args.decode_shards)
        return cls(
            checkpoint=args.checkpoint,
            config=scheduler_config_from_args(args),
            device=args.device,
            dtype=args.dtype,
            shards=len(roles),
            router=args.router,
            one_process=args.one_process,
            host=args.host,
            port=args.port,
            nats_nodes=args.nats_cluster or 1,
            insecure=args.insecure,
            tenants=tuple(args.tenant or ()),
            client_url_file=Path(args.client_url_file) if args.client_url_file else None,
            operator_url_file=Path(args.operator_url_file) if args.operator_url_file else None,
            http=HttpSettings.from_args(args),
            roles=roles,
        )


@dataclass(frozen=True)
class ServiceSettings:
    """``rlt service NAME``: one service of a deployment (compose, or a child of rlt up)."""

    name: str
    nats_url: str
    checkpoint: str | None  # None: the toy checkpoint (prefix-cache needs none)
    config: SchedulerConfig
    device: str
    shard: str  # as given: checked when the service starts
    router: str
    http: HttpSettings = field(default_factory=HttpSettings)
    role: str = "both"  # the shard's role (scheduler, worker)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServiceSettings:
        return cls(
            name=args.name,
            nats_url=args.nats_url,
            checkpoint=args.checkpoint,
            config=scheduler_config_from_args(args),
            device=args.device,
            shard=args.shard,
            router=args.router,
            http=HttpSettings.from_args(args, listen_fd=args.http_fd),
            role=args.role,
        )


@dataclass(frozen=True)
class ClientSettings:
    """The online ``rlt generate``: where to send, and how to print what comes back."""

    nats_url: str | None  # None: $RLT_NATS_URL, else rlt up's client URL file, else local
    tenant: str  # "": the default tenant
    timeout_s: float
    retries: int  # resends of a request that got no answer (same request_id)
    json: bool  # one terminal event per request as JSON, instead of the streamed text

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ClientSettings:
        return cls(
            nats_url=args.nats_url,
            tenant=args.tenant or "",
            timeout_s=args.timeout,
            retries=args.retries,
            json=args.json,
        )
