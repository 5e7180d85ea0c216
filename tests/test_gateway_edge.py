"""The gateway's HTTP edge, over real HTTP: the gateway's own server (``edge.py``, uvicorn's
httptools protocol with a bounded head) serving the app over a scripted backend on a
loopback port, no NATS.

- A malformed body is a 400, never a 500: JSON nested too deeply answers as the NATS API
  does; what the HTTP parser cannot read is a 400 in OpenAI's shape.
- Every response, 4xx and 5xx included, is counted once in ``rlt:http_requests_total``.
- A request's head is bounded in size (a 32 MB header, too many fields: 431) and in time
  (a client holding an unfinished head is dropped), and heads and bodies within the bounds
  are served as before.
- A client that disconnects mid-body is one info log line, without a traceback.
"""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from services.gateway.edge import HttpLimits
from services.runtime.logging import configure_logging
from tests.gateway_helpers import ScriptedBackend, http_served, metric_sums, token_events

pytestmark = pytest.mark.unit


def _backend(**kw: Any) -> ScriptedBackend:
    return ScriptedBackend(lambda r: token_events(r.request_id, ["a", "b"]), **kw)


async def _counts(http: httpx.AsyncClient) -> dict[str, float]:
    return metric_sums((await http.get("/metrics")).text)


def _count(counts: dict[str, float], route: str, status: int) -> float:
    return counts.get(f'rlt:http_requests_total{{route="{route}",status="{status}"}}', 0.0)


