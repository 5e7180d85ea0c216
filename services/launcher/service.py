"""``rlt service NAME``: one service in this process (how compose and ``rlt up`` run each)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Coroutine
from typing import Any

from services.common.flags import device_from_args
from services.launcher.build import admission_config, build_service, resolve_checkpoint
from services.launcher.settings import ServiceSettings
from services.runtime import subjects
from services.runtime.service import serve


def main_service(args: argparse.Namespace) -> int:
    settings = ServiceSettings.from_args(args)
    name = settings.name
    checkpoint = None if name == "prefix-cache" else resolve_checkpoint(settings.checkpoint)
    # only the worker runs a model: the others never import torch (their start and memory)
    device, dtype = device_from_args(args) if name == "worker" else (settings.device, None)
    try:
        shard = subjects.check_shard_id(settings.shard)
    except ValueError as exc:
        print(f"rlt service {name}: {exc}", file=sys.stderr)
        return 2
    service = build_service(
        name,
        settings.nats_url,
        checkpoint,
        settings.config,
        admission_config(settings.router),
        device=device,
        dtype=dtype,
        shard_id=shard,
        http=settings.http,
        role=settings.role,
    )
    return run_main(f"rlt service {name}", serve([service]))


def run_main(what: str, main: Coroutine[Any, Any, None]) -> int:
    """asyncio.run with the exits a command line wants: 0, 130 on an impatient Ctrl-C, and
    one readable line (not a traceback) when a service cannot start."""
    try:
        asyncio.run(main)
    except (KeyboardInterrupt, asyncio.CancelledError):
        return 130
    except (OSError, ValueError, ConnectionError) as exc:
        print(f"{what}: {exc}", file=sys.stderr)
        return 1
    return 0
