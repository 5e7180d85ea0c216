"""The whole system's metrics on one ``/metrics``: the gateway's own, plus the latest text
every scheduler and worker instance published over NATS (``services/runtime/metrics.py``).

Each published sample keeps its name and labels and gains ``service``, ``instance``, the
instance's ``shard`` when it has one, and ``model_name``, so one scrape holds every shard
and replica side by side; ``sum by (...)`` adds them up. An instance that stopped
publishing (it died or stopped) is dropped after ``stale_after_s``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from starlette.routing import BaseRoute, Match

# the route label of a response to a path no route serves (a label per path would let
# clients make series without end), or refused before routing (``edge.py``)
OTHER_ROUTE = "other"
_COUNTED = "rlt.counted"  # in an ASGI scope: its response is counted already


@dataclass
class _Published:
    service: str
    instance: str
    shard: str | None
    families: list[Metric]
    received: float


class ClusterMetrics(Collector):
    def __init__(self, model_name: str, stale_after_s: float = 15.0) -> None:
        self.model_name = model_name
        self.stale_after_s = stale_after_s
        self._latest: dict[tuple[str, str], _Published] = {}

    def update(
        self,
        service: str,
        instance: str,
        text: str,
        shard: str | None = None,
        now: float | None = None,
    ) -> None:
        """One instance's exposition text (raises ValueError when it does not parse)."""
        families = list(text_string_to_metric_families(text))
        received = time.monotonic() if now is None else now
        self._latest[(service, instance)] = _Published(service, instance, shard, families, received)

    def instances(self, now: float | None = None) -> list[tuple[str, str]]:
        self._drop_stale(time.monotonic() if now is None else now)
        return sorted(self._latest)

    def collect(self, now: float | None = None) -> Iterator[Metric]:
        self._drop_stale(time.monotonic() if now is None else now)
        merged: dict[str, Metric] = {}
        for key in sorted(self._latest):
            published = self._latest[key]
            extra = {
                "service": published.service,
                "instance": published.instance,
                "model_name": self.model_name,
            }
            if published.shard is not None:
                extra["shard"] = published.shard
            for family in published.families:
                out = merged.get(family.name)
                if out is None:
                    out = merged[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit
                    )
                for s in family.samples:
                    out.samples.append(
                        Sample(s.name, {**s.labels, **extra}, s.value, s.timestamp, s.exemplar)
                    )
        yield from merged.values()

    def _drop_stale(self, now: float) -> None:
        for key in [k for k, p in self._latest.items() if now - p.received > self.stale_after_s]:
            del self._latest[key]


class GatewayMetrics:
    """The gateway's registry: its own HTTP counters and the cluster's published metrics."""

    def __init__(self, model_name: str, stale_after_s: float = 15.0) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.cluster = ClusterMetrics(model_name, stale_after_s)
        self.registry.register(self.cluster)
        self.http_requests = Counter(
            "rlt:http_requests",
            "HTTP requests the gateway answered, by route and status code.",
            ["route", "status"],
            registry=self.registry,
        )
        self.client_disconnects = Counter(
            "rlt:http_client_disconnects",
            "Requests aborted because their HTTP client went away.",
            registry=self.registry,
        )

    def count_response(self, scope: MutableMapping[str, Any], route: str, status: int) -> None:
        """Counts a request's response in ``rlt:http_requests_total``, once: the first count
        wins (a stream that counted its status is not counted again should its end fail in
        the error handler)."""
        if scope.get(_COUNTED):
            return
        scope[_COUNTED] = True
        self.http_requests.labels(route, str(status)).inc()


def route_label(scope: MutableMapping[str, Any], routes: Sequence[BaseRoute] = ()) -> str:
    """The route a request went to (its path template), ``OTHER_ROUTE`` if none; ``routes``
    are matched here for a request not routed yet."""
    route = scope.get("route")
    if route is None:
        route = next((r for r in routes if r.matches(scope)[0] is not Match.NONE), None)
    return getattr(route, "path", OTHER_ROUTE)
