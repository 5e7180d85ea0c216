"""Benchmark: one run's batches replayed through the model runner, alone and with the work a
worker process does between two batches, timing only ``ModelRunner.execute``.

Why: in ``rlt bench --size toy --only pipeline`` (CPU) the worker's batches take 20-25%
longer than the in-process engine's, yet they are the same batches: replayed alone, a
run's batches take as long as that run did in-process. What differs is what happens
between them. This records the batches of one in-process run of the pipeline comparison's
workload (as the wire carries them, msgpack), then replays them through a fresh runner,
every mode once per repeat, in this order:

- ``alone``: back to back, as in-process;
- ``syscalls``: four cheap system calls before each batch;
- ``wake``: one byte to a process asleep on another CPU before each batch (a worker's
  result wakes nats-server);
- ``wake4``: four such bytes, the loop turning between them;
- ``round_trip``: one byte, then wait for the answer (a worker waiting for its next batch);
- ``nats``: the batch published to a real nats-server and taken back from a subscription,
  then its result published (a worker's cycle, without the scheduler).

    .venv/bin/python scripts/bench_worker_replay.py [--repeats 5] [--size toy]

docs/benchmarks/README.md ("Pipeline") has a run and what it says.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable

import msgspec
import nats
import torch
from nats.aio.msg import Msg

from messages.api import FinishedEvent
from messages.batch import Batch
from services.bench.backends import sampling_params
from services.bench.comparison import BenchSettings
from services.bench.comparisons.pipeline import pipeline
from services.bench.workloads import FULL, Workload
from services.common.config import SchedulerConfig
from services.engine.engine import LLMEngine, model_limits
from services.launcher import NatsServer, free_port
from services.worker.model.ouro import OuroModel
from services.worker.model.toy import ensure_checkpoint
from services.worker.runner import ModelRunner

MODES = ("alone", "syscalls", "wake", "wake4", "round_trip", "nats")


def record_batches(model: OuroModel, workload: Workload, config: SchedulerConfig) -> list[bytes]:
    """The wire form of every batch one closed-loop in-process run of ``workload`` sends."""
    encode = msgspec.msgpack.Encoder().encode
    batches: list[bytes] = []
    engine = LLMEngine(model, config, on_batch=lambda b: batches.append(encode(b.wire)))
    specs = workload.requests
    unsent = deque(range(len(specs)))

    def send() -> None:
        i = unsent.popleft()
        engine.add_request(
            f"r{i}", list(specs[i].prompt_token_ids), sampling_params(specs[i], workload)
        )

    for _ in range(min(workload.concurrency, len(unsent))):
        send()
    while engine.has_unfinished_requests():
        for event in engine.step():
            if isinstance(event, FinishedEvent) and unsent:
                send()
    return batches


class Peer:
    """A process asleep on another CPU that reads bytes and answers ``p`` with ``k``."""

    def __init__(self, cpu: int) -> None:
        self.sock, theirs = socket.socketpair()
        self.pid = os.fork()
        if self.pid == 0:  # the child: read until told to stop
            self.sock.close()
            os.sched_setaffinity(0, {cpu})
            while (data := theirs.recv(64)) and data != b"q":
                if data.endswith(b"p"):
                    theirs.send(b"k")
            os._exit(0)
        theirs.close()

    def close(self) -> None:
        self.sock.send(b"q")
        os.waitpid(self.pid, 0)


async def replay(
    model: OuroModel,
    config: SchedulerConfig,
    wire: list[bytes],
    before: Callable[[bytes], Awaitable[None]],
) -> float:
    """Seconds inside ``execute`` over the whole run, ``before`` awaited ahead of each batch."""
    decode = msgspec.msgpack.Decoder(Batch).decode
    runner = ModelRunner(model, config.num_blocks, config.block_size, config.kv_layout)
    inside = 0.0
    for data in wire:
        await before(data)
        batch = decode(data)
        t0 = time.perf_counter()
        runner.execute(batch)
        inside += time.perf_counter() - t0
    return inside


async def run(args: argparse.Namespace) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        sys.exit("needs two CPUs: the peer sleeps on the one this process does not run on")
    os.sched_setaffinity(0, {cpus[0]})
    peer = Peer(cpus[1])  # forked before torch starts any thread
    torch.set_num_threads(1)
    model = OuroModel.from_checkpoint(ensure_checkpoint(None, size=args.size))
    settings = BenchSettings(
        scale=FULL, concurrency=32, seed=0, limits=model_limits(model), model_size=args.size
    )
    comparison = pipeline(settings)
    arm = next(a for a in comparison.arms if a.name == "in_process_async")
    config = comparison.config(arm)
    wire = record_batches(model, comparison.workloads[0], config)
    server = NatsServer(host="127.0.0.1", port=free_port()).start()
    nc = await nats.connect(server.url)
    inbox: asyncio.Queue[bytes] = asyncio.Queue()

    async def on_msg(msg: Msg) -> None:
        inbox.put_nowait(msg.data)

    await nc.subscribe("replay.batch", cb=on_msg)
    result = msgspec.msgpack.encode({"rows": [0] * 32})  # about a decode batch's result

    async def nothing(_data: bytes) -> None:
        pass

    async def syscalls(_data: bytes) -> None:
        for _ in range(4):
            os.getppid()

    async def wake(_data: bytes) -> None:
        peer.sock.send(b"x")

    async def wake4(_data: bytes) -> None:
        for _ in range(4):
            peer.sock.send(b"x")
            await asyncio.sleep(0)

    async def round_trip(_data: bytes) -> None:
        peer.sock.send(b"p")
        peer.sock.recv(8)

    async def through_nats(data: bytes) -> None:
        await nc.publish("replay.result", result)
        await nc.publish("replay.batch", data)
        await inbox.get()

    ahead = {
        "alone": nothing,
        "syscalls": syscalls,
        "wake": wake,
        "wake4": wake4,
        "round_trip": round_trip,
        "nats": through_nats,
    }
    seconds: dict[str, list[float]] = {m: [] for m in MODES}
    try:
        await replay(model, config, wire, nothing)  # warm-up, untimed
        for _ in range(args.repeats):
            for mode in MODES:
                seconds[mode].append(await replay(model, config, wire, ahead[mode]))
    finally:
        await nc.close()
        server.stop()
        peer.close()
    alone = statistics.median(seconds["alone"])
    print(f"{len(wire)} batches of one in-process run ({args.size}, async); ms inside execute")
    print("| before each batch | per repeat, ms | median ms | vs alone |")
    print("|---|---|---:|---:|")
    for mode in MODES:
        values = seconds[mode]
        median = statistics.median(values)
        each = ", ".join(f"{v * 1e3:.0f}" for v in values)
        print(f"| {mode} | {each} | {median * 1e3:.1f} | {median / alone:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--size", default="toy", choices=("toy", "small"))
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
