"""The handover between a prefill and a decode shard, without NATS: admission moves a handed-off
request to a decode shard once, or (its client asked to abort it while the prefill shard
was handing it over) ends it there with ``abort``; every handoff that no decode shard will
read is released at once. The prefill scheduler confirms an abort aimed at a try it handed
off (admission ends that try), instead of answering ``not_found``."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import pytest
import structlog

from messages.api import FinishedEvent, TokenEvent
from messages.internal import AdmittedRequest, RelayBatch, RelayedEvent
from messages.kv_transfer import KVBlockFormat, KVHandoff, KVRelease
from messages.sampling import PrefillSetting, SamplingParams, SparsePrefill
from services.admission.relay import Relay
from services.admission.shard_moves import ShardMoves
from services.admission.tables import FenceLog, FinishedRecord, OpenRequests
from services.common.checkpoint import load_model_limits
from services.common.config import SchedulerConfig
from services.runtime import subjects
from services.runtime.bus import decode_msgpack
from services.scheduler.driver.driver import SchedulerDriver
from services.worker.model.ouro import OuroModel
from services.worker.runner import ModelRunner
from tests.helpers import relayed_events, run_on

pytestmark = pytest.mark.unit


class _Bus:
    is_connected = True
    max_payload = 1 << 20

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    async def publish(self, subject: str, data: bytes, reply: str = "", headers=None) -> None:  # type: ignore[no-untyped-def]
        await asyncio.sleep(0)
        self.sent.append((subject, data))

    def to(self, prefix: str) -> list[bytes]:
        return [data for subject, data in self.sent if subject.startswith(prefix)]


class _Actor:
    instance_id = "adm"

    def __init__(self) -> None:
        self.nc = _Bus()
        self.log = structlog.get_logger()


class _Routing:
    """Admission's routing, as far as a handover uses it: one decode shard ("1")."""

    def __init__(self, during_choice: Any = None, decode: bool = True) -> None:
        self.during_choice = during_choice  # what happens while the choice awaits
        self.decode = decode
        self.submitted: list[AdmittedRequest] = []

    async def choose_decode(self, admitted, now, exclude):  # type: ignore[no-untyped-def]
        await asyncio.sleep(0)
        if self.during_choice is not None:
            self.during_choice()
        return ("1", 0) if self.decode else None

    def choose_healthy(self, num_prompt_tokens, now, exclude):  # type: ignore[no-untyped-def]
        return "0"

    async def submit(self, admitted, now, overlap_blocks=0, traceparent=""):  # type: ignore[no-untyped-def]
        self.submitted.append(admitted)


def _handoff() -> KVHandoff:
    return KVHandoff(
        handoff_id="sched-p.1", request_id="r", shard_id="0", scheduler_id="sched-p",
        worker_id="w0", worker_epoch="e", num_tokens=3, plane_blocks=[[0]],
        block_format=KVBlockFormat(kv_layout="shared", block_size=4, num_planes=1),
    )  # fmt: skip


def _setup(routing: _Routing) -> tuple[Relay, OpenRequests, _Actor]:
    actor = _Actor()
    table = OpenRequests(scheduler_lost_s=5.0)
    admitted = AdmittedRequest(
        request_id="r", prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=8),
        reply_subject="_INBOX.r", admission_seq=1, shard_id="0",
    )  # fmt: skip
    table.opened(1, "r", "_INBOX.r", "", 0.0, shard="0", admitted=admitted)
    seqs = iter(range(2, 100))
    moves = ShardMoves(
        actor,
        None,
        table,
        FenceLog(),
        routing,
        None,
        lambda: next(seqs),  # type: ignore[arg-type]
    )
    relay = Relay(actor, table, FinishedRecord(), moves, None)  # type: ignore[arg-type]
    return relay, table, actor


def _first_token_and_handoff() -> RelayBatch:
    token = TokenEvent(request_id="r", index=0, token_id=42, exit_depth=4, text="")
    return RelayBatch(
        scheduler_id="sched-p",
        shard_id="0",
        events=[RelayedEvent(seq=1, event=token), RelayedEvent(seq=1, handoff=_handoff())],
    )


def _released(actor: _Actor) -> list[str]:
    prefix = subjects.sched_kv_release("sched-p")
    return [decode_msgpack(d, KVRelease).handoff_id for d in actor.nc.to(prefix)]


