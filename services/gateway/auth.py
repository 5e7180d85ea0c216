"""API keys: ``Authorization: Bearer <key>`` on the gateway's routes, as OpenAI's API asks.

``--api-key`` guards every ``/v1/*`` route and ``--metrics-api-key`` guards ``/metrics``
(``/health`` stays open, for load balancers and orchestrators): ``Authorized`` answers a
request without a right key with a 401 in OpenAI's error shape, before any route sees it.
Keys are compared in constant time (the SHA-256 of what was sent against each key's, every
key every time, so neither a key's content nor its length nor which key matched shows in
the timing), and never logged.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from services.gateway.errors import INVALID_API_KEY, error_body
from services.gateway.metrics import GatewayMetrics, route_label

_SCHEME = "bearer"
_UNAUTHORIZED = msgspec.json.encode(
    error_body(
        INVALID_API_KEY, "a valid API key is needed: send the header Authorization: Bearer <key>"
    )
)


class ApiKeys:
    """A set of keys; empty: every request is allowed."""

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._digests = tuple(_digest(k.encode()) for k in keys if k)

    def __bool__(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def __repr__(self) -> str:  # never the keys themselves
        return f"ApiKeys({len(self)} keys)"

    def allows(self, authorization: bytes | None) -> bool:
        """Whether an ``Authorization`` header value carries one of the keys."""
        if not self._digests:
            return True
        if authorization is None:
            return False
        scheme, _, token = authorization.strip().partition(b" ")
        if scheme.decode("latin-1").lower() != _SCHEME:
            return False
        sent = _digest(token.strip())
        matched = False
        for digest in self._digests:  # no early exit: the time says nothing of which
            matched |= hmac.compare_digest(sent, digest)
        return matched


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


OPEN = ApiKeys()  # no keys: every request is allowed


class Authorized:
    """The app behind a check of API keys: a request for ``/v1/*`` needs one of
    ``api_keys``, one for ``/metrics`` one of ``metrics_api_keys`` (none: open); ``/health``
    is always open. A refusal is counted and logged (never with what was sent)."""

    def __init__(
        self,
        app: Starlette,
        metrics: GatewayMetrics,
        log: Any,
        api_keys: ApiKeys,
        metrics_api_keys: ApiKeys,
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.log = log
        self.api_keys = api_keys
        self.metrics_api_keys = metrics_api_keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            keys = self._keys_for(scope["path"])
            sent = next((v for k, v in scope["headers"] if k == b"authorization"), None)
            if not keys.allows(sent):
                route = route_label(scope, self.app.routes)
                self.metrics.count_response(scope, route, 401)
                self.log.info("http request without a valid API key", route=route)
                response = Response(
                    _UNAUTHORIZED,
                    401,
                    {"WWW-Authenticate": "Bearer"},
                    media_type="application/json",
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _keys_for(self, path: str) -> ApiKeys:
        if path == "/v1" or path.startswith("/v1/"):
            return self.api_keys
        if path == "/metrics":
            return self.metrics_api_keys
        return OPEN  # /health, and paths no route serves
