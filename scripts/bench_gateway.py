"""Benchmark: the OpenAI-compatible HTTP gateway against the NATS API it fronts.

Starts one ``rlt up`` (the four services in one process; its nats-server and its gateway
in child processes), then runs the same closed-loop workload through each API in turn, alternating
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

from services.bench.processes import child_pid, process_cpu_s
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
    nats_cpu_s: float = 0.0  # of its nats-server child
    gateway_cpu_s: float = 0.0  # of its gateway child
    client_cpu_s: float = 0.0  # CPU time of this benchmark client during the run

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


def start_up(
    checkpoint: Path, engine_args: list[str], secrets: Path
) -> tuple[subprocess.Popen[str], str, str]:
    """`rlt up` with authentication, as users run it. Returns the process, the client's NATS
    URL and the gateway's HTTP URL."""
    nats_port, http_port = free_port(), free_port()
    client_file = secrets / "client.url"
    cmd = [sys.executable, "-m", "services.cli", "up", "--port", str(nats_port)]
    cmd += ["--http-port", str(http_port), "--checkpoint", str(checkpoint)]
    cmd += ["--client-url-file", str(client_file)]
    cmd += ["--served-model-name", MODEL, *engine_args]
    env = {**os.environ, "RLT_LOG_LEVEL": "warning"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    while "rlt is up" not in lines.get(timeout=120):
        pass
    return proc, client_file.read_text().strip(), f"http://127.0.0.1:{http_port}"


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


def completion_body(prompt: list[int], max_tokens: int) -> dict[str, object]:
    """The HTTP arm's request: streamed, greedy, exactly ``max_tokens`` tokens, usage last."""
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def http_run(url: str, work: list[list[int]], concurrency: int, max_tokens: int) -> Run:
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:

        async def one(prompt: list[int]) -> tuple[float, int]:
            body = completion_body(prompt, max_tokens)
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


async def aiohttp_run(url: str, work: list[list[int]], concurrency: int, max_tokens: int) -> Run:
    """The HTTP arm with aiohttp (what vLLM's and SGLang's serving benchmarks use): on a
    machine whose cores the client shares with the server, its SSE parsing costs the
    server less than httpx's."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=concurrency + 8)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(url, connector=connector, timeout=timeout) as http:

        async def one(prompt: list[int]) -> tuple[float, int]:
            body = completion_body(prompt, max_tokens)
            t0 = time.perf_counter()
            ttft, tokens = 0.0, 0
            async with http.post("/v1/completions", json=body) as r:
                if r.status != 200:
                    raise RuntimeError(await r.read())
                async for raw in r.content:
                    if not raw.startswith(b"data: "):
                        continue
                    if ttft == 0.0:
                        ttft = time.perf_counter() - t0
                    if raw.startswith(b"data: [DONE]"):
                        break
                    if b'"usage":{' in raw:
                        tokens = json.loads(raw[6:])["usage"]["completion_tokens"]
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


def report(args: argparse.Namespace, runs: list[Run], command: str, load: str) -> str:
    nats_s = summary([r for r in runs if r.api == "NATS"])
    http_s = summary([r for r in runs if r.api == "HTTP"])
    # each round's HTTP run against the NATS run just before it
    costs = [
        100 * (1 - h.tokens_per_s / n.tokens_per_s)
        for n, h in zip(runs[::2], runs[1::2], strict=True)
    ]
    rows = "\n".join(
        f"| {api} | {s['tokens_per_s']:.0f} | {s['ttft_mean_ms']:.1f} | {s['ttft_p50_ms']:.1f} "
        f"| {s['ttft_p99_ms']:.1f} |"
        for api, s in (("NATS API (`rlt.v1.generate`)", nats_s), ("HTTP gateway (SSE)", http_s))
    )
    per_round = "\n".join(
        f"| {i // 2 + 1} | {r.api} | {r.tokens_per_s:.0f} | {_ms(statistics.fmean(r.ttft_s))} "
        f"| {_us_per_token(r.server_cpu_s, r.tokens)} | {_us_per_token(r.gateway_cpu_s, r.tokens)} "
        f"| {_us_per_token(r.nats_cpu_s, r.tokens)} | {_us_per_token(r.client_cpu_s, r.tokens)} |"
        for i, r in enumerate(runs)
    )
    spread = ", ".join(f"{c:.1f}" for c in costs)
    return f"""# Gateway vs NATS API

The same closed-loop workload through the OpenAI-compatible HTTP gateway (streamed
`/v1/completions`, server-sent events, client: {args.http_client}) and through the NATS API it
fronts, against one `rlt up` (the engine's services in one process, its gateway and
nats-server in child processes). {args.requests} requests per run, {args.concurrency}
concurrent clients, prompts of {args.prompt_len} token ids, greedy, `ignore_eos`,
{args.max_tokens} output tokens each; the APIs alternate for {args.rounds} rounds. Tokens/s
is the median over rounds; TTFT is measured by the client (first token event / first SSE
frame) over all rounds.

```
{command}
```

| API | output tokens/s | TTFT mean (ms) | TTFT p50 (ms) | TTFT p99 (ms) |
|---|---|---|---|---|
{rows}

HTTP hop cost in throughput, each round's HTTP run against its NATS run: median
**{statistics.median(costs):.1f}%** (rounds: {spread}); target: at most 5%.

Per run (CPU: utime + stime per output token of the engine process, the gateway process,
nats-server and the benchmark client):

| round | API | tokens/s | TTFT mean (ms) | engine CPU (µs/token) | gateway | nats-server | client |
|---|---|---|---|---|---|---|---|
{per_round}

Checkpoint: random `{args.size}` Ouro-format checkpoint (`rlt toy-checkpoint --size
{args.size}`), float32 on CPU. Machine: {platform.machine()}, {os.cpu_count()} CPUs,
Python {platform.python_version()}; the benchmark client runs on the same machine and
competes with the server for the same cores. Load average (1/5/15 min) {load}.
"""


async def bench(
    args: argparse.Namespace,
    nats_url: str,
    http_url: str,
    vocab: int,
    pid: int,
) -> list[Run]:
    work = prompts(args.requests, args.prompt_len, vocab)
    # warm-up through both APIs (first batches, JIT-free but caches and allocator)
    await nats_run(nats_url, work[: args.concurrency], args.concurrency, 4)
    http = aiohttp_run if args.http_client == "aiohttp" else http_run
    await http(http_url, work[: args.concurrency], args.concurrency, 4)
    runs = []
    for _ in range(args.rounds):
        for run in (nats_run, http):
            nats_pid = child_pid(pid, "nats-server")
            gateway_pid = child_pid(pid, "gateway")
            server0, client0 = process_cpu_s(pid), time.process_time()
            nats0 = process_cpu_s(nats_pid) if nats_pid else 0.0
            gateway0 = process_cpu_s(gateway_pid) if gateway_pid else 0.0
            r = await run(
                nats_url if run is nats_run else http_url, work, args.concurrency, args.max_tokens
            )
            r.server_cpu_s = process_cpu_s(pid) - server0
            r.nats_cpu_s = (process_cpu_s(nats_pid) - nats0) if nats_pid else 0.0
            r.gateway_cpu_s = (process_cpu_s(gateway_pid) - gateway0) if gateway_pid else 0.0
            r.client_cpu_s = time.process_time() - client0
            expected = args.requests * args.max_tokens
            if r.tokens != expected:
                raise RuntimeError(f"{r.api}: {r.tokens} tokens, expected {expected}")
            print(
                f"{r.api}: {r.tokens_per_s:.0f} tok/s, TTFT mean "
                f"{1e3 * statistics.fmean(r.ttft_s):.1f} ms, server CPU "
                f"{_us_per_token(r.server_cpu_s, r.tokens)} us/token, nats-server "
                f"{_us_per_token(r.nats_cpu_s, r.tokens)}, gateway "
                f"{_us_per_token(r.gateway_cpu_s, r.tokens)}, client CPU "
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
        "--http-client",
        default="httpx",
        choices=["httpx", "aiohttp"],
        help="the HTTP arm's client: httpx (what the openai client uses) or aiohttp",
    )
    p.add_argument("--out", default=None, help="write the markdown report here")
    args = p.parse_args()
    command = "python scripts/bench_gateway.py " + " ".join(sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="rlt-bench-gw-") as tmp:
        checkpoint = write_toy_checkpoint(Path(tmp) / "ckpt", seed=0, size=args.size)
        vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
        proc, nats_url, http_url = start_up(checkpoint, args.engine_args.split(), Path(tmp))
        load0 = os.getloadavg()
        try:
            runs = asyncio.run(bench(args, nats_url, http_url, vocab, proc.pid))
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    load = (
        f"{' / '.join(f'{x:.1f}' for x in load0)} at the start, "
        + " / ".join(f"{x:.1f}" for x in os.getloadavg())
        + " at the end"
    )
    text = report(args, runs, command, load)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
