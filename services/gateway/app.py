"""The HTTP side of the gateway: Starlette routes over a ``Backend`` (the NATS shell).

Each generation request's body is read (bounded), checked (``protocol.py``) and translated
(``translate.py``); a refusal up to there is answered at once, and the rest of its life,
from the NATS publish to the last byte, is a ``Call`` (``call.py``).

Every response is counted once in ``rlt:http_requests_total{route,status}``
(``GatewayMetrics.count_response``); with API keys (``auth.py``), ``/v1/*`` and ``/metrics``
answer 401 without one.
"""

from __future__ import annotations

import time

import prometheus_client
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp

from messages.errors import ErrorCode
from services.common.tool_template import template_tools
from services.gateway.auth import OPEN, ApiKeys, Authorized
from services.gateway.call import Backend, Call
from services.gateway.errors import ApiError, error_body
from services.gateway.http_responses import error_response, json_response
from services.gateway.metrics import route_label
from services.gateway.protocol import MAX_BODY_BYTES, parse_chat, parse_completion
from services.gateway.responses import models_body
from services.gateway.translate import options


def build_app(
    backend: Backend, api_keys: ApiKeys = OPEN, metrics_api_keys: ApiKeys = OPEN
) -> ASGIApp:
    """The gateway's ASGI app; ``api_keys`` guard ``/v1/*``, ``metrics_api_keys``
    ``/metrics`` (none: open)."""

    def counted(request: Request, response: Response) -> Response:
        backend.metrics.count_response(
            request.scope, route_label(request.scope), response.status_code
        )
        return response

    async def completions(request: Request) -> Response:
        return await _generate(backend, request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await _generate(backend, request, chat=True)

    async def models(request: Request) -> Response:
        listed = models_body(backend.model_name, backend.created, backend.max_model_len)
        return counted(request, json_response(listed))

    async def model(request: Request) -> Response:  # client.models.retrieve(name)
        name = request.path_params["name"]
        if name != backend.model_name:
            message = (
                f"The model `{name}` does not exist; this server serves `{backend.model_name}`"
            )
            return counted(
                request, json_response(error_body(ErrorCode.NOT_FOUND, message, "model"), 404)
            )
        listed = models_body(backend.model_name, backend.created, backend.max_model_len)
        return counted(request, json_response(listed["data"][0]))

    async def health(request: Request) -> Response:
        ready, details = await backend.readiness()
        body = {"status": "ready" if ready else "unavailable", **details}
        return counted(request, json_response(body, 200 if ready else 503))

    async def metrics(request: Request) -> Response:
        text = prometheus_client.generate_latest(backend.metrics.registry)
        return counted(request, Response(text, media_type=prometheus_client.CONTENT_TYPE_LATEST))

    async def http_error(request: Request, exc: Exception) -> Response:
        """Starlette's own 404 / 405, in OpenAI's error shape (SDKs parse every error body)."""
        assert isinstance(exc, HTTPException)
        code = ErrorCode.NOT_FOUND if exc.status_code == 404 else ErrorCode.INVALID_REQUEST
        body = error_body(code, str(exc.detail))
        return counted(request, json_response(body, exc.status_code, dict(exc.headers or {})))

    async def internal_error(request: Request, exc: Exception) -> Response:
        # the details go to the log, not to the client
        backend.log.error("gateway error", error=repr(exc)[:500])
        body = error_body(ErrorCode.INTERNAL, "internal gateway error")
        return counted(request, json_response(body, 500))

    app = Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{name:path}", model, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        exception_handlers={HTTPException: http_error, Exception: internal_error},
    )
    if not api_keys and not metrics_api_keys:
        return app
    return Authorized(app, backend.metrics, backend.log, api_keys, metrics_api_keys)


# ---------------------------------------------------------------------- generation
async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused once it passes ``limit`` bytes (before it is all in memory)."""
    too_large = ApiError(f"the request body is over {limit} bytes")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def _generate(backend: Backend, request: Request, *, chat: bool) -> Response:
    route = request.url.path
    started = time.monotonic()
    try:
        body = await _read_body(request, MAX_BODY_BYTES)
        req = parse_chat(body) if chat else parse_completion(body)
        if req.model is not None and req.model != backend.model_name:
            raise ApiError(
                f"The model `{req.model}` does not exist; this server serves "
                f"`{backend.model_name}`",
                ErrorCode.NOT_FOUND,
                "model",
            )
        if backend.draining:
            raise ApiError("the gateway is shutting down", ErrorCode.UNAVAILABLE)
        codec = backend.codec
        # what the chat template does with tools, probed once per template
        template = template_tools(codec) if codec is not None and chat and req.tools else None
        opts = options(req, codec.decode if codec else None, template)
    except ApiError as exc:
        backend.metrics.count_response(request.scope, route, exc.status)
        return error_response(exc)
    except ClientDisconnect:  # the client left while sending its body: nothing to answer
        backend.metrics.client_disconnects.inc()
        backend.metrics.count_response(request.scope, route, 499)
        backend.log.info("client disconnected before sending its whole body", route=route)
        return Response(status_code=499)
    call = Call(backend, req, opts, chat, request, started)
    return await call.run(request.receive)
