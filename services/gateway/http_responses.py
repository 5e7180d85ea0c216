"""The gateway's two kinds of HTTP response, over the ASGI channel: a JSON body
(``json_response``), and server-sent events written as they are produced (``SseResponse``),
which stop as soon as the client goes away (``wait_disconnect``, also watched by a call
while it waits for its first token). ``responses.py`` shapes what the bodies hold.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from services.gateway.errors import ApiError

_JSON = msgspec.json.Encoder()


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_JSON.encode(body), status, headers, media_type="application/json")


def error_response(exc: ApiError) -> Response:
    """OpenAI's error body with the code's HTTP status (and Retry-After where it applies)."""
    return json_response(exc.body(), exc.status, exc.headers())


async def wait_disconnect(receive: Receive) -> None:
    """Returns once the client has gone away (the ASGI server's ``http.disconnect``)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class SseResponse(Response):
    """Server-sent events written as they are produced. The client going away (the ASGI
    server's ``http.disconnect``, or a failed write) stops the stream and calls ``gone``."""

    media_type = "text/event-stream"

    def __init__(self, frames: AsyncIterator[bytes], gone: Callable[[], Any]) -> None:
        self.frames = frames
        self.gone = gone
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        pump = asyncio.ensure_future(self._pump(send))
        listen = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await asyncio.wait({pump, listen}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            listen.cancel()
            if not pump.done():
                self.gone()  # first: the request is aborted before the stream unwinds
                pump.cancel()
                await _quietly(pump)
        if not pump.cancelled() and pump.exception() is not None:
            raise pump.exception()  # type: ignore[misc]

    async def _pump(self, send: Send) -> None:
        try:
            async for frame in self.frames:
                try:
                    await send({"type": "http.response.body", "body": frame, "more_body": True})
                except OSError:  # the write failed: the client is gone
                    self.gone()
                    return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self.frames.aclose()  # type: ignore[attr-defined]


async def _quietly(task: Awaitable[Any]) -> None:
    # a cancelled pump ends however it ends
    with contextlib.suppress(BaseException):
        await task
