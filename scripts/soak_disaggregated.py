"""P/D fault soak: a prefill shard and a decode shard as real processes on a real
nats-server, clients streaming requests for ``--duration`` seconds, and a fault injector
that, every few seconds, waits for a KV pull to be under way and then kills (kill -9, the
worker restarted with its role after a moment) or stops (SIGSTOP, SIGCONT a moment later)
the prefill or the decode worker, at random.

Checks, at the end:
- every request got exactly one terminal event, its token events in order and its own;
- every finished output equals the in-process engine's for the same request (a near-tie
  is counted apart, ``scripts/soak_verify.py``); a request that ends with an error (a
  clear one: ``unavailable`` when no shard could take it) is counted as lost, never as
  output;
- once idle, every block is free on both shards: ``rlt:kv_cache_usage_perc`` of both
  schedulers back to 0 in their published metrics, and their health says no request,
  handoff, open pull or quarantined block is left.

    python scripts/soak_disaggregated.py --duration 300         # the long run
    python scripts/soak.py --disaggregated --duration 300       # the same
    python scripts/soak_disaggregated.py --duration 20 --fault-every 4   # a short one

The decode worker holds each pull between its 4 KiB chunks (``RLT_KV_TRANSFER_TEST_HOLD_S``,
tests only) so that a pull lasts long enough for a fault to land in it, and both workers
move KV over TCP (a stopped process would still serve shared-memory copies).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from messages.api import FinishedEvent, TokenEvent  # noqa: E402
from scripts.soak import ENGINE_ARGS  # noqa: E402  (the same engine as the colocated soak)
from scripts.soak_verify import stream_problem, verify_outputs  # noqa: E402
from services.launcher.probes import StreamCollector, client, health  # noqa: E402
from services.launcher.processes import ServiceProcs, service_procs, wait_for  # noqa: E402
from services.runtime import subjects  # noqa: E402
from services.runtime.metrics import MetricsReceiver  # noqa: E402

ROLES = {"0": "prefill", "1": "decode"}
# a lost worker is noticed in 1.5 s; metrics every 0.5 s (the end's usage check)
ENV = {
    "RLT_WORKER_HEARTBEAT_TIMEOUT_S": "1.5",
    "RLT_WORKER_HEARTBEAT_S": "0.25",
    "RLT_SCHEDULER_LOST_S": "1.5",
    "RLT_METRICS_INTERVAL_S": "0.5",
    "UCX_TLS": "tcp",
}
PULL_HOLD = {"RLT_KV_TRANSFER_TEST_HOLD_S": "0.05", "RLT_KV_TRANSFER_CHUNK_BYTES": "4096"}
USAGE = "rlt:kv_cache_usage_perc"
FALLBACKS = "rlt:kv_transfer_fallbacks"


@dataclass
class PDSoakReport:
    requests: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # finish_reason / error code
    lost_with_error: int = 0  # ended by a clear error event
    missing: int = 0  # no terminal event
    duplicates: int = 0  # terminal events past the first
    inconsistent: int = 0  # foreign or repeated token events
    verified: int = 0  # finished outputs compared with the in-process engine
    verified_tokens: int = 0
    altered: int = 0
    near_ties: int = 0
    divergences: list[dict[str, Any]] = field(default_factory=list)
    faults: dict[str, int] = field(default_factory=dict)  # "kill9-prefill", "stop-decode", ...
    faults_mid_pull: int = 0  # struck while the decode worker had a pull under way
    # workers that died by themselves (not killed here), with how
    died: list[str] = field(default_factory=list)
    # faults after which the shards were not both healthy within 90 s (what admission saw)
    not_recovered: list[dict[str, Any]] = field(default_factory=list)
    finished_on_shard: dict[str, int] = field(default_factory=dict)
    # decode-shard prefills instead of pulls, by reason (rlt:kv_transfer_fallbacks_total)
    kv_transfer_fallbacks: dict[str, int] = field(default_factory=dict)
    shards_at_end: dict[str, dict[str, Any]] = field(default_factory=dict)
    kv_usage_at_end: dict[str, float] = field(default_factory=dict)  # the metric, by shard
    kv_reclaimed: bool = False
    idle_after_s: float = -1.0  # from the last request's end to every block free
    seconds: float = 0.0

    def ok(self) -> bool:
        return (
            self.requests > 0
            and self.missing == 0
            and self.duplicates == 0
            and self.inconsistent == 0
            and self.altered == 0
            and self.verified > 0
            and self.kv_reclaimed
            and not self.not_recovered
            and not self.died
        )


def request_body(rng: random.Random, rid: str) -> dict[str, Any]:
    shared = list(range(1, 25)) if rng.random() < 0.3 else []  # prefix hits on both shards
    return {
        "request_id": rid,
        "prompt_token_ids": shared + [rng.randrange(1, 500) for _ in range(rng.randrange(4, 48))],
        "max_tokens": rng.randrange(2, 40),
        "temperature": rng.choice([0.0, 0.8]),
        "seed": rng.randrange(1000),
        "min_loops": rng.choice([1, 2]),
        "exit_threshold": rng.choice([1.0, 0.7]),
        "ignore_eos": rng.random() < 0.5,
    }


class UsageWatch:
    """The latest ``rlt:kv_cache_usage_perc`` each shard's scheduler published."""

    def __init__(self) -> None:
        self._receiver = MetricsReceiver()
        self.usage: dict[str, float] = {}
        self.updated: dict[str, float] = {}  # when, by shard
        self.fallbacks: dict[str, int] = {}  # decode-shard prefills, by reason

    async def start(self, nc: Any) -> None:
        await nc.subscribe(subjects.metrics("scheduler"), cb=self._on_msg)

    async def _on_msg(self, msg: Any) -> None:
        text = self._receiver.feed(msg)
        if text is None or text.shard is None:
            return
        for family in text_string_to_metric_families(text.text):
            if family.name == USAGE:
                self.usage[text.shard] = family.samples[0].value
                self.updated[text.shard] = time.monotonic()
            elif family.name == FALLBACKS:
                for sample in family.samples:
                    if sample.name.endswith("_total"):
                        self.fallbacks[sample.labels["reason"]] = int(sample.value)


