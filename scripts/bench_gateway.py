"""Benchmark: the OpenAI-compatible HTTP gateway against the NATS API it fronts.

Starts one ``rlt up`` (embedded nats-server, the four services and the gateway in one
process), then runs the same closed-loop workload through each API in turn, alternating
(NATS, HTTP, NATS, HTTP, ...) so drift hits both alike: ``--concurrency`` clients, each
sending its next request when the previous one ended, every request greedy with
``ignore_eos`` so each makes exactly ``--max-tokens`` tokens. Reports output tokens/s and
time to first token (first token event / first SSE frame, seen by the client), and writes
a markdown report.

    .venv/bin/python scripts/bench_gateway.py [--size small] [--concurrency 32] \
        [--requests 256] [--rounds 3] [--out docs/benchmarks/gateway.md]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import queue
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import nats

from services.launcher import free_port
from services.runtime import subjects
from services.worker.model.toy import write_toy_checkpoint

MODEL = "bench"


@dataclass
class Run:
    api: str
    wall_s: float
    tokens: int
    ttft_s: list[float] = field(default_factory=list)
    server_cpu_s: float = 0.0  # CPU time of the `rlt up` process during the run
    client_cpu_s: float = 0.0  # CPU time of this benchmark client during the run

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_gateway(checkpoint: Path, nats_url: str) -> tuple[subprocess.Popen[str], str]:
    """The gateway as its own process (as compose runs it), next to `rlt up`."""
    port = free_port()
    cmd = [sys.executable, "-m", "services.cli", "service", "gateway", "--nats-url", nats_url]
    cmd += ["--checkpoint", str(checkpoint), "--http-port", str(port)]
    cmd += ["--served-model-name", MODEL]
    env = {**os.environ, "RLT_LOG_LEVEL": "warning"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url  # type: ignore[return-value]
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the gateway process did not become ready")


def start_up(checkpoint: Path, engine_args: list[str]) -> tuple[subprocess.Popen[str], str, str]:
    nats_port, http_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "services.cli", "up", "--port", str(nats_port)]
    cmd += ["--http-port", str(http_port), "--checkpoint", str(checkpoint)]
    cmd += ["--served-model-name", MODEL, *engine_args]
    env = {**os.environ, "RLT_LOG_LEVEL": "warning"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    while "rlt is up" not in lines.get(timeout=120):
        pass
    return proc, f"nats://127.0.0.1:{nats_port}", f"http://127.0.0.1:{http_port}"


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(n)]


async def closed_loop(
    one: Callable[[list[int]], Awaitable[tuple[float, int]]],
    work: list[list[int]],
    concurrency: int,
    api: str,
) -> Run:
    todo = list(reversed(work))
    run = Run(api, 0.0, 0)

    async def client() -> None:
        while todo:
            ttft, tokens = await one(todo.pop())
            run.ttft_s.append(ttft)
            run.tokens += tokens

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    run.wall_s = time.perf_counter() - t0
    return run


async def nats_run(url: str, work: list[list[int]], concurrency: int, max_tokens: int) -> Run:
    nc = await nats.connect(url)
    prefix = nc.new_inbox()
    queues: dict[str, asyncio.Queue[bytes]] = {}

    async def on_msg(msg: nats.aio.msg.Msg) -> None:
        queues[msg.subject.rsplit(".", 1)[1]].put_nowait(msg.data)

    await nc.subscribe(f"{prefix}.*", cb=on_msg)
    counter = iter(range(1 << 30))

    async def one(prompt: list[int]) -> tuple[float, int]:
        key = str(next(counter))
        q = queues[key] = asyncio.Queue()
        body = {
            "prompt_token_ids": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        t0 = time.perf_counter()
        await nc.publish(subjects.GENERATE, json.dumps(body).encode(), reply=f"{prefix}.{key}")
        ttft, tokens = 0.0, 0
        while True:
            event = json.loads(await q.get())
            if event["type"] == "token":
                if tokens == 0:
                    ttft = time.perf_counter() - t0
                tokens += 1
                continue
            if event["type"] != "finished":
                raise RuntimeError(event)
            del queues[key]
            return ttft, tokens

    try:
        return await closed_loop(one, work, concurrency, "NATS")
    finally:
        await nc.close()


async def http_run(url: str, work: list[list[int]], concurrency: int, max_tokens: int) -> Run:
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:

        async def one(prompt: list[int]) -> tuple[float, int]:
            body = {
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            t0 = time.perf_counter()
            ttft, tokens = 0.0, 0
            async with http.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(await r.aread())
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if ttft == 0.0:
                        ttft = time.perf_counter() - t0
                    if line == "data: [DONE]":
                        break
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
            return ttft, tokens

        return await closed_loop(one, work, concurrency, "HTTP")


def _us_per_token(seconds: float, tokens: int) -> str:
    return f"{1e6 * seconds / tokens:.0f}"


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f}"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def summary(runs: list[Run]) -> dict[str, float]:
    ttft = [t for r in runs for t in r.ttft_s]
    return {
        "tokens_per_s": statistics.median(r.tokens_per_s for r in runs),
        "ttft_mean_ms": 1e3 * statistics.fmean(ttft),
        "ttft_p50_ms": 1e3 * pct(ttft, 0.5),
        "ttft_p99_ms": 1e3 * pct(ttft, 0.99),
    }


def report(args: argparse.Namespace, runs: list[Run], command: str) -> str:
    nats_s = summary([r for r in runs if r.api == "NATS"])
    http_s = summary([r for r in runs if r.api == "HTTP"])
    cost = 100 * (1 - http_s["tokens_per_s"] / nats_s["tokens_per_s"])
    rows = "\n".join(
        f"| {api} | {s['tokens_per_s']:.0f} | {s['ttft_mean_ms']:.1f} | {s['ttft_p50_ms']:.1f} "
        f"| {s['ttft_p99_ms']:.1f} |"
        for api, s in (("NATS API (`rlt.v1.generate`)", nats_s), ("HTTP gateway (SSE)", http_s))
    )
    per_round = "\n".join(
        f"| {i // 2 + 1} | {r.api} | {r.tokens_per_s:.0f} | {_ms(statistics.fmean(r.ttft_s))} "
        f"| {_us_per_token(r.server_cpu_s, r.tokens)} | {_us_per_token(r.client_cpu_s, r.tokens)} |"
        for i, r in enumerate(runs)
    )
    return f"""# Gateway vs NATS API

