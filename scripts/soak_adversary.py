"""The soak's attacker (``scripts/soak.py --adversary``): tenant ``mallory``, knowing the
honest clients' request ids and inbox subjects, tries everything a compromised client can,
and counts every probe that did not get exactly the refusal it should.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass, field

from messages.api import FinishedEvent
from messages.batch import Batch, BatchKind
from messages.internal import AdmittedRequest, WorkerBatch
from messages.sampling import SamplingParams
from services.launcher.probes import StreamCollector, client
from services.runtime import subjects
from services.runtime.bus import HEADER_TRACE_ID, encode_json, encode_msgpack

ATTACKER = "mallory"


@dataclass
class AdversaryReport:
    probes: int = 0  # probes sent
    wrong: int = 0  # probes not answered with exactly the refusal expected
    leaks: int = 0  # messages it received that were not its own
    denied: int = 0  # permission errors NATS gave it
    wrong_examples: list[str] = field(default_factory=list)


async def run_adversary(
    url: str,
    stop_at: float,
    seed: int,
    clients: int,
    honest_inboxes: list[str],
) -> AdversaryReport:
    """Tenant ``mallory`` tries what a compromised client can, for the whole soak. It knows
    the honest request ids and inbox subjects (as if they leaked). Every probe with a reply
    has one expected answer; streams it points elsewhere must reach nobody."""
    report = AdversaryReport()
    rng = random.Random(seed ^ 0x5EED)
    denied: list[str] = []

    async def on_error(exc: Exception) -> None:
        denied.append(str(exc))

    inbox = subjects.tenant_inbox(ATTACKER)
    generate, abort = subjects.tenant_generate(ATTACKER), subjects.tenant_abort(ATTACKER)
    async with client(url, inbox_prefix=inbox, error_cb=on_error) as nc:
        col = await StreamCollector(nc).start()
        expect: dict[int, tuple[str, ...]] = {}  # the answers each probe may get
        actions: dict[int, str] = {}
        squats: dict[str, int] = {}  # an honest id it took -> the probe that took it first
        leaks: list[str] = []

        async def spy(msg) -> None:  # type: ignore[no-untyped-def]
            leaks.append(msg.subject)

        for wide in (">", "_INBOX.>", "rlt.v1.>"):  # refused by NATS: nothing arrives
            await nc.subscribe(wide, cb=spy)
        honest_id = lambda: f"soak-{seed}-{rng.randrange(clients)}-{rng.randrange(200)}"  # noqa: E731
        deep = b'{"request_id": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
        n = 0
        while time.monotonic() < stop_at:
            action = rng.choice(
                ["poison", "priority", "abort", "squat", "deep", "trace", "inject", "forge"]
            )
            small = {"prompt_token_ids": [rng.randrange(1, 500)], "max_tokens": 1}
            if action == "poison":
                bad = rng.choice([{"temperature": 1e-300}, {"top_p": 1e-46, "temperature": 1.0}])
                expect[n] = ("error:invalid_request",)
                await col.send(n, {**small, **bad}, generate)
            elif action == "priority":
                expect[n] = ("error:invalid_request",)
                await col.send(n, {**small, "priority": -1000}, generate)
            elif action == "abort":
                rid = honest_id()
                expect[n] = abort_answers(rid, squats, col)
                await col.send(n, {"request_id": rid}, abort)
            elif action == "squat":  # an honest id, maybe before the honest client uses it
                rid = honest_id()
                # (its own second try of one id from another reply subject is a conflict)
                expect[n] = ("error:invalid_request",) if rid in squats else ("finished",)
                squats.setdefault(rid, n)
                await col.send(n, {**small, "request_id": rid}, generate)
            elif action == "deep":
                expect[n] = ("error:invalid_request",)
                await col.send(n, deep, rng.choice([abort, generate]))
            elif action == "trace":
                expect[n] = ("finished",)
                col.events.setdefault(n, [])
                await nc.publish(
                    generate,
                    encode_json(small),
                    reply=col.reply(n),
                    headers={HEADER_TRACE_ID: "x" * 200_000},
                )
            elif action == "inject" and honest_inboxes:
                target = f"{rng.choice(honest_inboxes)}.{rng.randrange(200)}"
                await nc.publish(generate, encode_json(small), reply=target)
                await nc.publish(abort, encode_json({"request_id": honest_id()}), reply=target)
                n -= 1  # no answer expected anywhere
            else:  # forged internal messages: NATS refuses each publish
                await _forge(nc, rng, honest_inboxes)
                n -= 1
            if n in expect:
                actions[n] = action
            n += 1
            report.probes += 1
            await asyncio.sleep(0.03)
        with contextlib.suppress(TimeoutError):  # counted below
            await col.wait_done(list(expect), 60)
        await asyncio.sleep(0.5)
        for i, want in expect.items():
            terminals = col.terminals(i)
            got = [
                t.finish_reason and "finished"
                if isinstance(t, FinishedEvent)
                else f"error:{t.code}"
                for t in terminals
            ]
            if len(got) != 1 or got[0] not in want:
                report.wrong += 1
                if len(report.wrong_examples) < 5:
                    report.wrong_examples.append(f"{actions[i]} (probe {i}): {want} -> {got}")
        report.leaks += len(leaks)
        report.denied += len(denied)
    return report


def abort_answers(request_id: str, squats: dict[str, int], col: StreamCollector) -> tuple[str, ...]:
    """What an abort of an honest id may answer the attacker. Ids are per tenant, so it
    never reaches the honest request: ``not_found``, unless the attacker's own request with
    that id (a squat) may still run, which the abort then ends (its acknowledgement is a
    ``finished`` event)."""
    own = squats.get(request_id)
    if own is not None and not col.terminals(own):
        return ("error:not_found", "finished")
    return ("error:not_found",)


async def _forge(nc, rng: random.Random, honest_inboxes: list[str]) -> None:  # type: ignore[no-untyped-def]
    """Internal messages a client is not allowed to publish (each is a permission error)."""
    target = f"{rng.choice(honest_inboxes)}.0" if honest_inboxes else "_INBOX.x"
    forged = AdmittedRequest(
        request_id="forged",
        prompt_token_ids=[1],
        params=SamplingParams(max_tokens=1),
        reply_subject=target,
    )
    batch = WorkerBatch(
        epoch="mallory.999999999", batch=Batch(seq=0, kind=BatchKind.RECURRENT, rows=[])
    )
    subject, body = rng.choice(
        [
            (subjects.SCHED_SUBMIT, encode_msgpack(forged)),
            (subjects.worker_batch("any"), encode_msgpack(batch)),
            (f"{subjects.WORKER_RESULT}.any.0", b"\x80"),
            (subjects.prefix_events("scheduler"), b"\x80"),
            (target, encode_json({"type": "finished", "request_id": "x", "finish_reason": "stop",
                                  "token_ids": [], "exit_depths": [], "num_prompt_tokens": 1})),
            ("$JS.API.STREAM.CREATE.EVIL", encode_json({"subjects": ["_INBOX.>"]})),
        ]
    )  # fmt: skip
    await nc.publish(subject, body)