async def test_a_handed_off_request_moves_to_the_decode_shard_once() -> None:
    routing = _Routing()
    relay, table, actor = _setup(routing)
    batch = _first_token_and_handoff()
    await relay.relay(batch)
    await relay.relay(batch)  # a duplicate of the relay: the old try is no longer open
    (resumed,) = routing.submitted
    assert resumed.kv_source == _handoff() and not resumed.hand_off
    assert resumed.resume_token_ids == [42] and resumed.shard_id == "1"
    entry = table.find("r")
    assert entry is not None and entry.shard == "1" and entry.moves == 0
    assert _released(actor) == []  # the decode shard releases it once it read it


@pytest.mark.parametrize("when", ["before", "during"])
async def test_an_abort_that_went_to_the_prefill_shard_ends_the_request_at_its_handover(
    when: str,
) -> None:
    """The client's abort reached admission after the prefill shard had handed the request
    off but before admission moved it: it went to the prefill shard, which no longer has
    it. The request must not go on on a decode shard: it ends here, aborted, once."""
    table_ref: list[OpenRequests] = []

    def abort() -> None:  # what Aborts.abort does before forwarding to the entry's shard
        entry = table_ref[0].find("r")
        assert entry is not None
        entry.abort_requested = True

    routing = _Routing(during_choice=abort if when == "during" else None)
    relay, table, actor = _setup(routing)
    table_ref.append(table)
    batch = _first_token_and_handoff()
    if when == "before":
        token_only = msgspec.structs.replace(batch, events=batch.events[:1])
        await relay.relay(token_only)
        abort()
        batch = msgspec.structs.replace(batch, events=batch.events[1:])
    await relay.relay(batch)
    assert routing.submitted == []
    assert table.find("r") is None and len(table) == 0
    client = [msgspec.json.decode(d) for d in actor.nc.to("_INBOX.r")]
    finals = [e for e in client if e["type"] == "finished"]
    assert len(finals) == 1 and finals[0]["finish_reason"] == "abort"
    assert finals[0]["token_ids"] == [42]
    assert _released(actor) == ["sched-p.1"]


async def test_the_prefill_shards_setting_goes_with_the_request_wherever_it_runs() -> None:
    """The handoff says how the prefill shard prefilled the prompt (token-sparse prefill):
    the resumed request carries it, to a decode shard or to a shard that computes the
    prompt again, and so does any later move of the request."""
    setting = PrefillSetting(sparse_prefill=SparsePrefill(window=8, retention=(1, 1, 0.25, 0.1)))
    for decode in (True, False):
        routing = _Routing(decode=decode)
        relay, table, _ = _setup(routing)
        batch = _first_token_and_handoff()
        handoff = msgspec.structs.replace(_handoff(), prefill_setting=setting)
        await relay.relay(
            msgspec.structs.replace(
                batch, events=[*batch.events[:1], RelayedEvent(seq=1, handoff=handoff)]
            )
        )
        (resumed,) = routing.submitted
        assert resumed.prefill_setting == setting
        entry = table.find("r")
        assert entry is not None and entry.admitted is not None
        assert entry.resumed(entry.admitted, 9, "2").prefill_setting == setting


async def test_a_handoff_nobody_reads_is_released_at_once() -> None:
    # no decode shard is healthy: it continues on a shard that computes its prompt again
    routing = _Routing(decode=False)
    relay, _, actor = _setup(routing)
    await relay.relay(_first_token_and_handoff())
    (resumed,) = routing.submitted
    assert resumed.kv_source is None and resumed.resume_token_ids == [42]
    assert _released(actor) == ["sched-p.1"]
    # the client went away before its handoff was handled: nothing to move
    routing = _Routing()
    relay, table, actor = _setup(routing)
    batch = _first_token_and_handoff()
    await relay.relay(msgspec.structs.replace(batch, events=batch.events[:1]))
    entry = table.find("r")
    assert entry is not None
    table.close(entry.seq)
    await relay.relay(msgspec.structs.replace(batch, events=batch.events[1:]))
    assert routing.submitted == [] and _released(actor) == []  # closed: never seen as open


