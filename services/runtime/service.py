"""The base actor: connect, set up, register with NATS micro, serve, drain, stop.

A service subclass provides ``setup`` (heavy init such as loading a checkpoint), its
``endpoints`` and, if it holds work, ``drain``. Every subscription is a NATS micro
endpoint, so ``nats micro ls``, ``nats micro info rlt-scheduler`` and ``nats micro stats``
show every service, its subjects and its counters. Each service also answers a JSON health
request on ``rlt.v1.health.<name>``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, ClassVar, Protocol

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.micro import add_service
from nats.micro.request import Request as MicroRequest
from nats.micro.service import Service as MicroService
from prometheus_client import CollectorRegistry

from services.runtime import subjects
from services.runtime.bus import BoundedHandler, connect, encode_json, redact_url
from services.runtime.logging import get_logger
from services.runtime.metrics import MetricsPublisher


def _version() -> str:
    try:
        return metadata.version("rlt")
    except metadata.PackageNotFoundError:
        return "0.0.0"


VERSION = _version()


# set by `rlt up` in its children's environment (services.runtime.child): its own pid
PARENT_PID_ENV = "RLT_PARENT_PID"
PARENT_POLL_S = 0.5


def runtime_dir() -> Path:
    """Where a service writes its identity file for container health checks."""
    return Path(os.environ.get("RLT_RUN_DIR", tempfile.gettempdir()))


def health_file(service: str, run_dir: Path | None = None) -> Path:
    """Where ``service`` writes its identity file once ready (``run_dir``: a child's own
    ``$RLT_RUN_DIR``; default: this process's)."""
    return (run_dir or runtime_dir()) / f"rlt-{service}.json"


def wrote_identity(service: str, run_dir: Path, pid: int) -> bool:
    """Whether process ``pid`` is the ``service`` whose identity file is in ``run_dir``: it
    is registered and serving (a file left by an earlier process does not count)."""
    try:
        return json.loads(health_file(service, run_dir).read_text()).get("pid") == pid
    except (OSError, ValueError, AttributeError):
        return False


@dataclass
class Endpoint:
    name: str
    subject: str
    handler: Callable[[Msg], Awaitable[None]]
    # None: the service's own queue group, so replicas share the load
    queue_group: str | None = None
    max_concurrency: int = 1
    # False: a plain subscription without queue group, not listed in micro. Needed where the
    # subscription must see nats-server's "no responders" status for our own publishes: the
    # server delivers it to a plain subscription on the reply subject, never to a queue one
    micro: bool = True


class Service:
    name: ClassVar[str] = "service"
    description: ClassVar[str] = ""
    # the engine shard this instance serves (None: unsharded); a label on its metrics and an
    # attribute of its spans
    shard: str | None = None

    def __init__(self, nats_url: str, *, connect_timeout_s: float = 60.0) -> None:
        self.nats_url = nats_url
        self.connect_timeout_s = connect_timeout_s
        self.instance_id = uuid.uuid4().hex[:12]
        self.log = get_logger(self.name, instance=self.instance_id)
        self.state = "created"
        self.draining = False
        self.started_at = 0.0
        self._nc: NATS | None = None
        self._micro: MicroService | None = None
        self._handlers: list[BoundedHandler] = []
        self._plain_subs: list[Subscription] = []
        self._tasks: set[asyncio.Task[None]] = set()  # running ones (each removes itself)
        self._metrics: MetricsPublisher | None = None
        # bus state: liveness judgements (heartbeats, reports) only count time connected
        self.bus_connected = False
        self.bus_connected_since = 0.0

    @property
    def nc(self) -> NATS:
        if self._nc is None:
            raise RuntimeError(f"{self.name} is not started")
        return self._nc

    # ------------------------------------------------------------------ subclass hooks
    async def setup(self) -> None:
        """Heavy initialisation, before any endpoint is registered (not ready yet)."""

    def endpoints(self) -> Sequence[Endpoint]:
        return ()

    async def on_ready(self) -> None:
        """Starts background loops; the endpoints are registered."""

    async def drain(self, timeout: float) -> None:
        """Finish in-flight work; ``self.draining`` is already set so new work is refused."""

    async def teardown(self) -> None:
        """Releases resources after the endpoints are gone."""

    def health_details(self) -> dict[str, Any]:
        return {}

    def metrics_registry(self) -> CollectorRegistry | None:
        """Prometheus metrics this service publishes for the gateway's ``/metrics`` (every
        ``RLT_METRICS_INTERVAL_S`` and once more when it stops); None publishes nothing."""
        return None

    async def on_bus_lost(self) -> None:
        """The NATS connection dropped (nats-py reconnects by itself)."""

    async def on_bus_back(self) -> None:
        """The NATS connection is back (subscriptions restored)."""

    # ------------------------------------------------------------------ lifecycle
    def health(self) -> dict[str, Any]:
        out = {
            "service": self.name,
            "instance": self.instance_id,
            "status": "draining" if self.draining else self.state,
            "uptime_s": round(time.monotonic() - self.started_at, 3) if self.started_at else 0.0,
            **self.health_details(),
        }
        errors = sum(h.num_errors for h in self._handlers)
        if errors:
            out["handler_errors"] = errors
        return out

    def spawn(self, coro: Awaitable[None], name: str) -> asyncio.Task[None]:
        """A background task that is cancelled on stop and whose crash is logged."""
        task = asyncio.ensure_future(coro)
        task.set_name(f"{self.name}:{name}")

        def done(t: asyncio.Task[None]) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                self.log.error("background task crashed", task=name, error=repr(t.exception()))

        task.add_done_callback(done)
        self._tasks.add(task)
        return task

    async def start(self) -> None:
        self.state = "starting"
        parent = os.environ.get(PARENT_PID_ENV)
        if parent:  # a child of `rlt up`: watched from the start (a checkpoint load is long)
            self.spawn(self._watch_parent(int(parent)), "watch-parent")
        try:
            await self._start()
        except BaseException:
            # a service that failed to start leaves nothing behind on the bus
            self.state = "failed"
            if self._micro is not None:
                await self._micro.stop()
            if self._nc is not None and not self._nc.is_closed:
                await self._nc.close()
            raise

    async def _start(self) -> None:
        self._nc = await connect(
            self.nats_url,
            f"rlt-{self.name}",
            connect_timeout_s=self.connect_timeout_s,
            log=self.log,
            closing=lambda: self.state in ("stopping", "stopped"),
            on_disconnected=self._bus_lost,
            on_reconnected=self._bus_back,
        )
        self.bus_connected = True
        self.bus_connected_since = time.monotonic()
        await self.setup()
        self._micro = await add_service(
            self.nc,
            name=subjects.micro_name(self.name),
            version=VERSION,
            description=self.description or self.name,
            metadata={"instance": self.instance_id},
            queue_group=f"rlt-{self.name}",
            stats_handler=lambda _stats: self.health(),
        )
        endpoints = [
            *self.endpoints(),
            Endpoint("health", subjects.health(self.name), self._on_health),
        ]
        for ep in endpoints:
            counter = _MicroErrorCounter()
            bounded = BoundedHandler(
                ep.handler, ep.max_concurrency, log=self.log, on_error=counter.count
            )
            self._handlers.append(bounded)
            if ep.micro:
                await self._micro.add_endpoint(
                    name=ep.name,
                    subject=ep.subject,
                    handler=_from_micro(bounded),
                    queue_group=ep.queue_group,
                )
                counter.endpoint = self._micro._endpoints[-1]
            else:
                self._plain_subs.append(await self.nc.subscribe(ep.subject, cb=bounded.__call__))
        await self.nc.flush()
        self.started_at = time.monotonic()
        self.state = "ready"
        self._write_health_file()
        registry = self.metrics_registry()
        if registry is not None:
            self._metrics = MetricsPublisher(
                self.nc, self.name, self.instance_id, registry, shard=self.shard, log=self.log
            )
            self.spawn(self._metrics.run(), "metrics")
        await self.on_ready()
        self.log.info("service ready", micro_id=self._micro.id, nats_url=redact_url(self.nats_url))

    async def _watch_parent(self, parent: int) -> None:
        """A child of ``rlt up`` (``services.runtime.child``) does not outlive it (nor
        start once it is gone)."""
        while os.getppid() == parent:
            await asyncio.sleep(PARENT_POLL_S)
        self.log.warning("rlt up is gone; stopping", parent_pid=parent)
        os.kill(os.getpid(), signal.SIGTERM)  # the same graceful stop as a signal from it

    async def stop(self, drain_timeout: float = 30.0) -> None:
        """Graceful: refuse new work, finish what is in flight, then unsubscribe and close."""
        if self.state in ("stopping", "stopped"):
            return
        self.draining = True
        self.log.info("service draining")
        if self._nc is not None and self.state == "ready":
            try:
                await self.drain(drain_timeout)
            except Exception:
                self.log.exception("drain failed")
        self.state = "stopping"
        if self._metrics is not None:
            await self._metrics.publish()  # the final counts, so nothing done goes unreported
        if self._micro is not None:
            await self._micro.stop()
        for sub in self._plain_subs:
            await sub.unsubscribe()
        for bounded in self._handlers:
            await bounded.wait_idle(timeout=5.0)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.teardown()
        if self._nc is not None and not self._nc.is_closed:
            try:
                await self._nc.drain()  # flushes what we published
            except Exception:
                await self._nc.close()
        health_file(self.name).unlink(missing_ok=True)
        self.state = "stopped"
        self.log.info("service stopped")

    async def _bus_lost(self) -> None:
        self.bus_connected = False
        await self.on_bus_lost()

    async def _bus_back(self) -> None:
        self.bus_connected = True
        self.bus_connected_since = time.monotonic()
        await self.on_bus_back()

    async def _on_health(self, msg: Msg) -> None:
        if msg.reply:
            await self.nc.publish(msg.reply, encode_json(self.health()))

    def _write_health_file(self) -> None:
        # identity for `python -m services.runtime.health NAME`: it pings this instance only
        assert self._micro is not None
        try:
            health_file(self.name).write_text(
                json.dumps(
                    {
                        "name": subjects.micro_name(self.name),
                        "id": self._micro.id,
                        "pid": os.getpid(),
                    }
                )
            )
        except OSError as exc:
            self.log.warning("could not write health file", error=repr(exc))


class _MicroErrorCounter:
    """Counts a handler's exceptions in its NATS micro endpoint's stats (``nats micro stats``
    shows ``num_errors`` and ``last_error``). Our handlers never raise into micro: micro would
    answer the message's reply subject with an error, and that reply subject is a client's
    stream. nats-py's micro has no public way to count an error, hence its private fields."""

    def __init__(self) -> None:
        self.endpoint: Any = None

    def count(self, exc: Exception) -> None:
        if self.endpoint is not None:
            self.endpoint._num_errors += 1
            self.endpoint._last_error = repr(exc)


def _from_micro(handler: BoundedHandler) -> Callable[[MicroRequest], Awaitable[None]]:
    # micro wraps each message in a Request without exposing the reply subject, which a
    # streaming reply needs; the raw message is its only attribute
    async def adapter(request: MicroRequest) -> None:
        await handler(request._msg)

    return adapter


class Runnable(Protocol):
    """What ``serve`` runs: a ``Service``, or a supervised child process
    (``services.runtime.child``)."""

    name: str
    state: str

    async def start(self) -> None: ...

    async def stop(self, drain_timeout: float) -> None: ...


async def serve(
    services: Sequence[Runnable], drain_timeout: float = 30.0, stop: asyncio.Event | None = None
) -> None:
    """Starts the services in order, runs until SIGINT/SIGTERM (or ``stop``), then stops
    them in reverse order, each draining first. A second signal abandons the drain."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()

    starting = True

    def on_signal() -> None:
        # during start-up (e.g. still waiting for NATS) or on a second, impatient signal,
        # give up at once; otherwise drain gracefully
        if (starting or stop.is_set()) and main is not None:
            main.cancel()
        stop.set()

    installed: list[signal.Signals] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, on_signal)
            installed.append(sig)
        except (NotImplementedError, RuntimeError):  # not the main thread / platform
            pass
    started: list[Runnable] = []
    try:
        for service in services:
            await service.start()
            started.append(service)
        starting = False
        await stop.wait()
    finally:
        try:
            for service in reversed(started):
                await service.stop(drain_timeout)
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)
