"""Soak: N clients x many requests with random aborts and malformed messages mixed in,
against the four services as real processes on a real nats-server.

Checks: every request that was sent with a reply subject gets exactly one terminal event
(valid ones: finished or a clear error; malformed ones: one error), all KV is reclaimed at
the end (asked from the scheduler's health endpoint), and the services' RSS stays flat
(growth from after warm-up to the end is reported).

``--adversary``: NATS runs with the permission model (every service its own user, random
passwords, as ``rlt up`` does), the honest clients are the default tenant, and an attacker
(tenant ``mallory``, knowing the honest clients' request ids and inbox subjects) mixes in
everything a compromised client can try: poison sampling values, priority it may not have,
aborts of honest ids, honest ids taken first, streams pointed into honest inboxes, deep JSON,
huge trace ids, forged internal messages, subscribing to ``>``. Then also: every honest
request's output equals the in-process engine's (a truncated prefix of it if aborted), no
honest stream got a foreign event, every attacker probe got exactly the refusal it should,
and the attacker never received anything that was not its own (``scripts/soak_adversary.py``).
An output that differs is listed in ``divergences`` (request, first differing token, both
tokens and exit depths, the gaps there); one at a near-tie counts as ``near_ties``, any other
as ``altered``, which fails the soak (``scripts/soak_verify.py``).

    python scripts/soak.py --duration 600 --clients 8      # the long variant
    python scripts/soak.py --duration 300 --adversary      # with an attacker mixed in
    python scripts/soak.py --disaggregated --duration 300  # P/D with worker faults
                                                           # (scripts/soak_disaggregated.py)
    tests/test_soak.py runs about half a minute of each in CI.
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

from messages.api import ErrorEvent, FinishedEvent, TokenEvent  # noqa: E402
from scripts.soak_adversary import ATTACKER, run_adversary  # noqa: E402
from scripts.soak_verify import stream_problem, verify_outputs  # noqa: E402
from services.launcher.probes import StreamCollector, client, health  # noqa: E402
from services.launcher.processes import ServiceProcs, service_procs, wait_for  # noqa: E402
from services.runtime import subjects  # noqa: E402
from services.runtime.bus import encode_json  # noqa: E402

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
    # with outputs verified (--adversary): honest outputs unlike the engine's that no
    # near-tie explains, or streams with a foreign or inconsistent event (these fail the
    # soak); outputs that part from the engine's at a near-tie (counted apart); and every
    # one of either kind, named (scripts/soak_verify.py)
    verified: int = 0
    altered: int = 0
    near_ties: int = 0
    divergences: list[dict[str, object]] = field(default_factory=list)
    # the attacker: probes sent, probes not answered with exactly the refusal expected,
    # messages it received that were not its own, permission errors NATS gave it
    adversary_probes: int = 0
    adversary_wrong: int = 0
    adversary_leaks: int = 0
    adversary_denied: int = 0
    adversary_wrong_examples: list[str] = field(default_factory=list)
    scheduler_at_end: dict[str, object] = field(default_factory=dict)
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
            and self.altered == 0
            and self.adversary_wrong == 0
            and self.adversary_leaks == 0
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
    control_url: str | None = None,
    adversary_url: str | None = None,
    verify_outputs: bool = False,
) -> SoakReport:
    """``url``: the honest clients' (with their credentials); ``control_url``: for health
    requests (an operator's); ``adversary_url``: tenant ``mallory``'s, to mix in the attacker;
    ``verify_outputs``: compare every honest output with the in-process engine's."""
    report = SoakReport()
    rng = random.Random(seed)
    t0 = time.monotonic()
    stop_at = t0 + duration_s
    rss_start: dict[str, int] = {}
    honest_inboxes: list[str] = []
    async with client(control_url or url) as control:

        async def one_client(cid: int) -> StreamCollector:
            crng = random.Random(rng.getrandbits(64))
            async with client(url) as nc:
                col = await StreamCollector(nc).start()
                honest_inboxes.append(col.prefix)
                col.kinds = {}  # type: ignore[attr-defined]
                col.bodies = {}  # type: ignore[attr-defined]
                col.aborted = set()  # type: ignore[attr-defined]
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
                        col.bodies[i] = body  # type: ignore[attr-defined]
                        await col.send(i, body)
                        if crng.random() < abort_fraction:
                            await asyncio.sleep(crng.random() * 0.3)
                            report.aborts += 1
                            col.aborted.add(i)  # type: ignore[attr-defined]
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
        attacker = None
        if adversary_url is not None:
            attacker = asyncio.ensure_future(
                run_adversary(adversary_url, stop_at, seed, clients, honest_inboxes)
            )
        cols = await asyncio.gather(*(one_client(c) for c in range(clients)))
        await sampler
        if attacker is not None:
            adversary = await attacker
            report.adversary_probes = adversary.probes
            report.adversary_wrong = adversary.wrong
            report.adversary_leaks = adversary.leaks
            report.adversary_denied = adversary.denied
            report.adversary_wrong_examples = adversary.wrong_examples

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
                if key == "abort" and i not in col.aborted:  # type: ignore[attr-defined]
                    # only its own client may stop it: anyone else reached it
                    report.altered += 1
                    rid = col.bodies[i]["request_id"]  # type: ignore[attr-defined]
                    note = "ended by an abort its client never sent"
                    report.divergences.append({"request_id": rid, "note": note})

        async def reclaimed() -> bool:
            h = await health(control, "scheduler")
            return h["live_requests"] == 0 and h["free_kv_blocks"] == h["num_kv_blocks"]

        try:
            await wait_for(reclaimed, 15, "KV reclaimed")
            report.kv_reclaimed = True
        except TimeoutError:
            report.kv_reclaimed = False
            h = await health(control, "scheduler")
            keys = ("live_requests", "streams", "free_kv_blocks", "num_kv_blocks", "running")
            report.scheduler_at_end = {k: h.get(k) for k in keys}
        report.open_requests_left = (await health(control, "admission"))["open_requests"]
        if verify_outputs and procs is not None:  # in a thread: our connections stay alive
            await asyncio.to_thread(verify_honest_outputs, cols, procs.checkpoint, report)
    if procs is not None:
        for key, start in rss_start.items():
            end = procs.rss_kib(key)
            report.rss_mib[key] = round(end / 1024, 1)
            report.rss_growth_mib[key] = round((end - start) / 1024, 2)
    report.seconds = round(time.monotonic() - t0, 1)
    return report


def verify_honest_outputs(
    cols: list[StreamCollector], checkpoint: Path, report: SoakReport
) -> None:
    """Every honest stream is consistent (tokens in order, then its own terminal, nothing
    foreign) and its output equals the in-process engine's for the same request (a prefix
    of it when the request was aborted), up to a near-tie: no attacker changed or added
    anything (``scripts/soak_verify.py``)."""
    done: list[tuple[FinishedEvent, dict]] = []
    for col in cols:
        for i, body in col.bodies.items():  # type: ignore[attr-defined]
            events = col.events.get(i, [])
            terminals = [e for e in events if not isinstance(e, TokenEvent)]
            if not terminals:
                continue  # counted as missing
            problem = stream_problem(events, body["request_id"])
            if problem is not None:
                report.altered += 1
                report.divergences.append({"request_id": body["request_id"], "note": problem})
                continue
            if isinstance(terminals[0], FinishedEvent):
                done.append((terminals[0], body))
    verify_outputs(done, checkpoint, ENGINE_ARGS, report)


async def _main(args: argparse.Namespace) -> int:
    from services.launcher.nats_servers import NatsServer, free_port
    from services.worker.model.toy import write_toy_checkpoint

    with tempfile.TemporaryDirectory(prefix="rlt-soak-") as tmp:
        work = Path(tmp)
        ckpt = write_toy_checkpoint(work / "ckpt", seed=0, size="toy")
        if not args.adversary:
            with (
                NatsServer(port=free_port()) as server,
                service_procs(server.url, ckpt, work, ENGINE_ARGS) as procs,
            ):
                await procs.start_all()
                report = await run_soak(
                    server.url,
                    procs,
                    duration_s=args.duration,
                    clients=args.clients,
                    concurrency=args.concurrency,
                    seed=args.seed,
                )
        else:
            report = await run_adversary_soak(
                ckpt,
                work,
                duration_s=args.duration,
                clients=args.clients,
                concurrency=args.concurrency,
                seed=args.seed,
            )
    print(json.dumps(report.__dict__, indent=2))
    return 0 if report.ok() else 1


async def run_adversary_soak(
    checkpoint: Path,
    work: Path,
    *,
    duration_s: float,
    clients: int = 4,
    concurrency: int = 4,
    seed: int = 0,
) -> SoakReport:
    """The soak on NATS secured as ``rlt up`` secures it, with the attacker mixed in."""
    from services.launcher.nats_servers import NatsServer, free_port
    from services.runtime.permissions import LocalAuth

    auth = LocalAuth.generate([ATTACKER])
    conf = work / "nats.conf"
    conf.write_text(auth.config())
    envs = {
        name: {"RLT_NATS_USER": name, "RLT_NATS_PASSWORD": auth.passwords[name]}
        for name in ("worker", "prefix-cache", "scheduler", "admission")
    }
    with (
        NatsServer(port=free_port(), config_file=conf) as server,
        service_procs(server.url, checkpoint, work, ENGINE_ARGS) as procs,
    ):
        await procs.start_all(envs=envs)
        return await run_soak(
            auth.url("client", server.url),
            procs,
            duration_s=duration_s,
            clients=clients,
            concurrency=concurrency,
            seed=seed,
            control_url=auth.url("operator", server.url),
            adversary_url=auth.url(f"tenant-{ATTACKER}", server.url),
            verify_outputs=True,
        )


def main() -> int:
    if "--disaggregated" in sys.argv[1:]:  # the P/D fault soak, with options of its own
        from scripts.soak_disaggregated import main as disaggregated_main

        sys.argv.remove("--disaggregated")
        return disaggregated_main()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of traffic")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight per client")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--adversary",
        action="store_true",
        help="secured NATS, and an attacker tenant mixed in (see above)",
    )
    return asyncio.run(_main(p.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
