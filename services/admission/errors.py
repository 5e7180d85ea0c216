"""The one error admission answers a client with, before or instead of a stream."""

from __future__ import annotations

from messages.api import ErrorEvent
from messages.errors import ErrorCode


class AdmissionError(Exception):
    """A refused request: its id (when one could be read), a code from ``ErrorCode`` and a
    message for the client."""

    def __init__(self, request_id: str, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.code = code
        self.message = message

    def event(self) -> ErrorEvent:
        return ErrorEvent(request_id=self.request_id, code=str(self.code), message=self.message)
