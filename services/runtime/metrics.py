"""Publishing a service's Prometheus metrics over NATS, for the gateway's ``/metrics``.

A service keeps ordinary ``prometheus_client`` metrics in its own ``CollectorRegistry``.
``MetricsPublisher`` sends the registry's text exposition to ``rlt.v1.metrics.<service>``
every ``RLT_METRICS_INTERVAL_S`` (1 s), with headers naming the service, the instance and
the shard, in parts when it is over the bus's max_payload (``MetricsReceiver`` joins
them). The gateway keeps the latest text of every instance and serves them all, each
sample labelled with its ``service``, ``instance`` and ``shard``, so several schedulers or
workers (shards, replicas) add up in one scrape (``sum by (...)``) and a restarted
instance is a new series whose counters start again, as Prometheus expects.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, NamedTuple

import prometheus_client
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from prometheus_client import CollectorRegistry

from services.runtime import subjects
from services.runtime.bus import Reassembler, publish_chunked

HEADER_SERVICE = "Rlt-Service"
HEADER_INSTANCE = "Rlt-Instance"
HEADER_SHARD = "Rlt-Shard"
DEFAULT_INTERVAL_S = 1.0

# `<name>_created` series double every counter and histogram on the wire for a timestamp
# nobody here reads (vLLM turns them off too)
prometheus_client.disable_created_metrics()


def metrics_interval_s() -> float:
    value = os.environ.get("RLT_METRICS_INTERVAL_S")
    return float(value) if value else DEFAULT_INTERVAL_S


class MetricsPublisher:
    def __init__(
        self,
        nc: NATS,
        service: str,
        instance: str,
        registry: CollectorRegistry,
        *,
        shard: str | None = None,
        log: Any = None,
    ) -> None:
        self.nc = nc
        self.subject = subjects.metrics(service)
        self.registry = registry
        self.interval_s = metrics_interval_s()
        self.headers = {HEADER_SERVICE: service, HEADER_INSTANCE: instance}
        if shard is not None:
            self.headers[HEADER_SHARD] = shard
        self.log = log

    async def run(self) -> None:
        while True:
            await self.publish()
            await asyncio.sleep(self.interval_s)

    async def publish(self) -> None:
        try:
            text = prometheus_client.generate_latest(self.registry)
            await publish_chunked(self.nc, self.subject, text, headers=self.headers)
        except Exception as exc:  # bus trouble or a collector bug: the next round retries
            if self.log is not None:
                self.log.warning("metrics not published", error=repr(exc)[:200])


# metrics texts being joined at once (one per instance publishing in parts), and their bytes
_MAX_PARTIAL_TEXTS = 64
_MAX_PARTIAL_BYTES = 16 << 20


class MetricsText(NamedTuple):
    """One instance's whole exposition text."""

    service: str
    instance: str
    shard: str | None
    text: str


class MetricsReceiver:
    """The gateway's side: joins texts that came in parts; messages without the service's
    headers are dropped."""

    def __init__(self) -> None:
        self._parts = Reassembler(max_partial=_MAX_PARTIAL_TEXTS, max_bytes=_MAX_PARTIAL_BYTES)

    def feed(self, msg: Msg) -> MetricsText | None:
        """The text ``msg`` completes, if any; ValueError if it is not UTF-8."""
        headers = msg.headers or {}
        service, instance = headers.get(HEADER_SERVICE), headers.get(HEADER_INSTANCE)
        if not service or not instance:
            return None
        data = self._parts.feed(msg)
        if data is None:
            return None
        return MetricsText(service, instance, headers.get(HEADER_SHARD), data.decode())
