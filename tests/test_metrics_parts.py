"""Metrics over a bus with a small max_payload: a service's exposition text larger than one
message travels in parts and the gateway's receiver gets it whole (before, it was dropped
with a warning every interval, so /metrics lost that service)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import nats
import prometheus_client
import pytest
from nats.aio.msg import Msg
from prometheus_client import CollectorRegistry, Gauge

from services.launcher import NatsServer, free_port
from services.launcher.processes import wait_for
from services.runtime import subjects
from services.runtime.metrics import MetricsPublisher, MetricsReceiver

pytestmark = pytest.mark.services


def _registry(series: int) -> CollectorRegistry:
    registry = CollectorRegistry()
    gauge = Gauge("rlt_test_series", "One series per label value.", ["name"], registry=registry)
    for i in range(series):
        gauge.labels(name=f"series-{i:05d}").set(i)
    return registry


async def test_a_metrics_text_over_max_payload_arrives_whole(tmp_path: Path) -> None:
    conf = tmp_path / "small.conf"
    conf.write_text("max_payload: 8192\n")
    got: list[tuple[str, str, str | None, str]] = []
    receiver = MetricsReceiver()
    with NatsServer(port=free_port(), config_file=conf) as server:
        nc = await nats.connect(server.url)
        try:

            async def on_message(msg: Msg) -> None:
                text = receiver.feed(msg)
                if text is not None:
                    got.append(tuple(text))

            sub = await nc.subscribe(subjects.METRICS_ALL, cb=on_message)
            big, small = _registry(600), _registry(3)
            big_text = prometheus_client.generate_latest(big).decode()
            assert len(big_text) > 3 * nc.max_payload  # several parts
            for registry, shard in ((big, "0"), (small, None)):
                publisher = MetricsPublisher(nc, "scheduler", "inst-1", registry, shard=shard)
                await publisher.publish()
            await nc.flush()
            await wait_for(lambda: len(got) == 2, 2.0, "both metrics texts")
            assert [g[:3] for g in got] == [
                ("scheduler", "inst-1", "0"),
                ("scheduler", "inst-1", None),
            ]
            assert got[0][3] == big_text
            assert got[1][3] == prometheus_client.generate_latest(small).decode()
            # a message without the service's headers is not a metrics text: dropped
            await nc.publish(subjects.metrics("scheduler"), b"x 1\n")
            await nc.flush()
            await asyncio.sleep(0.1)
            assert len(got) == 2
            await sub.unsubscribe()
        finally:
            await nc.close()