def test_the_prefill_scheduler_confirms_an_abort_of_a_try_it_handed_off(
    toy_checkpoint: Path,
) -> None:
    config = SchedulerConfig(block_size=4, num_blocks=64)
    driver = SchedulerDriver(config, load_model_limits(toy_checkpoint))
    model = OuroModel.from_checkpoint(toy_checkpoint)
    runner = ModelRunner(model, config.num_blocks, config.block_size, config.kv_layout)
    admitted = AdmittedRequest(
        request_id="r", prompt_token_ids=[5, 9, 33], reply_subject="_INBOX.r",
        params=SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
        relay_subject=subjects.admission_relay("x"), admission_id="adm", admission_seq=1,
        hand_off=True,
    )  # fmt: skip
    driver.add(admitted)
    driver.bind("w1")
    handoffs = []
    for _ in range(50):
        out = driver.step()
        handoffs += [r.item.handoff for r in out.relays if r.item.handoff is not None]
        for wb in out.batches:
            driver.on_result(run_on(runner, wb))
        if handoffs:
            break
    assert handoffs and driver.scheduler.handoffs and not driver.streams.live
    out = driver.abort("r", "_INBOX.abort", admission_id="adm", admission_seq=1)
    ((subject, answer),) = out.deliveries
    assert subject == "_INBOX.abort"
    assert isinstance(answer, FinishedEvent) and answer.finish_reason == "abort", answer
    assert not relayed_events(out)  # its stream went with the handoff: nothing relayed
    # an abort naming no try is answered as before
    out = driver.abort("r", "_INBOX.abort2")
    assert out.deliveries[0][1].code == "not_found"  # type: ignore[union-attr]


def test_a_decode_scheduler_reset_releases_its_pulls_handoffs_at_once(
    toy_checkpoint: Path,
) -> None:
    """A decode scheduler that gives up on everything (its drain timed out) releases the
    handoffs of its pulls at once, not after the prefill side's hold time; its new core
    keeps the service's pull timeout."""
    from messages.errors import ErrorCode

    config = SchedulerConfig(block_size=4, num_blocks=64)
    limits = load_model_limits(toy_checkpoint)
    driver = SchedulerDriver(config, limits, kv_handoff_hold_s=7.0, kv_transfer_timeout_s=3.0)
    handoff = msgspec.structs.replace(
        _handoff(), plane_blocks=[[0]] * 4, block_format=driver.scheduler.block_format
    )
    admitted = AdmittedRequest(
        request_id="r", prompt_token_ids=[5, 9, 33], reply_subject="_INBOX.r",
        params=SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
        relay_subject=subjects.admission_relay("x"), admission_id="adm", admission_seq=2,
        resume_token_ids=[42], resume_exit_depths=[4], kv_source=handoff,
    )  # fmt: skip
    driver.add(admitted)
    driver.bind("w1")
    out = driver.step()
    assert any(wb.batch.kv_pulls for wb in out.batches) and len(driver.scheduler.pulls) == 1
    out = driver.reset(ErrorCode.UNAVAILABLE, "scheduler shut down")
    assert [h.handoff_id for h in out.kv_releases] == [handoff.handoff_id]
    assert driver.scheduler.pulls.timeout_s == 3.0 and driver.scheduler.handoffs.hold_s == 7.0


def test_handoff_ids_never_repeat_across_a_scheduler_reset(toy_checkpoint: Path) -> None:
    """A release names a handoff by id: one of the old core's arriving late must not free
    (and vouch for) the new core's handoff of the same number."""
    from messages.errors import ErrorCode

    config = SchedulerConfig(block_size=4, num_blocks=64)
    driver = SchedulerDriver(config, load_model_limits(toy_checkpoint))
    model = OuroModel.from_checkpoint(toy_checkpoint)
    first = _hand_off_one(driver, model, "r1", 1)
    driver.reset(ErrorCode.UNAVAILABLE, "scheduler shut down")
    second = _hand_off_one(driver, model, "r2", 2)
    assert first.handoff_id != second.handoff_id
    assert not driver.release_handoff(first.handoff_id)  # not the new core's
    assert driver.release_handoff(second.handoff_id)


def _hand_off_one(driver: SchedulerDriver, model: OuroModel, rid: str, seq: int) -> KVHandoff:
    """Runs one request on ``driver`` (prefill role, a fresh runner) up to its handoff."""
    config = driver.config
    runner = ModelRunner(model, config.num_blocks, config.block_size, config.kv_layout)
    admitted = AdmittedRequest(
        request_id=rid, prompt_token_ids=[5, 9, 33], reply_subject="_INBOX.r",
        params=SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
        relay_subject=subjects.admission_relay("x"), admission_id="adm", admission_seq=seq,
        hand_off=True,
    )  # fmt: skip
    driver.add(admitted)
    driver.bind("w1")
    for _ in range(50):
        out = driver.step()
        for relay in out.relays:
            if relay.item.handoff is not None:
                return relay.item.handoff
        for wb in out.batches:
            driver.on_result(run_on(runner, wb))
    raise AssertionError("no handoff")