async def _health_or_none(nc: Any, name: str) -> dict[str, Any] | None:
    try:
        return await health(nc, name, timeout=1.0)
    except Exception:  # stopped or restarting
        return None


async def _pull_under_way(nc: Any, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        h = await _health_or_none(nc, "worker.1")
        if h is not None and h.get("kv_pulls_active", 0) > 0:
            return True
        await asyncio.sleep(0.02)
    return False


def shard_args(shard: str, decode_blocks: int) -> list[str]:
    """A shard's role, and the decode shard's smaller KV (pressure there)."""
    blocks = ["--num-blocks", str(decode_blocks)] if ROLES[shard] == "decode" else []
    return ["--role", ROLES[shard], *blocks]


def start_worker(procs: ServiceProcs, shard: str, decode_blocks: int) -> Any:
    env = {**ENV, **(PULL_HOLD if ROLES[shard] == "decode" else {})}
    return procs.start("worker", env=env, shard=shard, args=shard_args(shard, decode_blocks))


async def inject_faults(
    procs: ServiceProcs,
    control: Any,
    stop_at: float,
    rng: random.Random,
    every_s: float,
    decode_blocks: int,
    report: PDSoakReport,
) -> None:
    """Until ``stop_at``: a fault every ``every_s`` (on average), at a pull if one comes
    within 3 s; each waits for both shards to be healthy again before the next."""
    faults: Counter[str] = Counter()
    while time.monotonic() < stop_at:
        await asyncio.sleep(rng.uniform(0.5, 1.5) * every_s)
        if time.monotonic() >= stop_at:
            break
        report.faults_mid_pull += await _pull_under_way(control, 3.0)
        shard = rng.choice(sorted(ROLES))
        key = f"worker-{shard}"
        if not procs.procs[key].alive():  # it died by itself: noted, and started again
            report.died.append(f"{key}: exit {procs.procs[key].popen.returncode}")
            await _restart(procs, shard, decode_blocks, report)
        elif rng.random() < 0.5:
            procs.kill(key)  # kill -9 (waits until it is gone)
            faults[f"kill9-{ROLES[shard]}"] += 1
            await asyncio.sleep(rng.uniform(0.2, 2.0))
            await _restart(procs, shard, decode_blocks, report)
        else:
            procs.kill(key, signal.SIGSTOP)
            faults[f"stop-{ROLES[shard]}"] += 1
            await asyncio.sleep(rng.uniform(0.3, 4.0))
            procs.kill(key, signal.SIGCONT)
        report.faults = dict(faults)
        try:
            await wait_for(lambda: _both_healthy(control), 90, "both shards healthy again")
        except TimeoutError:  # a liveness failure: noted with what admission saw, and on
            h = await _health_or_none(control, "admission")
            shards = {} if h is None else h["shards"]
            report.not_recovered.append({"after": f"{faults}", "shards": shards})


async def _restart(
    procs: ServiceProcs, shard: str, decode_blocks: int, report: PDSoakReport
) -> None:
    """The shard's worker again, with its role; one that exits while starting is noted and
    tried again (three times at most)."""
    for _ in range(3):
        try:
            await procs.wait_ready(start_worker(procs, shard, decode_blocks), timeout=120.0)
            return
        except (RuntimeError, TimeoutError) as exc:
            report.died.append(f"worker-{shard} while starting: {str(exc)[-300:]}")


async def _both_healthy(nc: Any) -> bool:
    h = await _health_or_none(nc, "admission")
    if h is None:
        return False
    return all(h["shards"].get(s, {}).get("healthy") for s in ROLES)


async def _shard_idle(nc: Any, shard: str) -> dict[str, Any] | None:
    h = await _health_or_none(nc, f"scheduler.{shard}")
    if h is None:
        return None
    keys = (
        "live_requests", "free_kv_blocks", "num_kv_blocks", "handoffs_held", "kv_pulls_open",
        "kv_blocks_quarantined", "kv_pulled", "kv_pull_failures", "handed_off",
    )  # fmt: skip
    return {k: h.get(k) for k in keys}


def _idle(state: dict[str, Any] | None) -> bool:
    return (
        state is not None
        and state["live_requests"] == 0
        and state["free_kv_blocks"] == state["num_kv_blocks"]
        and not state["handoffs_held"]
        and not state["kv_pulls_open"]
        and not state["kv_blocks_quarantined"]
    )


async def run_pd_soak(
    url: str,
    procs: ServiceProcs,
    checkpoint: Path,
    *,
    duration_s: float,
    clients: int = 4,
    concurrency: int = 4,
    fault_every_s: float = 6.0,
    decode_blocks: int = 256,
    seed: int = 0,
    settle_s: float = 90.0,
    engine_args: list[str] = ENGINE_ARGS,
) -> PDSoakReport:
    report = PDSoakReport()
    rng = random.Random(seed)
    t0 = time.monotonic()
    stop_at = t0 + duration_s
    async with client(url) as control:
        usage = UsageWatch()
        await usage.start(control)

        async def one_client(cid: int) -> tuple[StreamCollector, dict[int, dict[str, Any]]]:
            crng = random.Random(rng.getrandbits(64))
            bodies: dict[int, dict[str, Any]] = {}
            async with client(url) as nc:
                col = await StreamCollector(nc).start()
                sem = asyncio.Semaphore(concurrency)

                async def one(i: int) -> None:
                    try:
                        body = bodies[i] = request_body(crng, f"pd-soak-{seed}-{cid}-{i}")
                        await col.send(i, body)
                        await col.wait_done([i], 240)
                    except TimeoutError:
                        pass  # counted as missing
                    finally:
                        sem.release()

                tasks, n = [], 0
                while time.monotonic() < stop_at:
                    await sem.acquire()
                    tasks.append(asyncio.ensure_future(one(n)))
                    n += 1
                await asyncio.gather(*tasks)
                await asyncio.sleep(0.5)  # a duplicate terminal would have arrived by now
                return col, bodies

        injector = asyncio.ensure_future(
            inject_faults(procs, control, stop_at, rng, fault_every_s, decode_blocks, report)
        )
        results = await asyncio.gather(*(one_client(c) for c in range(clients)))
        try:
            await injector
        except Exception as exc:  # the injector's own failure: reported, the checks go on
            report.died.append(f"fault injector: {exc!r}"[:500])
        ended = time.monotonic()
        done = _tally_streams(results, report)

        async def reclaimed() -> bool:
            states = {s: await _shard_idle(control, s) for s in ROLES}
            fresh = all(usage.updated.get(s, 0.0) > time.monotonic() - 0.6 for s in ROLES)
            report.shards_at_end = {s: st or {} for s, st in states.items()}
            report.kv_usage_at_end = dict(usage.usage)
            report.kv_transfer_fallbacks = dict(usage.fallbacks)
            quiet = all(_idle(st) for st in states.values())
            return quiet and fresh and all(usage.usage.get(s) == 0.0 for s in ROLES)

        try:
            await wait_for(reclaimed, settle_s, "every block free on both shards")
            report.kv_reclaimed = True
            report.idle_after_s = round(time.monotonic() - ended, 1)
        except TimeoutError:
            report.kv_reclaimed = False
    await asyncio.to_thread(verify_outputs, done, checkpoint, engine_args, report)
    report.verified_tokens = sum(len(f.token_ids) for f, _ in done)
    report.seconds = round(time.monotonic() - t0, 1)
    return report


def _tally_streams(
    results: list[tuple[StreamCollector, dict[int, dict[str, Any]]]], report: PDSoakReport
) -> list[tuple[FinishedEvent, dict[str, Any]]]:
    """Counts every stream's terminal events and problems; returns the finished ones with
    the bodies that asked for them."""
    done = []
    for col, bodies in results:
        for i, body in bodies.items():
            report.requests += 1
            events = col.events.get(i, [])
            terminals = col.terminals(i)
            if not terminals:
                report.missing += 1
                continue
            report.duplicates += len(terminals) - 1
            problem = stream_problem(events, body["request_id"])
            if problem is not None:
                report.inconsistent += 1
                report.divergences.append({"request_id": body["request_id"], "note": problem})
                continue
            final = terminals[0]
            if isinstance(final, FinishedEvent):
                key = final.finish_reason
                streamed = [e.token_id for e in events if isinstance(e, TokenEvent)]
                if streamed != final.token_ids:
                    report.inconsistent += 1
                    note = "the streamed tokens differ from the finished event's"
                    report.divergences.append({"request_id": body["request_id"], "note": note})
                    continue
                done.append((final, body))
                shard = final.shard or "?"
                report.finished_on_shard[shard] = report.finished_on_shard.get(shard, 0) + 1
            else:
                key = f"error:{final.code}"
                report.lost_with_error += 1
            report.finished[key] = report.finished.get(key, 0) + 1
    return done


async def start_pd(procs: ServiceProcs, decode_blocks: int) -> None:
    started = [procs.start("prefix-cache", env=ENV)]
    for shard in ROLES:
        started.append(start_worker(procs, shard, decode_blocks))
        args = shard_args(shard, decode_blocks)
        started.append(procs.start("scheduler", env=ENV, shard=shard, args=args))
    started.append(procs.start("admission", env=ENV))
    for proc in started:
        await procs.wait_ready(proc, timeout=180.0)


async def run_main(args: argparse.Namespace) -> int:
    from services.launcher.nats_servers import NatsServer, free_port
    from services.worker.model.toy import write_toy_checkpoint

    engine_args = [*ENGINE_ARGS, "--kv-cache-dtype", args.kv_cache_dtype]
    with tempfile.TemporaryDirectory(prefix="rlt-pd-soak-") as tmp:
        work = Path(args.workdir or tmp)  # --workdir: the services' logs are kept there
        work.mkdir(parents=True, exist_ok=True)
        ckpt = write_toy_checkpoint(work / "ckpt", seed=0, size="toy")
        with (
            NatsServer(port=free_port()) as server,
            service_procs(server.url, ckpt, work, engine_args) as procs,
        ):
            await start_pd(procs, args.decode_blocks)
            async with client(server.url) as nc:
                await wait_for(lambda: _both_healthy(nc), 60, "both shards healthy")
            report = await run_pd_soak(
                server.url,
                procs,
                ckpt,
                duration_s=args.duration,
                clients=args.clients,
                concurrency=args.concurrency,
                fault_every_s=args.fault_every,
                decode_blocks=args.decode_blocks,
                seed=args.seed,
                engine_args=engine_args,
            )
    print(json.dumps(report.__dict__, indent=2))
    return 0 if report.ok() else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=float, default=300.0, help="seconds of traffic")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight per client")
    p.add_argument("--fault-every", type=float, default=6.0, help="mean seconds between faults")
    p.add_argument(
        "--decode-blocks", type=int, default=256, help="the decode shard's KV blocks (pressure)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default="", help="keep the services' logs here")
    p.add_argument(
        "--kv-cache-dtype", default="auto", help="both shards' KV codec (auto, fp8, int4-delta)"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_arguments(p)
    return asyncio.run(run_main(p.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
