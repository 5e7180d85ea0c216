"""structlog JSON logging shared by every service.

One JSON object per line, so the logs of all services can be merged and filtered by
``request_id`` / ``trace_id``. Field names are fixed here so every service uses the same
keys: ``service``, ``request_id``, ``trace_id``, ``batch_seq``, ``event_seq``.
Never log a whole prompt: log ``num_prompt_tokens`` instead. Prompts and outputs are
logged only when an operator asks for it with ``RLT_LOG_CONTENT=1`` (``log_content_enabled``).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, TextIO

import structlog

REQUEST_ID = "request_id"
TRACE_ID = "trace_id"
BATCH_SEQ = "batch_seq"
EVENT_SEQ = "event_seq"


class _Stderr:
    """Whatever ``sys.stderr`` is when a line is written, not when logging was configured:
    a stream swapped in and closed since (pytest's capture does both) is never written."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(level: str | None = None, stream: TextIO | None = None) -> None:
    """JSON lines to ``stream`` (default stderr) at ``level`` (default $RLT_LOG_LEVEL or info).

    Safe to call again (tests redirect the output to a buffer).
    """
    name = (level or os.environ.get("RLT_LOG_LEVEL") or "info").upper()
    numeric = logging.getLevelName(name)
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {name!r}")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        # filtering at the bound-logger level makes disabled debug calls nearly free
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.WriteLoggerFactory(file=stream or _Stderr()),
        # not cached, so a later configure_logging (tests) reaches loggers bound earlier
        cache_logger_on_first_use=False,
    )


def log_content_enabled() -> bool:
    """Whether prompts and outputs may be logged (``RLT_LOG_CONTENT=1``; off by default:
    they are user data)."""
    return os.environ.get("RLT_LOG_CONTENT", "").strip().lower() in ("1", "true", "yes")


def get_logger(service: str, **fields: Any) -> Any:
    """A logger bound to one service; add request/trace/batch fields per call."""
    return structlog.get_logger("rlt").bind(service=service, **fields)


def request_fields(request_id: str, trace_id: str = "") -> dict[str, str]:
    """The two fields that let one request be followed through every service."""
    out = {REQUEST_ID: request_id}
    if trace_id:
        out[TRACE_ID] = trace_id
    return out
