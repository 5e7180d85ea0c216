"""The gateway's errors in OpenAI's shape. Pure: no HTTP, no NATS.

``ApiError`` is a request the gateway answers with an error (its HTTP status and headers
from the rlt error code); ``error_body`` is the body the ``openai`` client parses, for
every error the gateway answers (refusals, 401s, 404s, the HTTP edge's own).
"""

from __future__ import annotations

from typing import Any

from messages.errors import ErrorCode

# the gateway's own code for a missing or wrong API key (OpenAI's)
INVALID_API_KEY = "invalid_api_key"
# rlt error code -> (HTTP status, OpenAI error type)
_STATUS: dict[str, tuple[int, str]] = {
    INVALID_API_KEY: (401, "invalid_request_error"),
    ErrorCode.INVALID_REQUEST: (400, "invalid_request_error"),
    ErrorCode.NOT_FOUND: (404, "not_found_error"),
    ErrorCode.OVERLOADED: (429, "rate_limit_error"),
    ErrorCode.UNAVAILABLE: (503, "service_unavailable_error"),
    ErrorCode.TIMEOUT: (504, "timeout_error"),
    ErrorCode.INTERNAL: (500, "server_error"),
}
# how long a client told "overloaded" should wait before retrying (seconds)
RETRY_AFTER_S = 1


class ApiError(Exception):
    """A request the gateway answers with an OpenAI error body."""

    def __init__(
        self, message: str, code: str = ErrorCode.INVALID_REQUEST, param: str | None = None
    ):
        super().__init__(message)
        self.message = message
        self.code = str(code)
        self.param = param

    @property
    def status(self) -> int:
        return status_of(self.code)

    def body(self) -> dict[str, Any]:
        return error_body(self.code, self.message, self.param)

    def headers(self) -> dict[str, str]:
        if self.status in (429, 503):
            return {"Retry-After": str(RETRY_AFTER_S)}
        return {}


def status_of(code: str) -> int:
    """The HTTP status an rlt error code answers with."""
    return _STATUS.get(code, (500, ""))[0]


def error_body(code: str, message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = _STATUS.get(code, (500, "server_error"))[1]
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
