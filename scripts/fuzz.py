"""Fuzzing rlt: random and mutated messages against every decoder and every subject.

Two parts, both driven by a seeded mutator over valid messages (``scripts/fuzz_messages.py``:
structural mutations of the decoded message, byte-level mutations of the encoded one, and
plain random bytes):

- ``fuzz_decoders``: in-process, every internal decoder and the pure core behind it
  (admission's request parser, the scheduler driver, the prefix index, the worker-liveness
  judge, the chunk reassembler, admission's open-request table). Only the documented
  failures may come out: ``msgspec.DecodeError`` from a decoder, ``AdmissionError`` from
  admission; anything else is a bug.
- ``run_live``: the four services as real processes on a real nats-server. Mutated messages
  go to the public subjects (each generate with a reply inbox) and to the internal ones;
  afterwards every generate must have been answered with exactly one terminal event, every
  process is alive with no crash logged, KV is reclaimed, and valid requests still work.

    python scripts/fuzz.py --cases 12000            # >= 10k cases (decoders + live)
    tests/test_fuzz.py runs a bounded number in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from messages.api import FinishedEvent  # noqa: E402
from messages.internal import (  # noqa: E402
    AbortForward,
    AdmittedRequest,
    RelayBatch,
    RequestNotice,
    SchedulerLoad,
    ShardAnnounce,
    WorkerBatch,
    WorkerHeartbeat,
    WorkerResult,
)
from messages.prefix import PrefixEventBatch, PrefixIndexSnapshot, PrefixLookup  # noqa: E402
from scripts.fuzz_messages import Mutator, valid_messages  # noqa: E402
from services.runtime import subjects  # noqa: E402

if TYPE_CHECKING:
    from services.launcher.processes import ServiceProcs


# ---------------------------------------------------------------------- in-process decoders
@dataclass
class DecoderReport:
    cases: int = 0
    decoded: int = 0  # mutated messages that still decoded (and went through the core)
    per_target: dict[str, int] = field(default_factory=dict)


class _Msg:
    """Enough of a nats Msg for the Reassembler."""

    def __init__(self, data: bytes, headers: dict[str, str] | None) -> None:
        self.data = data
        self.headers = headers


def _load_snapshot(snapshot: PrefixIndexSnapshot) -> None:
    from services.prefix_cache.core import PrefixIndex

    with contextlib.suppress(ValueError):  # packed hashes of a bad length: refused by name
        PrefixIndex.from_snapshot(snapshot)


def fuzz_decoders(checkpoint: Path, cases: int, seed: int = 0) -> DecoderReport:
    """Mutated messages into every internal decoder and the pure core behind it."""
    from services.admission.core import AdmissionConfig, AdmissionCore, AdmissionError, OpenRequests
    from services.admission.shards import ShardTable
    from services.common.checkpoint import load_model_limits
    from services.common.config import SchedulerConfig
    from services.common.tokenizer import TextCodec
    from services.prefix_cache.core import PrefixIndex
    from services.runtime.bus import HEADER_CHUNK, Reassembler
    from services.scheduler.driver.driver import SchedulerDriver
    from services.scheduler.driver.liveness import LossDetector, WorkerTracker

    limits, codec = load_model_limits(checkpoint), TextCodec.from_checkpoint(checkpoint)
    admission = AdmissionCore(limits, codec, AdmissionConfig(max_payload=1 << 20))
    config = SchedulerConfig(block_size=4, num_blocks=256, enable_prefix_caching=True)
    driver = SchedulerDriver(config, limits, codec, log=_Quiet())
    index = PrefixIndex()
    tracker, loss = WorkerTracker(), LossDetector()
    reassembler = Reassembler()
    table = OpenRequests(scheduler_lost_s=1.0)
    shards = ShardTable("a", block_size=4)
    mut = Mutator(seed)
    ids = {"worker": "w", "scheduler": "s", "scheduler_epoch": "s.0", "admission": "a"}
    targets = valid_messages(ids)
    decoders: dict[str, Callable[[bytes], Any]] = {
        subjects.GENERATE: admission.prepare,
        subjects.ABORT: admission.parse_abort,
    }

    def run_core(subject: str, data: bytes) -> bool:
        if subject in decoders:
            try:
                decoders[subject](data)
            except AdmissionError:
                return False
            return True
        track = subjects.admission_track("a", 1)
        for prefix, typ, core in (
            (subjects.SCHED_SUBMIT, AdmittedRequest, lambda m: driver.add(m, track=track)),
            (subjects.SCHED_ABORT, AbortForward, lambda m: driver.abort(
                m.request_id, admission_id=m.admission_id, admission_seq=m.admission_seq,
                broadcast=m.broadcast)),
            (subjects.SCHED_LOAD, SchedulerLoad, lambda m: shards.apply(m, 0.0, time.time())),
            (subjects.SHARD_ANNOUNCE, ShardAnnounce, lambda m: shards.announce(m, 0.0)),
            (subjects.admission_relay("a"), RelayBatch, lambda m: [
                table.relayed(m.shard_id, e) for e in m.events]),
            (subjects.WORKER_HEARTBEAT, WorkerHeartbeat, _heartbeat(tracker, loss, driver)),
            (subjects.WORKER_BATCH, WorkerBatch, _worker_batch_checks),
            (subjects.WORKER_RESULT, WorkerResult, driver.on_result),
            (subjects.PREFIX_EVENTS, list[PrefixEventBatch], lambda m: [index.apply(b) for b in m]),
            (subjects.PREFIX_LOOKUP, PrefixLookup, lambda m: index.lookup(m.block_hashes)),
            ("$O.RLT_PREFIX_INDEX", PrefixIndexSnapshot, _load_snapshot),
            (subjects.ADMISSION_TRACK_PREFIX, RequestNotice, lambda m: table.notice(1, m, 0.0)),
        ):  # fmt: skip
            if subject.startswith(prefix):
                try:
                    message = msgspec.msgpack.decode(data, type=typ)
                except msgspec.DecodeError:
                    return False
                core(message)
                return True
        return False

    report = DecoderReport()
    for _ in range(cases):
        subject, obj, encode = mut.rng.choice(targets)
        data = mut.mutate(obj, encode)
        report.cases += 1
        report.per_target[subject] = report.per_target.get(subject, 0) + 1
        try:
            report.decoded += run_core(subject, data)
            # the same bytes as one part of a split message, with a mutated chunk header
            header = mut.bytewise(f"{mut.rng.randrange(3)} {mut.rng.randrange(3)} 2".encode())
            reassembler.feed(
                _Msg(data, {HEADER_CHUNK: header.decode("utf-8", "replace")})  # type: ignore[arg-type]
            )
        except Exception as exc:
            raise AssertionError(
                f"{type(exc).__name__} from {subject} with {data[:200]!r}: {exc}"
            ) from exc
        # keep the driver moving so requests added by fuzzed submits also leave again
        if mut.rng.random() < 0.05:
            driver.bind(ids["worker"])
            driver.step()
    return report


class _Quiet:
    """A logger that drops everything (the fuzzer makes the driver log a lot)."""

    def __getattr__(self, _name: str) -> Callable[..., None]:
        return lambda *_a, **_k: None


def _heartbeat(tracker: Any, loss: Any, driver: Any) -> Callable[[WorkerHeartbeat], None]:
    def apply(hb: WorkerHeartbeat) -> None:
        tracker.heartbeat(hb, time.monotonic())
        tracker.choose(None, time.monotonic(), 0.0)
        driver.check_worker(hb, loss, 1e9)

    return apply


def _worker_batch_checks(wb: WorkerBatch) -> None:
    from services.worker.service import _is_older_epoch

    _is_older_epoch(wb.epoch, "x.1")


# ---------------------------------------------------------------------- live
@dataclass
class LiveReport:
    cases: int = 0
    generate_with_reply: int = 0
    answered_once: int = 0
    unanswered: int = 0
    duplicates: int = 0
    per_subject: dict[str, int] = field(default_factory=dict)
    crashes: list[str] = field(default_factory=list)
    kv_reclaimed: bool = False
    valid_after_ok: bool = False

    def ok(self) -> bool:
        return (
            self.unanswered == 0
            and self.duplicates == 0
            and not self.crashes
            and self.kv_reclaimed
            and self.valid_after_ok
        )


async def run_live(
    url: str, procs: ServiceProcs, cases: int, seed: int = 0, rate: int = 400
) -> LiveReport:
    """``cases`` mutated messages at ~``rate``/s over every subject (generate with a reply)."""
    from services.launcher.probes import StreamCollector, client, health
    from services.launcher.processes import wait_for

    report = LiveReport()
    mut = Mutator(seed)
    async with client(url) as nc:
        sched = await health(nc, "scheduler")
        ids = {
            "worker": (await health(nc, "worker"))["worker_id"],
            "scheduler": sched["instance"],
            "scheduler_epoch": sched["epoch"],
            "admission": (await health(nc, "admission"))["instance"],
        }
        targets = valid_messages(ids)
        col = await StreamCollector(nc).start()
        generate_ids: list[int] = []
        t0 = time.monotonic()
        public = [t for t in targets if t[0] == subjects.GENERATE]
        for n in range(cases):
            # the public entry point gets a third of the traffic, the rest is spread
            subject, obj, encode = mut.rng.choice(public if mut.rng.random() < 0.33 else targets)
            data = mut.mutate(obj, encode)
            if len(data) > nc.max_payload:
                data = data[: nc.max_payload]
            report.cases += 1
            report.per_subject[subject] = report.per_subject.get(subject, 0) + 1
            if subject == subjects.GENERATE:
                generate_ids.append(n)
                await col.send(n, data)
            else:
                await nc.publish(subject, data, reply=mut.rng.choice(["", "_INBOX.fuzz-sink"]))
            # pace it: a flood is a different test (backpressure); here every message counts
            ahead = (n + 1) / rate - (time.monotonic() - t0)
            if ahead > 0:
                await asyncio.sleep(ahead)
        report.generate_with_reply = len(generate_ids)
        with contextlib.suppress(TimeoutError):
            await col.wait_done(generate_ids, 90)
        await asyncio.sleep(0.5)
        for i in generate_ids:
            n_terminal = len(col.terminals(i))
            report.answered_once += n_terminal == 1
            report.unanswered += n_terminal == 0
            report.duplicates += max(n_terminal - 1, 0)

        # the system still works: a few valid requests, and then everything is reclaimed
        after = await StreamCollector(nc).start()
        for i in range(4):
            await after.send(
                i, {"prompt_token_ids": [1 + i, 2, 3], "max_tokens": 5, "ignore_eos": True}
            )
        try:
            await after.wait_done(range(4), 60)  # type: ignore[arg-type]
            report.valid_after_ok = all(
                isinstance(after.terminals(i)[0], FinishedEvent) for i in range(4)
            )
        except TimeoutError:
            report.valid_after_ok = False

        async def reclaimed() -> bool:
            h = await health(nc, "scheduler")
            return h["live_requests"] == 0 and h["free_kv_blocks"] == h["num_kv_blocks"]

        try:
            await wait_for(reclaimed, 30, "KV reclaimed")
            report.kv_reclaimed = True
        except TimeoutError:
            report.kv_reclaimed = False
    for key, proc in procs.procs.items():
        if not proc.alive():
            report.crashes.append(f"{key} exited with {proc.popen.returncode}")
        for line in procs.logs(proc).splitlines():
            if any(w in line for w in ("handler failed", "task crashed", "step failed")):
                report.crashes.append(f"{key}: {line[:300]}")
    return report


async def _main(args: argparse.Namespace) -> int:
    from services.launcher.nats_servers import NatsServer, free_port
    from services.launcher.processes import service_procs
    from services.worker.model.toy import write_toy_checkpoint

    with tempfile.TemporaryDirectory(prefix="rlt-fuzz-") as tmp:
        work = Path(tmp)
        ckpt = write_toy_checkpoint(work / "ckpt", seed=0, size="toy")
        t0 = time.monotonic()
        dec = fuzz_decoders(ckpt, args.cases // 2, args.seed)
        took = time.monotonic() - t0
        print(f"decoders: {dec.cases} cases ({dec.decoded} decoded) in {took:.1f}s")
        with (
            NatsServer(port=free_port()) as server,
            service_procs(
                server.url,
                ckpt,
                work,
                ["--enable-prefix-caching", "--block-size", "4"],
                {"RLT_MAX_REQUEST_S": "30"},
            ) as procs,
        ):
            await procs.start_all()
            live = await run_live(server.url, procs, args.cases - args.cases // 2, args.seed)
    print(json.dumps({"decoders": dec.__dict__, "live": live.__dict__}, indent=2, default=str))
    print(f"total cases: {dec.cases + live.cases}")
    return 0 if live.ok() else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cases", type=int, default=12000, help="half decoders, half live")
    p.add_argument("--seed", type=int, default=0)
    return asyncio.run(_main(p.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