The same closed-loop workload through the OpenAI-compatible HTTP gateway (streamed
`/v1/completions`, server-sent events) and through the NATS API it fronts, against one
`rlt up` (all services and the gateway in one process). {args.requests} requests per run,
{args.concurrency} concurrent clients, prompts of {args.prompt_len} token ids, greedy,
`ignore_eos`, {args.max_tokens} output tokens each; the APIs alternate for {args.rounds}
rounds. Tokens/s is the median over rounds; TTFT is measured by the client (first token
event / first SSE frame) over all rounds.

```
{command}
```

| API | output tokens/s | TTFT mean (ms) | TTFT p50 (ms) | TTFT p99 (ms) |
|---|---|---|---|---|
{rows}

HTTP hop cost in throughput: **{cost:.1f}%** (target: at most 5%).

Per run:

| round | API | tokens/s | TTFT mean (ms) | server CPU (µs/token) | client CPU (µs/token) |
|---|---|---|---|---|---|
{per_round}

Checkpoint: random `{args.size}` Ouro-format checkpoint (`rlt toy-checkpoint --size
{args.size}`), float32 on CPU. Machine: {platform.machine()}, {os.cpu_count()} CPUs,
Python {platform.python_version()}; the benchmark client runs on the same machine. Measured
on a shared, busy machine: the numbers are noisy, and the client's own HTTP parsing
(httpx) competes with the server for the same cores.
"""


async def bench(
    args: argparse.Namespace, nats_url: str, http_url: str, vocab: int, pid: int
) -> list[Run]:
    work = prompts(args.requests, args.prompt_len, vocab)
    # warm-up through both APIs (first batches, JIT-free but caches and allocator)
    await nats_run(nats_url, work[: args.concurrency], args.concurrency, 4)
    await http_run(http_url, work[: args.concurrency], args.concurrency, 4)
    runs = []
    for _ in range(args.rounds):
        for run in (nats_run, http_run):
            server0, client0 = cpu_seconds(pid), time.process_time()
            r = await run(
                nats_url if run is nats_run else http_url, work, args.concurrency, args.max_tokens
            )
            r.server_cpu_s = cpu_seconds(pid) - server0
            r.client_cpu_s = time.process_time() - client0
            expected = args.requests * args.max_tokens
            if r.tokens != expected:
                raise RuntimeError(f"{r.api}: {r.tokens} tokens, expected {expected}")
            print(
                f"{r.api}: {r.tokens_per_s:.0f} tok/s, TTFT mean "
                f"{1e3 * statistics.fmean(r.ttft_s):.1f} ms, server CPU "
                f"{_us_per_token(r.server_cpu_s, r.tokens)} us/token, client CPU "
                f"{_us_per_token(r.client_cpu_s, r.tokens)} us/token",
                flush=True,
            )
            runs.append(r)
    return runs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size", default="small", choices=["toy", "small", "1.4b"])
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--engine-args", default="--async-scheduling", help="extra `rlt up` flags")
    p.add_argument(
        "--separate-gateway",
        action="store_true",
        help="measure a gateway in its own process (`rlt service gateway`, as compose runs "
        "it) instead of the one inside `rlt up`",
    )
    p.add_argument("--out", default=None, help="write the markdown report here")
    args = p.parse_args()
    command = "python scripts/bench_gateway.py " + " ".join(sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="rlt-bench-gw-") as tmp:
        checkpoint = write_toy_checkpoint(Path(tmp) / "ckpt", seed=0, size=args.size)
        vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
        proc, nats_url, http_url = start_up(checkpoint, args.engine_args.split())
        gateway = None
        try:
            if args.separate_gateway:
                gateway, http_url = start_gateway(checkpoint, nats_url)
            runs = asyncio.run(bench(args, nats_url, http_url, vocab, proc.pid))
        finally:
            if gateway is not None:
                gateway.send_signal(signal.SIGINT)
                gateway.wait(timeout=60)
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    text = report(args, runs, command)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