async def _exchange(url: str, data: bytes, timeout: float = 5.0) -> bytes:
    """Sends raw bytes on a new connection; returns what came back until the server closed
    it (a reset after the server stopped reading counts as closed)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        for start in range(0, len(data), 1 << 20):
            writer.write(data[start : start + (1 << 20)])
            await writer.drain()
    except OSError:
        pass  # the server closed the connection while this was still sending
    received = b""
    try:
        async with asyncio.timeout(timeout):
            while chunk := await reader.read(1 << 16):
                received += chunk
    except OSError:
        pass
    finally:
        writer.close()
    return received


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def _error_of(answer: bytes) -> dict[str, Any]:
    return json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]


@pytest.fixture()
async def served() -> AsyncIterator[tuple[ScriptedBackend, str, httpx.AsyncClient]]:
    backend = _backend()
    async with (
        http_served(backend) as url,
        httpx.AsyncClient(base_url=url, timeout=10) as http,
    ):
        yield backend, url, http


async def test_a_body_nested_too_deeply_is_a_400_as_on_the_nats_api(
    served: tuple[ScriptedBackend, str, httpx.AsyncClient],
) -> None:
    backend, _url, http = served
    deep = b"[" * 1000 + b"]" * 1000
    bodies = {
        "/v1/completions": b'{"prompt": ' + deep + b"}",
        "/v1/chat/completions": b'{"messages": [{"role": "user", "content": "x", "x": '
        + deep
        + b"}]}",
    }
    for path, body in bodies.items():
        r = await http.post(path, content=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["message"] == "invalid JSON: nested too deeply"
        assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_request")
    counts = await _counts(http)
    assert _count(counts, "/v1/completions", 400) == 1
    assert _count(counts, "/v1/chat/completions", 400) == 1
    assert backend.sent == []  # nothing reached the engine


async def test_every_response_is_counted_once_errors_included() -> None:
    # the second choice's request cannot be sent: an exception inside the call (a 500)
    backend = _backend(fail_open=1)
    async with http_served(backend) as url, httpx.AsyncClient(base_url=url) as http:
        answers = [
            await http.post("/v1/completions", json={"prompt": "hi"}),
            await http.post("/v1/completions", json={"prompt": "hi", "n": 2}),
            await http.post("/v1/completions", content=b"{oops"),
            await http.get("/v1/completions"),
            await http.get("/v1/models/other"),
            await http.get("/v1/models"),
            await http.get("/nothing/here"),
            await http.get("/health"),
        ]
        assert [r.status_code for r in answers] == [200, 500, 400, 405, 404, 200, 404, 200]
        for r in answers[1:5] + answers[6:7]:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert answers[1].json()["error"]["message"] == "internal gateway error"
        counts = await _counts(http)
    expected = {
        ("/v1/completions", 200): 1,
        ("/v1/completions", 500): 1,
        ("/v1/completions", 400): 1,
        ("/v1/completions", 405): 1,
        ("/v1/models/{name:path}", 404): 1,
        ("/v1/models", 200): 1,
        ("other", 404): 1,  # a path no route serves: one label, whatever the path
        ("/health", 200): 1,
    }
    for (route, status), n in expected.items():
        assert _count(counts, route, status) == n, (route, status)
    assert counts["rlt:http_requests_total"] == len(answers)  # each once


async def test_a_32_mb_header_is_refused_and_the_gateway_serves_on(
    served: tuple[ScriptedBackend, str, httpx.AsyncClient],
) -> None:
    url, http = served[1:]
    head = b"GET /v1/models HTTP/1.1\r\nHost: rlt\r\nX-Big: " + b"x" * (32 << 20)
    started = time.monotonic()
    answer = await _exchange(url, head)
    # a 431, or a connection closed under the sender (the answer lost in the reset)
    assert answer == b"" or _status(answer) == 431, answer[:200]
    if answer:
        assert "over 65536 bytes" in _error_of(answer)["message"]
    assert time.monotonic() - started < 5
    assert (await http.get("/v1/models")).status_code == 200
    assert _count(await _counts(http), "other", 431) == 1


async def test_too_many_header_fields_are_a_431_in_openai_shape(
    served: tuple[ScriptedBackend, str, httpx.AsyncClient],
) -> None:
    url, http = served[1:]
    fields = b"".join(b"X-F%d: v\r\n" % i for i in range(200))
    answer = await _exchange(url, b"GET /v1/models HTTP/1.1\r\nHost: rlt\r\n" + fields + b"\r\n")
    assert _status(answer) == 431
    assert b"connection: close" in answer.lower()
    error = _error_of(answer)
    assert error["message"] == "more than 128 header fields"
    assert error["type"] == "invalid_request_error"
    # what the parser cannot read at all: a 400, in the same shape
    answer = await _exchange(url, b"NOT HTTP AT ALL\r\n\r\n")
    assert _status(answer) == 400 and _error_of(answer)["message"] == "invalid HTTP request"
    counts = await _counts(http)
    assert _count(counts, "other", 431) == 1 and _count(counts, "other", 400) == 1


async def test_a_client_holding_an_unfinished_head_is_dropped_in_bounded_time() -> None:
    limits = HttpLimits(head_timeout_s=0.5)
    async with http_served(_backend(), limits) as url, httpx.AsyncClient(base_url=url) as http:
        host, port = url.removeprefix("http://").split(":")

        async def held(first: bytes, then: bytes) -> tuple[bytes, float]:
            """Sends ``first`` (read whole), then ``then`` and nothing more: what comes
            back once the gateway closes, and after how long."""
            reader, writer = await asyncio.open_connection(host, int(port))
            if first:
                writer.write(first)
                await reader.readuntil(b'"toy"')  # the whole answer to the first request
                await reader.read(1 << 16)
            writer.write(then)
            started = time.monotonic()
            received = await asyncio.wait_for(reader.read(1 << 16), 5)
            rest = await asyncio.wait_for(reader.read(1 << 16), 5)
            assert rest == b""  # closed
            writer.close()
            return received, time.monotonic() - started

        partial = b"GET /v1/models HTTP/1.1\r\nHost: rlt\r\nX-Slow: "
        answer, waited = await held(b"", partial)
        assert _status(answer) == 408 and 0.3 < waited < 2.0
        assert "took over 0.5 s" in _error_of(answer)["message"]
        # a connection that sends nothing is closed without an answer
        answer, waited = await held(b"", b"")
        assert answer == b"" and waited < 2.0
        # on a kept-alive connection, the next head's clock starts at its first byte
        whole = b"GET /v1/models HTTP/1.1\r\nHost: rlt\r\n\r\n"
        answer, waited = await held(whole, partial)
        assert _status(answer) == 408 and 0.3 < waited < 2.0
        assert _count(await _counts(http), "other", 408) == 2


async def test_heads_and_bodies_within_the_bounds_are_served() -> None:
    limits = HttpLimits(head_timeout_s=1.0)
    async with http_served(_backend(), limits) as url, httpx.AsyncClient(base_url=url) as http:
        # a head sent slowly, in pieces, each within the bound
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        for piece in (b"GET /v1/mo", b"dels HTTP/1.1\r\nHo", b"st: rlt\r\n\r\n"):
            writer.write(piece)
            await asyncio.sleep(0.2)
        assert (await reader.readline()).startswith(b"HTTP/1.1 200")
        writer.close()
        # 60 KiB of headers (under the 64 KiB bound)
        r = await http.get("/v1/models", headers={f"x-h{i}": "v" * 1000 for i in range(60)})
        assert r.status_code == 200
        # a 1 MB body, and two requests pipelined in one write after a 300 KB body: body
        # bytes never count against the head's bound
        big = json.dumps({"prompt": "hi", "user": "u" * (1 << 20)}).encode()
        r = await http.post("/v1/completions", content=big)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ab"
        body = json.dumps({"prompt": "hi", "user": "u" * 300_000}).encode()
        post = (
            b"POST /v1/completions HTTP/1.1\r\nHost: rlt\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body
        )
        get = b"GET /v1/models HTTP/1.1\r\nHost: rlt\r\nConnection: close\r\n\r\n"
        answers = await _exchange(url, post + get)
        assert answers.count(b"HTTP/1.1 200 OK") == 2, answers[:300]


async def test_a_client_gone_mid_body_is_one_info_line_without_a_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    logs = io.StringIO()
    configure_logging(stream=logs)  # before the backend binds its logger
    backend = _backend()
    try:
        async with http_served(backend) as url, httpx.AsyncClient(base_url=url) as http:
            host, port = url.removeprefix("http://").split(":")
            _reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: rlt\r\nContent-Length: 1000\r\n\r\n"
                b'{"prompt": "h'
            )
            await writer.drain()
            await asyncio.sleep(0.2)  # the route is reading the body
            writer.close()
            deadline = time.monotonic() + 5
            while "client disconnected" not in logs.getvalue() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            counts = await _counts(http)
    finally:
        configure_logging()
    lines = [json.loads(line) for line in logs.getvalue().splitlines()]
    gone = [e for e in lines if "disconnected" in e["event"]]
    assert len(gone) == 1, lines
    assert gone[0]["level"] == "info"
    assert gone[0]["event"] == "client disconnected before sending its whole body"
    assert not [e for e in lines if e["level"] in ("error", "warning")], lines
    assert "Traceback" not in capsys.readouterr().err
    assert _count(counts, "/v1/completions", 499) == 1
    assert counts["rlt:http_client_disconnects_total"] == 1
    assert backend.sent == []
