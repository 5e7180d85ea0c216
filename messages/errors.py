"""Error codes shared by every service and the public API."""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    INVALID_REQUEST = "invalid_request"
    OVERLOADED = "overloaded"
    NOT_FOUND = "not_found"
    UNAVAILABLE = "unavailable"
    INTERNAL = "internal"
    TIMEOUT = "timeout"  # a request outlived its deadline (RLT_MAX_REQUEST_S)


class RequestError(ValueError):
    """A request the system refuses; carries the code the client sees."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.INVALID_REQUEST) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
