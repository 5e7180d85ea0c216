"""``rlt up`` runs every service in a process of its own (as compose does), supervises them,
and takes them with it; ``--one-process`` keeps the engine's four in its own process.

Both layouts serve the serial oracle's tokens over NATS; a killed worker process comes back
and serves them again; Ctrl-C and a killed ``rlt up`` leave no process behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest

from messages.api import FinishedEvent
from messages.sampling import SamplingParams
from services.bench.processes import child_pid, child_pids, cmdline
from services.common.config import SchedulerConfig
from services.launcher import free_port
from services.oracle import SerialOracle
from tests.engine_harness import assert_matches_oracle, oracle_result
from tests.service_procs import alive, start_rlt_up

PROMPTS = ([5, 17, 42, 99], [3, 1, 4, 1, 5, 9, 2, 6], [250, 7])
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, min_loops=1,
                        exit_threshold=0.7)  # fmt: skip
SERVICES = ("worker", "prefix-cache", "scheduler", "admission")


@dataclass
class Up:
    proc: subprocess.Popen[str]
    env: dict[str, str]
    stderr: Path

    def log_events(self) -> list[str]:
        out = []
        for line in self.stderr.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line).get("event", ""))
        return out


@contextlib.contextmanager
def _rlt_up(checkpoint: Path, workdir: Path, *extra: str) -> Iterator[Up]:
    env = {
        **os.environ,
        "RLT_RUN_DIR": str(workdir),
        "RLT_LOG_LEVEL": "info",
        "OMP_NUM_THREADS": "1",
        "RLT_CLIENT_URL_FILE": str(workdir / "client-url"),
    }
    env.pop("RLT_NATS_URL", None)
    cmd = [sys.executable, "-m", "services.cli", "up", "--port", str(free_port())]
    cmd += ["--http-port", str(free_port()), "--checkpoint", str(checkpoint), *extra]
    stderr = workdir / "rlt-up.log"
    proc, _ = start_rlt_up(cmd, env, stderr)
    try:
        yield Up(proc, env, stderr)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _service_argvs(up: Up) -> dict[int, list[str]]:
    """{pid: argv} of rlt up's `rlt service` children."""
    out = {}
    for pid in child_pids(up.proc.pid):
        argv = cmdline(pid)
        if "service" in argv:
            out[pid] = argv
    return out


def _identity_file(pid: int) -> Path:
    """Where a service child writes its identity file once it is ready."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    run_dir = next(e for e in environ if e.startswith(b"RLT_RUN_DIR=")).split(b"=", 1)[1]
    name = cmdline(pid)[cmdline(pid).index("service") + 1]
    return Path(run_dir.decode()) / f"rlt-{name}.json"


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1] if name in argv else ""


def _services(up: Up) -> dict[str, int]:
    """{service name: pid} of rlt up's `rlt service` children (one shard)."""
    return {argv[argv.index("service") + 1]: pid for pid, argv in _service_argvs(up).items()}


