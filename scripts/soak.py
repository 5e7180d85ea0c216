"""Soak: N clients x many requests with random aborts and malformed messages mixed in,
against the four services as real processes on a real nats-server.

Checks: every request that was sent with a reply subject gets exactly one terminal event
(valid ones: finished or a clear error; malformed ones: one error), all KV is reclaimed at
the end (asked from the scheduler's health endpoint), and the services' RSS stays flat
(growth from after warm-up to the end is reported).

    python scripts/soak.py --duration 600 --clients 8      # the long variant
    tests/test_soak.py runs about half a minute of it in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from messages.api import ErrorEvent, FinishedEvent  # noqa: E402
from services.runtime import subjects  # noqa: E402
from services.runtime.bus import encode_json  # noqa: E402
from tests.service_procs import (  # noqa: E402
    ServiceProcs,
    StreamCollector,
    client,
    health,
    wait_for,
)

ENGINE_ARGS = [
    "--async-scheduling",
    "--wavefront-chunked-prefill",
    "--prefill-chunk-size",
    "8",
    "--block-size",
    "8",
    "--num-blocks",
    "768",
    "--max-num-seqs",
    "16",
    "--max-num-batched-tokens",
    "64",
    "--enable-prefix-caching",
]
MALFORMED = [
    b"",
    b"{",
    b"null",
    b"[]",
    b'{"prompt": 5}',
    b'{"prompt_token_ids": [-1]}',
    b'{"prompt_token_ids": [1], "max_tokens": -3}',
    b'{"prompt_token_ids": [1], "max_tokens": 99999999}',
    b'{"prompt": "x", "temperature": "hot"}',
    b'{"request_id": "bad id!", "prompt": "x"}',
    b'{"prompt_token_ids": [1, 2], "unknown": 1}',
    b"\xff\xfe\x00garbage",
]


@dataclass
class SoakReport:
    requests: int = 0  # valid generate requests
    malformed: int = 0  # malformed messages that had a reply subject
    aborts: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # finish_reason / error code
    duplicates: int = 0
    missing: int = 0
    wrong_malformed: int = 0
    kv_reclaimed: bool = False
    open_requests_left: int = -1
    rss_growth_mib: dict[str, float] = field(default_factory=dict)
    rss_mib: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    def ok(self) -> bool:
        return (
            self.missing == 0
            and self.duplicates == 0
            and self.wrong_malformed == 0
            and self.kv_reclaimed
            and self.open_requests_left == 0
        )


async def run_soak(
    url: str,
    procs: ServiceProcs | None,
    *,
    duration_s: float,
    clients: int = 4,
    concurrency: int = 4,
    abort_fraction: float = 0.2,
    malformed_fraction: float = 0.1,
    seed: int = 0,
    warmup_fraction: float = 0.25,
) -> SoakReport:
    report = SoakReport()
    rng = random.Random(seed)
    t0 = time.monotonic()
    stop_at = t0 + duration_s
    rss_start: dict[str, int] = {}
    async with client(url) as control:

        async def one_client(cid: int) -> StreamCollector:
            crng = random.Random(rng.getrandbits(64))
            async with client(url) as nc:
                col = await StreamCollector(nc).start()
                col.kinds = {}  # type: ignore[attr-defined]
                n = 0
                sem = asyncio.Semaphore(concurrency)

                async def one(i: int) -> None:
                    try:
                        if crng.random() < malformed_fraction:
                            await col.send(i, crng.choice(MALFORMED))
                            col.kinds[i] = "malformed"  # type: ignore[attr-defined]
                            await col.wait_done([i], 60)
                            return
                        rid = f"soak-{seed}-{cid}-{i}"
                        shared = list(range(1, 17)) if crng.random() < 0.3 else []  # prefix hits
                        body = {
                            "request_id": rid,
                            "prompt_token_ids": shared
                            + [crng.randrange(1, 500) for _ in range(crng.randrange(1, 40))],
                            "max_tokens": crng.randrange(1, 48),
                            "temperature": crng.choice([0.0, 0.8]),
                            "seed": crng.randrange(1000),
                            "min_loops": crng.choice([1, 2]),
                            "exit_threshold": crng.choice([1.0, 0.7]),
                            "ignore_eos": crng.random() < 0.5,
                        }
                        col.kinds[i] = "valid"  # type: ignore[attr-defined]
                        await col.send(i, body)
                        if crng.random() < abort_fraction:
                            await asyncio.sleep(crng.random() * 0.3)
                            report.aborts += 1
                            await nc.publish(subjects.ABORT, encode_json({"request_id": rid}))
                        # malformed traffic without a reply subject: nothing to answer
                        if crng.random() < malformed_fraction:
                            await nc.publish(subjects.ABORT, crng.choice(MALFORMED))
                        await col.wait_done([i], 120)
                    finally:
                        sem.release()

                tasks = []
                while time.monotonic() < stop_at:
                    await sem.acquire()
                    tasks.append(asyncio.ensure_future(one(n)))
                    n += 1
                await asyncio.gather(*tasks, return_exceptions=True)
                await asyncio.sleep(0.5)  # a duplicate terminal would have arrived by now
                return col

        async def sample_rss() -> None:
            await asyncio.sleep(duration_s * warmup_fraction)
            if procs is not None:
                for key in procs.procs:
                    rss_start[key] = procs.rss_kib(key)

        sampler = asyncio.ensure_future(sample_rss())
        cols = await asyncio.gather(*(one_client(c) for c in range(clients)))
        await sampler

        for col in cols:
            for i, kind in col.kinds.items():  # type: ignore[attr-defined]
                terminals = col.terminals(i)
                if kind == "malformed":
                    report.malformed += 1
                    if len(terminals) != 1 or not isinstance(terminals[0], ErrorEvent):
                        report.wrong_malformed += 1
                    continue
                report.requests += 1
                if not terminals:
                    report.missing += 1
                    continue
                report.duplicates += len(terminals) - 1
                t = terminals[0]
                key = t.finish_reason if isinstance(t, FinishedEvent) else f"error:{t.code}"
                report.finished[key] = report.finished.get(key, 0) + 1

        async def reclaimed() -> bool:
            h = await health(control, "scheduler")
            return h["live_requests"] == 0 and h["free_kv_blocks"] == h["num_kv_blocks"]

        try:
            await wait_for(reclaimed, 15, "KV reclaimed")
            report.kv_reclaimed = True
        except TimeoutError:
            report.kv_reclaimed = False
        report.open_requests_left = (await health(control, "admission"))["open_requests"]
    if procs is not None:
        for key, start in rss_start.items():
            end = procs.rss_kib(key)
            report.rss_mib[key] = round(end / 1024, 1)
            report.rss_growth_mib[key] = round((end - start) / 1024, 2)
    report.seconds = round(time.monotonic() - t0, 1)
    return report


async def _main(args: argparse.Namespace) -> int:
    from services.launcher import NatsServer, free_port
    from services.worker.model.toy import write_toy_checkpoint

    with tempfile.TemporaryDirectory(prefix="rlt-soak-") as tmp:
        work = Path(tmp)
        ckpt = write_toy_checkpoint(work / "ckpt", seed=0, size="toy")
        with NatsServer(port=free_port()) as server:
            procs = ServiceProcs(server.url, ckpt, work, ENGINE_ARGS)
            try:
                await procs.start_all()
                report = await run_soak(
                    server.url,
                    procs,
                    duration_s=args.duration,
                    clients=args.clients,
                    concurrency=args.concurrency,
                    seed=args.seed,
                )
            finally:
                procs.stop_all()
    print(json.dumps(report.__dict__, indent=2))
    return 0 if report.ok() else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of traffic")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight per client")
    p.add_argument("--seed", type=int, default=0)
    return asyncio.run(_main(p.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
