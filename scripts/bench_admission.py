"""Admission latency: client publish on ``rlt.v1.generate`` -> the admitted request arrives on
the scheduler's submit subject, with prefix caching off and on (arms interleaved, repeats).

A real nats-server and the real admission service; the scheduler is a stand-in subscriber
that answers load requests and timestamps each submit, so only admission's own path is
measured. Usage: python scripts/bench_admission.py [--requests 500] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import nats

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from messages.internal import AdmittedRequest, SchedulerLoad  # noqa: E402
from services.admission.core import AdmissionConfig  # noqa: E402
from services.admission.service import AdmissionService  # noqa: E402
from services.common.config import SchedulerConfig  # noqa: E402
from services.launcher import NatsServer, free_port  # noqa: E402
from services.runtime import subjects  # noqa: E402
from services.runtime.bus import decode_msgpack, encode_json, encode_msgpack  # noqa: E402
from services.runtime.logging import configure_logging  # noqa: E402
from services.worker.model.toy import write_toy_checkpoint  # noqa: E402


async def measure(url: str, checkpoint: Path, caching: bool, n: int) -> list[float]:
    config = SchedulerConfig(block_size=16, num_blocks=4096, enable_prefix_caching=caching)
    admission = AdmissionService(url, checkpoint, AdmissionConfig(), scheduler_config=config)
    await admission.start()
    nc = await nats.connect(url)
    arrived: dict[str, float] = {}
    done = asyncio.Event()

    async def on_submit(msg) -> None:  # type: ignore[no-untyped-def]
        req = decode_msgpack(msg.data, AdmittedRequest)
        arrived[req.request_id] = time.perf_counter()
        if len(arrived) == n:
            done.set()

    async def on_load_get(msg) -> None:  # type: ignore[no-untyped-def]
        await nc.publish(msg.reply, encode_msgpack(SchedulerLoad(scheduler_id="bench")))

    await nc.subscribe(subjects.SCHED_SUBMIT, cb=on_submit)
    await nc.subscribe(subjects.SCHED_LOAD_GET, cb=on_load_get)
    await nc.flush()
    sent: dict[str, float] = {}
    prompt = list(range(1, 257))  # 16 full blocks: what a prefix lookup would hash
    try:
        for i in range(n):
            rid = f"adm-{caching}-{i}"
            body = {"request_id": rid, "prompt_token_ids": prompt, "max_tokens": 8}
            sent[rid] = time.perf_counter()
            await nc.publish(subjects.GENERATE, encode_json(body), reply=f"_INBOX.bench.{i}")
            await nc.flush()
            while rid not in arrived:  # one at a time: latency, not throughput
                await asyncio.sleep(0)
        await asyncio.wait_for(done.wait(), 30)
    finally:
        await nc.close()
        await admission.stop(drain_timeout=1.0)
    return [(arrived[r] - sent[r]) * 1e3 for r in sent]


async def main_async(args: argparse.Namespace) -> None:
    configure_logging("warning")
    with tempfile.TemporaryDirectory() as tmp, NatsServer(port=free_port()) as server:
        ckpt = write_toy_checkpoint(Path(tmp) / "toy", seed=0, size="toy")
        p50: dict[bool, list[float]] = {False: [], True: []}
        p99: dict[bool, list[float]] = {False: [], True: []}
        for repeat in range(args.repeats):
            for caching in (False, True):  # interleaved: drift hits both arms alike
                lat = sorted(await measure(server.url, ckpt, caching, args.requests))
                p50[caching].append(statistics.median(lat))
                p99[caching].append(lat[int(0.99 * (len(lat) - 1))])
                print(
                    f"repeat {repeat} prefix_caching={'on ' if caching else 'off'} "
                    f"p50 {p50[caching][-1]:.3f} ms  p99 {p99[caching][-1]:.3f} ms"
                )
        ratios = [on / off for on, off in zip(p50[True], p50[False], strict=True)]
        print(
            f"p50 on/off per repeat: {', '.join(f'{r:.3f}' for r in ratios)}; "
            f"median {statistics.median(ratios):.3f} (target <= 1: the lookup is off the path)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=3)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