def _generate(up: Up) -> list[FinishedEvent]:
    cmd = [sys.executable, "-m", "services.cli", "generate", "--json", "--ignore-eos"]
    cmd += ["--max-tokens", str(PARAMS.max_tokens), "--min-loops", str(PARAMS.min_loops)]
    cmd += ["--exit-threshold", str(PARAMS.exit_threshold)]
    for prompt in PROMPTS:
        cmd += ["--prompt-ids", ",".join(map(str, prompt))]
    done = subprocess.run(cmd, capture_output=True, text=True, env=up.env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return [msgspec.json.decode(line, type=FinishedEvent) for line in done.stdout.splitlines()]


def _check_oracle(up: Up, oracle: SerialOracle) -> None:
    events = _generate(up)
    assert len(events) == len(PROMPTS)
    for prompt, event in zip(PROMPTS, events, strict=True):
        expected = oracle_result(oracle, list(prompt), PARAMS, SchedulerConfig())
        assert assert_matches_oracle(event, expected, str(prompt)) > 0


def _stop(up: Up) -> list[int]:
    """Ctrl-C: rlt up exits 0 and every process it started is gone."""
    children = child_pids(up.proc.pid)
    up.proc.send_signal(signal.SIGINT)
    assert up.proc.wait(timeout=90) == 0
    deadline = time.monotonic() + 20
    while [pid for pid in children if alive(pid)]:
        assert time.monotonic() < deadline, [cmdline(p) for p in children if alive(p)]
        time.sleep(0.1)
    return children


@pytest.mark.slow
def test_rlt_up_runs_a_process_per_service_and_restarts_a_dead_one(
    toy_checkpoint: Path, tmp_path: Path, oracle: SerialOracle
) -> None:
    with _rlt_up(toy_checkpoint, tmp_path) as up:
        procs = _services(up)
        assert set(procs) == {*SERVICES, "gateway"}
        assert len(set(procs.values())) == 5 and up.proc.pid not in procs.values()
        for pid in procs.values():  # credentials travel in the environment
            argv = cmdline(pid)
            assert "@" not in argv[argv.index("--nats-url") + 1]
        _check_oracle(up, oracle)

        os.kill(procs["worker"], signal.SIGKILL)
        deadline = time.monotonic() + 90
        while _services(up).get("worker") in (None, procs["worker"]):
            assert time.monotonic() < deadline, "the worker did not come back"
            time.sleep(0.2)
        # the scheduler binds the new worker; the same tokens come back
        _check_oracle(up, oracle)
        assert "worker process exited; starting it again" in up.log_events()
        assert _services(up).keys() == procs.keys()
        _stop(up)


@pytest.mark.slow
def test_rlt_up_with_two_shards_runs_each_shard_in_processes_of_its_own(
    toy_checkpoint: Path, tmp_path: Path, oracle: SerialOracle
) -> None:
    """Two shards: seven children (more than the event loop's default executor has threads:
    supervising them must not take one each, or Ctrl-C would wait for ever)."""
    with _rlt_up(toy_checkpoint, tmp_path, "--shards", "2") as up:
        layout = sorted(
            (argv[argv.index("service") + 1], _flag(argv, "--shard"))
            for argv in _service_argvs(up).values()
        )
        assert layout == [
            ("admission", ""),
            ("gateway", ""),
            ("prefix-cache", ""),
            ("scheduler", "0"),
            ("scheduler", "1"),
            ("worker", "0"),
            ("worker", "1"),
        ]
        _check_oracle(up, oracle)
        _stop(up)


@pytest.mark.slow
def test_rlt_up_one_process_keeps_the_engine_in_its_own_process(
    toy_checkpoint: Path, tmp_path: Path, oracle: SerialOracle
) -> None:
    with _rlt_up(toy_checkpoint, tmp_path, "--one-process") as up:
        assert set(_services(up)) == {"gateway"}  # the four run inside rlt up
        assert child_pid(up.proc.pid, "nats-server") is not None
        _check_oracle(up, oracle)
        _stop(up)


@pytest.mark.slow
def test_a_killed_rlt_up_takes_every_service_process_with_it(
    toy_checkpoint: Path, tmp_path: Path
) -> None:
    children: list[int] = []
    with _rlt_up(toy_checkpoint, tmp_path) as up:
        children = child_pids(up.proc.pid)
        services = _services(up)
        assert set(services) == {*SERVICES, "gateway"}
        try:
            up.proc.kill()  # no chance to stop anything
            up.proc.wait()
            deadline = time.monotonic() + 30
            while left := [name for name, pid in services.items() if alive(pid)]:
                assert time.monotonic() < deadline, f"{left} outlived rlt up"
                time.sleep(0.1)
        finally:
            for pid in children:  # nats-server has no such watch: it is ours to clean up
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_child_does_not_outlive_an_rlt_up_killed_while_it_starts(
    toy_checkpoint: Path, tmp_path: Path
) -> None:
    """Killed before its services are ready (a worker still loading): each child notices
    once it runs, and stops instead of serving for nobody."""
    env = {**os.environ, "RLT_RUN_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "services.cli", "up", "--port", str(free_port())]
    cmd += ["--http-port", str(free_port()), "--checkpoint", str(toy_checkpoint)]
    cmd += ["--client-url-file", str(tmp_path / "client-url")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    children: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(services := [p for p in child_pids(proc.pid) if "service" in cmdline(p)]) < 4:
            assert time.monotonic() < deadline, "the service processes did not start"
            time.sleep(0.02)
        children = child_pids(proc.pid)
        worker = next(p for p in services if "worker" in cmdline(p))
        assert not _identity_file(worker).exists()  # the worker is not ready yet
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 60
        while left := [cmdline(p)[4:5] for p in services if alive(p)]:
            assert time.monotonic() < deadline, f"{left} outlived rlt up"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.services
def test_banner_commands_work_as_printed_and_api_keys_guard_the_api(
    toy_checkpoint: Path, tmp_path: Path
) -> None:
    """``rlt up --client-url-file F --api-key K``: the banner's ``rlt generate`` line runs as
    printed from a shell that knows neither file nor URL, and /v1/* needs the key."""
    import httpx

    url_file = tmp_path / "elsewhere" / "client-url"
    env = {k: v for k, v in os.environ.items() if k not in ("RLT_NATS_URL", "RLT_CLIENT_URL_FILE")}
    env |= {"RLT_RUN_DIR": str(tmp_path), "RLT_LOG_LEVEL": "warning", "OMP_NUM_THREADS": "1"}
    http_port = free_port()
    cmd = [sys.executable, "-m", "services.cli", "up", "--port", str(free_port())]
    cmd += ["--http-port", str(http_port), "--checkpoint", str(toy_checkpoint)]
    cmd += ["--client-url-file", str(url_file), "--one-process"]
    up, banner = start_rlt_up(
        cmd, {**env, "RLT_API_KEY": "k-123"}, tmp_path / "up.log", timeout_s=90
    )
    try:
        (line,) = [
            x.strip()
            for x in banner.splitlines()
            if x.strip().endswith('generate --max-tokens 8 "hello"')
        ]
        assert f"RLT_CLIENT_URL_FILE={url_file}" in line
        gen = subprocess.run(
            ["bash", "-c", line], capture_output=True, text=True, env=env, timeout=60
        )
        assert gen.returncode == 0 and gen.stdout.strip(), gen.stderr
        assert "RLT_API_KEY" in banner and "k-123" not in banner
        base = f"http://127.0.0.1:{http_port}"
        assert httpx.get(f"{base}/v1/models").status_code == 401
        auth = {"Authorization": "Bearer k-123"}
        assert httpx.get(f"{base}/v1/models", headers=auth).status_code == 200
        assert httpx.get(f"{base}/health").status_code == 200
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=30)
        finally:
            if up.poll() is None:
                up.kill()
                up.wait()


@pytest.mark.services
def test_serving_http_beyond_loopback_needs_a_key_or_no_api_key(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "services.cli", "up", "--http-host", "0.0.0.0"]
    env = {k: v for k, v in os.environ.items() if k != "RLT_API_KEY"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 2
    assert "--api-key" in proc.stderr and "--no-api-key" in proc.stderr
