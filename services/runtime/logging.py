"""structlog logging shared by every service.

Two formats. ``json`` (the default wherever the output is not a terminal: compose, CI,
files): one JSON object per line, so the logs of all services can be merged and filtered
by ``request_id`` / ``trace_id``. ``console`` (the default on a terminal): one short line per
event for a person watching (time, level, service, event, the fields that matter), in colour
where the terminal has it. ``--log-format`` or ``$RLT_LOG_FORMAT`` forces either; ``rlt up``
passes its choice to its service processes in ``$RLT_LOG_FORMAT`` (their output is its
terminal, or a pipe a test gave them: they must not decide on their own).

Field names are fixed here so every service uses the same keys: ``service``,
``request_id``, ``trace_id``, ``batch_seq``, ``event_seq``. Never log a whole prompt: log
``num_prompt_tokens`` instead. Prompts and outputs are logged only when an operator asks for
it with ``RLT_LOG_CONTENT=1`` (``log_content_enabled``).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, TextIO

import structlog

LOG_FORMATS = ("json", "console")
LOG_FORMAT_ENV = "RLT_LOG_FORMAT"
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


def configure_logging(
    level: str | None = None, stream: TextIO | None = None, log_format: str | None = None
) -> str:
    """Log lines to ``stream`` (default stderr) at ``level`` (default $RLT_LOG_LEVEL or
    info), as ``log_format`` (``resolve_log_format``); returns the format chosen.

    Safe to call again (tests redirect the output to a buffer).
    """
    name = (level or os.environ.get("RLT_LOG_LEVEL") or "info").upper()
    numeric = logging.getLevelName(name)
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {name!r}")
    out = stream or sys.stderr
    chosen = resolve_log_format(log_format, out)
    if chosen == "console":
        tail = [
            structlog.processors.TimeStamper(fmt="%H:%M:%S", utc=False),
            _drop_machine_fields,
            console_renderer(colors=_has_colors(out)),
        ]
    else:
        tail = [
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ]
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            *tail,
        ],
        # filtering at the bound-logger level makes disabled debug calls nearly free
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.WriteLoggerFactory(file=stream or _Stderr()),
        # not cached, so a later configure_logging (tests) reaches loggers bound earlier
        cache_logger_on_first_use=False,
    )
    return chosen


def resolve_log_format(given: str | None, stream: TextIO) -> str:
    """``given`` (a flag) wins, then ``$RLT_LOG_FORMAT``, then the stream: ``console`` on a
    terminal, ``json`` anywhere else."""
    chosen = given or os.environ.get(LOG_FORMAT_ENV, "").strip().lower() or None
    if chosen is None:
        return "console" if _is_terminal(stream) else "json"
    if chosen not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {chosen!r}")
    return chosen


# what a machine wants and a person watching does not: instance ids, micro ids, trace
# ids and URLs the banner already printed (the JSON lines keep every one)
CONSOLE_HIDDEN = ("instance", "micro_id", TRACE_ID, "nats_url")


def _drop_machine_fields(_logger: Any, _method: str, event: dict[str, Any]) -> dict[str, Any]:
    for key in CONSOLE_HIDDEN:
        event.pop(key, None)
    return event


def console_renderer(colors: bool) -> structlog.dev.ConsoleRenderer:
    """``HH:MM:SS level service event key=value ...``, one line, the service and the event
    in columns; tracebacks without local variables (they may hold user data)."""
    dev = structlog.dev
    styles = dev.ConsoleRenderer.get_default_column_styles(colors)
    levels = dev.ConsoleRenderer.get_default_level_styles(colors)

    def plain(width: int, style: str, prefix: str = "") -> dev.KeyValueColumnFormatter:
        return dev.KeyValueColumnFormatter(
            key_style=None,
            value_style=style,
            reset_style=styles.reset,
            value_repr=str,
            width=width,
            prefix=prefix,
        )

    return dev.ConsoleRenderer(
        columns=[
            dev.Column("timestamp", plain(0, styles.timestamp)),
            dev.Column("level", dev.LogLevelColumnFormatter(levels, styles.reset, width=7)),
            dev.Column("service", plain(12, styles.logger_name)),
            dev.Column("event", plain(28, styles.bright)),
            dev.Column(
                "",
                dev.KeyValueColumnFormatter(
                    key_style=styles.kv_key,
                    value_style=styles.kv_value,
                    reset_style=styles.reset,
                    value_repr=str,
                ),
            ),
        ],
        exception_formatter=dev.plain_traceback,
        sort_keys=False,
    )


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # closed
        return False


def _has_colors(stream: TextIO) -> bool:
    """A terminal that takes ANSI colours, unless the user said no (https://no-color.org)."""
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    return _is_terminal(stream)


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
