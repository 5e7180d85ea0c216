"""Admission latency: client publish on ``rlt.v1.generate`` -> the admitted request arrives on
its shard's submit subject, routing by ``round-robin`` (no prefix lookup) and by ``prefix``
(one request/reply to the real prefix index per request), arms interleaved, repeats.

A real nats-server, the real admission and prefix-cache services; the shards are stand-ins
that announce themselves, report their load and timestamp each submit, so only admission's
own path (validation, tokenization, hashing, the lookup, routing) is measured. The index
holds the first 12 of the prompt's 16 blocks for shard 0, so the lookup walks a real chain.
Usage: python scripts/bench_admission.py [--requests 500] [--repeats 3] [--shards 2]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import nats

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from messages.internal import AdmittedRequest, SchedulerLoad, ShardAnnounce  # noqa: E402
from messages.prefix import BlockStored, PrefixEventBatch, prompt_block_hashes  # noqa: E402
from services.admission.core import AdmissionConfig  # noqa: E402
from services.admission.service import AdmissionService  # noqa: E402
from services.common.config import SchedulerConfig  # noqa: E402
from services.launcher import NatsServer, free_port  # noqa: E402
from services.prefix_cache.service import PrefixCacheService  # noqa: E402
from services.runtime import subjects  # noqa: E402
from services.runtime.bus import decode_msgpack, encode_json, encode_msgpack  # noqa: E402
from services.runtime.logging import configure_logging  # noqa: E402
from services.worker.model.toy import write_toy_checkpoint  # noqa: E402

BLOCK = 16
PROMPT = list(range(1, 16 * BLOCK + 1))  # 16 full blocks: what a prefix lookup hashes


class StandInShards:
    """Shards that announce themselves, report load and timestamp each submit."""

    def __init__(self, nc: nats.NATS, n: int) -> None:
        self.nc = nc
        self.n = n
        self.arrived: dict[str, float] = {}
        self.last_seq: dict[str, dict[str, int]] = {str(i): {} for i in range(n)}
        self.report_seq = 0

    async def start(self) -> None:
        for i in range(self.n):
            await self.nc.subscribe(subjects.sched_submit(str(i)), cb=self._submit(str(i)))
        await self.nc.subscribe(subjects.SHARD_DISCOVER, cb=self._announce)
        await self.nc.subscribe(subjects.SCHED_LOAD_GET, cb=self._load_get)

    def _submit(self, shard: str):  # type: ignore[no-untyped-def]
        async def on_submit(msg) -> None:  # type: ignore[no-untyped-def]
            req = decode_msgpack(msg.data, AdmittedRequest)
            self.arrived[req.request_id] = time.perf_counter()
            self.last_seq[shard][req.admission_id] = req.admission_seq

        return on_submit

    async def _announce(self, _msg=None) -> None:  # type: ignore[no-untyped-def]
        for i in range(self.n):
            a = ShardAnnounce(
                shard_id=str(i),
                scheduler_id=f"bench-{i}",
                producer_id=f"scheduler-{i}",
                block_size=BLOCK,
                enable_prefix_caching=True,
            )
            await self.nc.publish(subjects.SHARD_ANNOUNCE, encode_msgpack(a))

    def load(self, shard: str) -> SchedulerLoad:
        self.report_seq += 1
        return SchedulerLoad(
            scheduler_id=f"bench-{shard}",
            shard_id=shard,
            producer_id=f"scheduler-{shard}",
            report_seq=self.report_seq,
            num_blocks=4096,
            num_free_blocks=4096,
            last_admission_seq=dict(self.last_seq[shard]),
            time=time.time(),
        )

    async def _load_get(self, msg) -> None:  # type: ignore[no-untyped-def]
        await self.nc.publish(msg.reply, encode_msgpack(self.load("0")))

    async def report_forever(self) -> None:
        while True:
            for i in range(self.n):
                await self.nc.publish(subjects.SCHED_LOAD, encode_msgpack(self.load(str(i))))
            await asyncio.sleep(0.1)


async def seed_index(nc: nats.NATS) -> None:
    """Shard 0's producer caches the prompt's first 12 blocks."""
    hashes = prompt_block_hashes(PROMPT, BLOCK)[:12]
    batch = PrefixEventBatch(
        producer_id="scheduler-0",
        epoch="0" * 32,
        event_seq=1,
        events=[BlockStored(block_hashes=hashes)],
    )
    js = nc.jetstream()
    await js.publish(subjects.prefix_events("scheduler-0"), encode_msgpack([batch]))


async def measure(url: str, checkpoint: Path, router: str, n: int, shards: int) -> list[float]:
    config = SchedulerConfig(block_size=BLOCK, num_blocks=4096, enable_prefix_caching=True)
    admission = AdmissionService(
        url, checkpoint, AdmissionConfig(router=router), scheduler_config=config
    )
    nc = await nats.connect(url)
    stand_in = StandInShards(nc, shards)
    await stand_in.start()
    reporter = asyncio.ensure_future(stand_in.report_forever())
    await admission.start()
    sent: dict[str, float] = {}
    try:
        while len(admission.shards.routable(time.monotonic())) < shards:
            await asyncio.sleep(0.05)
        for i in range(n):
            rid = f"adm-{router}-{i}"
            body = {"request_id": rid, "prompt_token_ids": PROMPT, "max_tokens": 8}
            sent[rid] = time.perf_counter()
            await nc.publish(subjects.GENERATE, encode_json(body), reply=f"_INBOX.bench.{i}")
            await nc.flush()
            while rid not in stand_in.arrived:  # one at a time: latency, not throughput
                await asyncio.sleep(0)
        print(f"  routed {dict(sorted(admission.routed.items()))}", end="  ")
    finally:
        reporter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reporter
        await admission.stop(drain_timeout=1.0)
        await nc.close()
    return [(stand_in.arrived[r] - sent[r]) * 1e3 for r in sent]


async def main_async(args: argparse.Namespace) -> None:
    configure_logging("warning")
    with tempfile.TemporaryDirectory() as tmp, NatsServer(port=free_port()) as server:
        os.environ["RLT_RUN_DIR"] = tmp
        ckpt = write_toy_checkpoint(Path(tmp) / "toy", seed=0, size="toy")
        index = PrefixCacheService(server.url, snapshot_interval_s=60.0)
        await index.start()
        nc = await nats.connect(server.url)
        await seed_index(nc)
        await nc.close()
        while not index.index.num_blocks():
            await asyncio.sleep(0.05)
        p50: dict[str, list[float]] = {"round-robin": [], "prefix": []}
        p99: dict[str, list[float]] = {"round-robin": [], "prefix": []}
        try:
            for repeat in range(args.repeats):
                for router in ("round-robin", "prefix"):  # interleaved: drift hits both alike
                    got = await measure(server.url, ckpt, router, args.requests, args.shards)
                    lat = sorted(got)
                    p50[router].append(statistics.median(lat))
                    p99[router].append(lat[int(0.99 * (len(lat) - 1))])
                    print(
                        f"repeat {repeat} router={router:12s} p50 {p50[router][-1]:.3f} ms  "
                        f"p99 {p99[router][-1]:.3f} ms"
                    )
        finally:
            await index.stop(drain_timeout=1.0)
        added = [p - r for p, r in zip(p50["prefix"], p50["round-robin"], strict=True)]
        print(
            f"p50 added by the prefix lookup per repeat: {', '.join(f'{a:.3f}' for a in added)} "
            f"ms; median {statistics.median(added):.3f} ms (target <= 1 ms)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shards", type=int, default=2)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
