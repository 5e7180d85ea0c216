"""NATS clients that drive and watch a running deployment from outside (the soak and fuzz
scripts and the reliability tests): a connection that rides out NATS restarts, a service's
health reply, and many generate streams collected on one connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec
import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from messages.api import ErrorEvent, FinishedEvent, TokenEvent
from services.runtime import subjects
from services.runtime.bus import encode_json, is_no_responders

Event = TokenEvent | FinishedEvent | ErrorEvent
_DECODER = msgspec.json.Decoder(Event)


async def health(nc: NATS, name: str, timeout: float = 5.0) -> dict[str, Any]:
    msg = await nc.request(subjects.health(name), b"", timeout=timeout)
    return json.loads(msg.data)


@contextlib.asynccontextmanager
async def client(url: str, **kwargs: Any) -> AsyncIterator[NATS]:
    """A client that reconnects quickly (it must ride out NATS restarts)."""

    async def quiet(_exc: Exception) -> None:  # reconnect attempts are expected here
        return None

    options: dict[str, Any] = {
        "error_cb": quiet,
        "reconnect_time_wait": 0.2,
        "max_reconnect_attempts": -1,
        "connect_timeout": 5,
        **kwargs,
    }
    nc = await nats.connect(url, **options)
    try:
        yield nc
    finally:
        with contextlib.suppress(Exception):
            await nc.close()


class StreamCollector:
    """Many streams on one connection: every event of every request, by request index.

    Counts terminal events per stream so a caller can assert "exactly one" after the fact."""

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self.prefix = nc.new_inbox()
        self.events: dict[int, list[Event]] = {}
        self.raw_errors: list[bytes] = []
        self.no_responders: set[int] = set()
        self._changed = asyncio.Event()

    async def start(self) -> StreamCollector:
        await self.nc.subscribe(f"{self.prefix}.*", cb=self._on_msg)
        return self

    def reply(self, index: int) -> str:
        return f"{self.prefix}.{index}"

    async def send(self, index: int, payload: bytes | Any, subject: str = "") -> None:
        data = payload if isinstance(payload, bytes) else encode_json(payload)
        self.events.setdefault(index, [])
        await self.nc.publish(subject or subjects.GENERATE, data, reply=self.reply(index))

    async def _on_msg(self, msg: Msg) -> None:
        index = int(msg.subject.rsplit(".", 1)[1])
        if is_no_responders(msg):
            self.no_responders.add(index)
        else:
            try:
                self.events.setdefault(index, []).append(_DECODER.decode(msg.data))
            except msgspec.DecodeError:
                self.raw_errors.append(msg.data)
        self._changed.set()

    def terminals(self, index: int) -> list[FinishedEvent | ErrorEvent]:
        return [e for e in self.events.get(index, []) if not isinstance(e, TokenEvent)]

    def done(self, indices: Sequence[int]) -> bool:
        return all(self.terminals(i) for i in indices)

    def tokens(self, index: int) -> list[TokenEvent]:
        return [e for e in self.events.get(index, []) if isinstance(e, TokenEvent)]

    async def wait_done(self, indices: Sequence[int], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.done(indices):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [i for i in indices if not self.terminals(i)]
                raise TimeoutError(f"no terminal event for {len(missing)} streams: {missing[:20]}")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=min(left, 0.5))
