"""The services of a deployment, built as objects in this process (``build_service``,
``build_services``) or as ``rlt service`` child processes (``service_processes``).

Each service's module is imported only when that service is built: only the worker runs a
model, so the others never import torch (their start-up time and memory).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from services.common.config import SchedulerConfig
from services.common.flags import torch_dtype
from services.common.service_flags import service_args
from services.launcher.settings import HttpSettings
from services.runtime import subjects
from services.runtime.child import ServiceProcess
from services.runtime.service import Service

if TYPE_CHECKING:
    import torch

    from services.admission.core import AdmissionConfig

SERVICE_ORDER = ("worker", "prefix-cache", "scheduler", "admission")  # start order
# `rlt up` starts the HTTP gateway after these (the public entry points last)
GATEWAY = "gateway"
_PER_SHARD = ("worker", "scheduler")


def build_service(
    name: str,
    nats_url: str,
    checkpoint: str | Path | None,
    config: SchedulerConfig,
    admission_config: AdmissionConfig | None = None,
    *,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    shard_id: str = subjects.DEFAULT_SHARD,
    http: HttpSettings | None = None,
    role: str = "both",
) -> Service:
    """One service object (not started). ``checkpoint`` is needed by all but prefix-cache;
    ``device`` and ``dtype`` are the worker's; ``shard_id`` is the scheduler's and the
    worker's (admission's routing policy is ``admission_config.router``); ``http`` the
    gateway's."""
    if name == "prefix-cache":
        from services.prefix_cache.service import PrefixCacheService

        return PrefixCacheService(nats_url)
    if checkpoint is None:
        raise ValueError(f"the {name} service needs a checkpoint")
    if name == "worker":
        from services.worker.service import WorkerService

        return WorkerService(
            nats_url,
            checkpoint,
            config,
            device=device,
            dtype=dtype if dtype is not None else torch_dtype("float32"),
            heartbeat_interval_s=float(os.environ.get("RLT_WORKER_HEARTBEAT_S", "0.5")),
            shard_id=shard_id,
            inline_max_s=_inline_max_s(),
            kv_transfer=role != "both",  # a NIXL agent: serve (prefill) or pull (decode) KV
        )
    if name == "scheduler":
        from services.scheduler.options import SchedulerOptions
        from services.scheduler.service import SchedulerService

        options = SchedulerOptions.from_env(shard_id=shard_id, role=role)
        return SchedulerService(nats_url, checkpoint, config, options=options)
    if name == "admission":
        from services.admission.service import AdmissionService

        return AdmissionService(nats_url, checkpoint, admission_config, scheduler_config=config)
    if name == GATEWAY:
        from services.gateway.service import GatewayService

        http = http if http is not None else HttpSettings()
        return GatewayService(
            nats_url,
            checkpoint,
            host=http.host,
            port=http.port,
            served_model_name=http.served_model_name,
            listen_fd=http.listen_fd,
            api_keys=http.api_keys,
            metrics_api_keys=http.metrics_api_keys,
        )
    raise ValueError(f"unknown service {name!r}; choose one of {subjects.SERVICE_NAMES}")


def build_services(
    nats_url: str,
    checkpoint: str | Path,
    config: SchedulerConfig,
    admission_config: AdmissionConfig | None = None,
    names: Sequence[str] = SERVICE_ORDER,
    *,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    shards: int = 1,
    url_for: Callable[[str], str] | None = None,
    roles: Sequence[str] = (),
) -> list[Service]:
    """Services in start order: the pipeline's back end first, the public entry point last;
    a worker and a scheduler per shard (ids 0..shards-1, ``roles[i]`` each: both by
    default). ``url_for(name)``: the NATS URL (with that service's credentials) when it is
    not ``nats_url``."""
    _check_shards(shards)
    roles = roles or ("both",) * shards
    out: list[Service] = []
    for name in (n for n in SERVICE_ORDER if n in names):
        for i in range(shards if name in _PER_SHARD else 1):
            out.append(
                build_service(
                    name,
                    url_for(name) if url_for is not None else nats_url,
                    checkpoint,
                    config,
                    admission_config,
                    device=device,
                    dtype=dtype,
                    shard_id=str(i),
                    role=roles[i] if name in _PER_SHARD else "both",
                )
            )
    return out


def service_processes(
    nats_url: str,
    checkpoint: str | Path,
    config: SchedulerConfig,
    run_dir: Path,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    shards: int = 1,
    router: str = "prefix",
    url_for: Callable[[str], str] | None = None,
    roles: Sequence[str] = (),
) -> list[ServiceProcess]:
    """``build_services``, each service as a supervised ``rlt service`` child process (in
    start order; a worker and a scheduler per shard). ``run_dir``: where each child gets a
    folder for its identity file."""
    _check_shards(shards)
    roles = roles or ("both",) * shards
    out: list[ServiceProcess] = []
    for name in SERVICE_ORDER:
        per_shard = name in _PER_SHARD
        for i in range(shards if per_shard else 1):
            shard = str(i) if per_shard else None
            role = roles[i] if per_shard else "both"
            args = service_args(
                name, checkpoint, config, device=device, dtype=dtype, shard=shard, router=router,
                role=role,
            )  # fmt: skip
            url = url_for(name) if url_for is not None else nats_url
            key = name if shard is None else f"{name}-{shard}"
            out.append(ServiceProcess(name, url, args, run_dir / key))
    return out


def admission_config(router: str) -> AdmissionConfig:
    """Admission's config from the environment, with the ``--router`` policy."""
    from services.admission.core import AdmissionConfig

    return dataclasses.replace(AdmissionConfig.from_env(), router=router)


def resolve_checkpoint(path: str | Path | None) -> Path:
    """The checkpoint named, else the toy one (written once, which needs torch)."""
    if path:
        return Path(path)
    from services.worker.model.toy import ensure_checkpoint

    return ensure_checkpoint(None)


def _check_shards(shards: int) -> None:
    if shards < 1:
        raise ValueError(f"--shards must be >= 1, got {shards}")


def _inline_max_s() -> float | None:
    """``RLT_WORKER_INLINE_MAX_MS``: batches expected to run under this many ms run on the
    worker's event loop (0: none; unset: the device's default, services/worker/compute.py)."""
    value = os.environ.get("RLT_WORKER_INLINE_MAX_MS")
    return None if value is None or value == "" else float(value) / 1e3
