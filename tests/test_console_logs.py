"""Log lines read well where a person watches and stay JSON where machines read: on a
terminal ``rlt up`` and ``rlt service`` print short console lines (time, level, service,
event, the fields that matter; colour where the terminal has it), JSON everywhere else, and
``--log-format json|console`` forces either. ``rlt up`` hands its choice to its service
processes, so nothing on its terminal is a JSON object."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.launcher import NatsServer, free_port
from services.runtime.logging import (
    LOG_FORMAT_ENV,
    configure_logging,
    get_logger,
    resolve_log_format,
)

ANSI = re.compile(r"\x1b\[[0-9;]*m")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def _default_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in (LOG_FORMAT_ENV, "NO_COLOR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TERM", "xterm")
    yield
    configure_logging(log_format="json")  # as the other tests expect it


def _log_one(stream: io.StringIO, log_format: str | None = None) -> str:
    configure_logging(stream=stream, log_format=log_format)
    log = get_logger("scheduler", instance="a1b2c3")
    log.info("worker bound", worker="w-7", epoch="e.0", trace_id="f" * 32)
    return stream.getvalue()


@pytest.mark.unit
def test_the_format_follows_the_stream_unless_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_log_format(None, io.StringIO()) == "json"
    assert resolve_log_format(None, _Terminal()) == "console"
    assert resolve_log_format("json", _Terminal()) == "json"
    assert resolve_log_format("console", io.StringIO()) == "console"
    monkeypatch.setenv(LOG_FORMAT_ENV, "console")  # how rlt up hands its choice down
    assert resolve_log_format(None, io.StringIO()) == "console"
    assert resolve_log_format("json", io.StringIO()) == "json"  # a flag still wins
    monkeypatch.setenv(LOG_FORMAT_ENV, "xml")
    with pytest.raises(ValueError, match="log format"):
        resolve_log_format(None, io.StringIO())


@pytest.mark.unit
def test_json_lines_off_a_terminal_with_every_field() -> None:
    [line] = _log_one(io.StringIO()).splitlines()
    record = json.loads(line)
    assert record["event"] == "worker bound" and record["service"] == "scheduler"
    assert record["instance"] == "a1b2c3" and record["trace_id"] == "f" * 32
    assert record["timestamp"].endswith("Z")


@pytest.mark.unit
def test_console_lines_on_a_terminal_short_and_coloured(monkeypatch: pytest.MonkeyPatch) -> None:
    [line] = _log_one(_Terminal()).splitlines()
    assert "\x1b[" in line  # colour
    plain = ANSI.sub("", line)
    assert re.fullmatch(
        r"\d\d:\d\d:\d\d \[info\s*\] scheduler\s+worker bound\s+worker=w-7 epoch=e\.0", plain
    ), plain
    # forced on a stream that is no terminal: the same line, without colour
    forced = _log_one(io.StringIO(), "console")
    assert "\x1b[" not in forced and "worker bound" in forced and not forced.startswith("{")
    monkeypatch.setenv("NO_COLOR", "1")
    assert "\x1b[" not in _log_one(_Terminal())


@pytest.mark.unit
def test_console_tracebacks_carry_no_local_variables() -> None:
    stream = _Terminal()
    configure_logging(stream=stream)
    secret = "the user's prompt"  # noqa: F841 (a local a rich traceback would print)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        get_logger("worker").exception("batch failed", batch_seq=3)
    text = ANSI.sub("", stream.getvalue())
    assert "batch failed" in text and "RuntimeError: boom" in text
    assert "the user's prompt" not in text


# ---------------------------------------------------------------------- under a terminal


class _Pty:
    """A command whose stdin, stdout and stderr are one pseudo-terminal; its output as read."""

    def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
        master, slave = pty.openpty()
        self.proc = subprocess.Popen(
            cmd, stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True
        )
        os.close(slave)
        self.master = master
        self.text = ""

    def read_until(self, pattern: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, ANSI.sub("", self.text)):
            left = deadline - time.monotonic()
            assert left > 0, f"no {pattern!r} in:\n{self.text[-3000:]}"
            ready, _, _ = select.select([self.master], [], [], min(left, 0.5))
            if ready:
                try:
                    self.text += os.read(self.master, 65536).decode(errors="replace")
                except OSError:  # the terminal closed: it exited
                    why = f"exited ({self.proc.poll()}) before {pattern!r}:\n{self.text}"
                    raise AssertionError(why) from None
        return ANSI.sub("", self.text).replace("\r\n", "\n")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # Ctrl-C: it stops its services
            # keep reading: a process whose terminal buffer is full blocks in its next log
            # line and never gets to handle the signal
            deadline = time.monotonic() + 60
            while self.proc.poll() is None and time.monotonic() < deadline:
                ready, _, _ = select.select([self.master], [], [], 0.2)
                if ready:
                    try:
                        os.read(self.master, 65536)
                    except OSError:  # the terminal closed: it exited
                        break
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        os.close(self.master)


@contextlib.contextmanager
def _on_a_terminal(cmd: list[str], workdir: Path) -> Iterator[_Pty]:
    env = {
        **os.environ,
        "TERM": "xterm",
        "RLT_RUN_DIR": str(workdir),
        "RLT_LOG_LEVEL": "info",
        "OMP_NUM_THREADS": "1",
        "RLT_CLIENT_URL_FILE": str(workdir / "client-url"),
    }
    for name in ("RLT_NATS_URL", LOG_FORMAT_ENV, "NO_COLOR"):
        env.pop(name, None)
    term = _Pty([sys.executable, "-m", "services.cli", *cmd], env)
    try:
        yield term
    finally:
        term.stop()


def _json_objects(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.lstrip().startswith("{")]


@pytest.mark.services
def test_rlt_up_on_a_terminal_prints_console_lines_and_no_json_before_its_banner(
    toy_checkpoint: Path, tmp_path: Path
) -> None:
    before, text = _rlt_up_on_a_terminal(toy_checkpoint, tmp_path, r"gateway\s+service ready")
    assert not _json_objects(before), before
    assert not _json_objects(text), text  # nor after it
    # every service process logged, as console lines: the choice reached them
    for service in SERVICES:
        ready = rf"^\d\d:\d\d:\d\d \[info\s*\] {service}\s+service ready"
        assert re.search(ready, text, re.M), (service, text)


@pytest.mark.services
def test_rlt_up_log_format_json_reaches_its_service_processes(
    toy_checkpoint: Path, tmp_path: Path
) -> None:
    """On a terminal too: each child would pick console lines for itself, so this shows
    that ``rlt up`` hands its choice down."""
    gateway_ready = r'"service": "gateway"[^\n]*"event": "service ready"'
    _, text = _rlt_up_on_a_terminal(toy_checkpoint, tmp_path, gateway_ready, "--log-format", "json")
    records = [json.loads(line) for line in _json_objects(text)]
    ready = {r["service"] for r in records if r["event"] == "service ready"}
    assert ready == set(SERVICES), text
    assert not re.search(r"^\d\d:\d\d:\d\d ", text, re.M), text


SERVICES = ("worker", "scheduler", "admission", "prefix-cache", "gateway")


def _rlt_up_on_a_terminal(
    checkpoint: Path, workdir: Path, last: str, *extra: str
) -> tuple[str, str]:
    """What ``rlt up`` (and its service processes) printed on its terminal before its
    banner, and all it printed until ``last`` too (the gateway may log after the banner)."""
    cmd = ["up", "--port", str(free_port()), "--http-port", str(free_port())]
    with _on_a_terminal([*cmd, "--checkpoint", str(checkpoint), *extra], workdir) as term:
        term.read_until("rlt is up", 180)
        text = term.read_until(last, 30)
    return text[: text.index("rlt is up")], text


@pytest.mark.services
def test_rlt_service_on_a_terminal_is_console_unless_json_is_forced(tmp_path: Path) -> None:
    with NatsServer(port=free_port()) as server:
        cmd = ["service", "prefix-cache", "--nats-url", server.url]
        with _on_a_terminal(cmd, tmp_path) as term:
            text = term.read_until(r"prefix-cache\s+service ready", 60)
        assert not _json_objects(text), text
        with _on_a_terminal([*cmd, "--log-format", "json"], tmp_path) as term:
            text = term.read_until(r'"event": "service ready"', 60)
        records = [json.loads(line) for line in _json_objects(text)]
        assert records and all(r["service"] == "prefix-cache" for r in records), text
        assert not [line for line in text.splitlines() if re.match(r"\d\d:\d\d:\d\d ", line)]
