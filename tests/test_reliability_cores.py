"""The pure cores behind the reliability mechanisms, without NATS (fast, exhaustive-ish):
worker liveness and loss detection, the scheduler driver's recovery (results of a lost epoch
never applied, outputs equal an uninterrupted run), admission's open-request table, chunk
reassembly, reply-subject checks; plus the batch deadline on an in-process pipeline whose
worker hangs."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from pathlib import Path

import pytest

from messages.api import FinishedEvent, TokenEvent
from messages.batch import Batch, BatchKind
from messages.internal import (
    AdmittedRequest,
    RelayBatch,
    RelayedEvent,
    RequestNotice,
    WorkerBatch,
    WorkerHeartbeat,
)
from messages.sampling import SamplingParams
from services.admission.core import AdmissionCore, OpenRequests
from services.common.checkpoint import load_model_limits
from services.common.config import SchedulerConfig
from services.common.tokenizer import TextCodec
from services.engine.engine import LLMEngine
from services.launcher import NatsServer
from services.runtime import subjects
from services.runtime.bus import HEADER_CHUNK, Reassembler, decode_msgpack
from services.scheduler.driver.driver import SchedulerDriver
from services.scheduler.driver.liveness import LossDetector, WorkerTracker
from services.scheduler.driver.step_output import Relay, StepOutput
from services.scheduler.fencing import Fence
from services.scheduler.output_publisher import OutputPublisher, StepTimings
from services.worker.model.ouro import OuroModel
from services.worker.runner import ModelRunner
from services.worker.service import _is_older_epoch
from tests.helpers import relayed_events, run_on

pytest.register_assert_rewrite("tests.conftest_nats")

from tests.conftest_nats import Client, check_stream, services_up  # noqa: E402

pytest_plugins = ["tests.conftest_nats"]


def hb(worker: str = "w1", **kw: object) -> WorkerHeartbeat:
    return WorkerHeartbeat(worker_id=worker, **kw)  # type: ignore[arg-type]


@pytest.mark.unit
def test_worker_tracker_binds_one_worker_and_judges_liveness() -> None:
    t = WorkerTracker(heartbeat_timeout_s=3.0)
    assert t.choose(None, 0.0, 0.0) is None
    t.heartbeat(hb("w1"), 1.0)
    t.heartbeat(hb("w2"), 2.0)
    assert t.choose(None, 2.0, 0.0) == "w1"  # the longest-known
    assert t.choose("w2", 2.0, 0.0) == "w2"  # the bound one is kept while eligible
    # silence while we were disconnected does not count
    assert not t.is_dead("w1", 10.0, connected_since=9.0)
    assert t.is_dead("w1", 10.0, connected_since=0.0)
    t.heartbeat(hb("w2"), 9.5)
    assert t.choose("w1", 10.0, 0.0) == "w2"  # w1 died: pruned, w2 takes over
    assert "w1" not in t.workers
    # a hung worker is suspect until it reports itself idle again
    t.mark_suspect("w2")
    assert t.choose("w2", 10.0, 0.0) is None
    t.heartbeat(hb("w2", busy_s=5.0), 10.1)
    assert t.choose(None, 10.1, 0.0) is None
    t.heartbeat(hb("w2"), 10.2)
    assert t.choose(None, 10.2, 0.0) == "w2"
    # a draining worker is not picked
    t.heartbeat(hb("w2", draining=True), 10.3)
    assert t.choose(None, 10.3, 0.0) is None


@pytest.mark.unit
def test_loss_detector_finds_lost_batches_and_results() -> None:
    d = LossDetector(grace_s=2.0)
    sent = {5: 100.0, 6: 100.5}
    # nothing in flight: nothing lost
    assert d.check(hb(epoch="e", next_seq=5, missing_seq=5), "e", [], {}, 200.0) is None
    # the worker idles waiting for batch 5, which we sent long ago: lost on the way
    assert d.check(hb(epoch="e", next_seq=5, missing_seq=5), "e", [5, 6], sent, 101.0) is None
    assert "lost on its way to the worker" in (
        d.check(hb(epoch="e", next_seq=5, missing_seq=5), "e", [5, 6], sent, 103.0) or ""
    )
    # the worker never saw this epoch
    assert "never received" in (
        d.check(hb(epoch="old", next_seq=0, missing_seq=0), "e", [5], sent, 103.0) or ""
    )
    # it waits for a batch older than anything in flight: diverged
    assert "already done" in (d.check(hb(epoch="e", missing_seq=2), "e", [5], sent, 103.0) or "")
    # it finished batch 5 but the result does not come: lost on the way back
    d2 = LossDetector(grace_s=2.0)
    busy = hb(epoch="e", next_seq=6, busy_s=0.1)
    assert d2.check(busy, "e", [5, 6], sent, 104.0) is None  # first seen now
    assert d2.check(busy, "e", [5, 6], sent, 105.0) is None
    assert "lost on its way back" in (d2.check(busy, "e", [5, 6], sent, 106.5) or "")
    # a worker still busy with the oldest batch is fine
    assert d2.check(hb(epoch="e", next_seq=5, busy_s=9.0), "e", [5], sent, 500.0) is None


@pytest.mark.unit
def test_worker_epoch_order() -> None:
    assert _is_older_epoch("s.1", "s.2")
    assert not _is_older_epoch("s.3", "s.2")
    assert not _is_older_epoch("t.0", "s.9")  # another scheduler: newest wins
    assert not _is_older_epoch("s.1", None)


def _admitted(rid: str, ids: list[int], max_tokens: int = 10) -> AdmittedRequest:
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, min_loops=1, exit_threshold=0.7
    )
    return AdmittedRequest(
        request_id=rid,
        prompt_token_ids=ids,
        params=params,
        reply_subject=f"_INBOX.{rid}",
        relay_subject=subjects.admission_relay("x"),
    )


@pytest.mark.unit
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_driver_worker_lost_recomputes_and_ignores_the_old_epoch(
    toy_checkpoint: Path, async_scheduling: bool
) -> None:
    config = SchedulerConfig(
        block_size=4,
        num_blocks=256,
        wavefront_chunked_prefill=True,
        prefill_chunk_size=3,
        async_scheduling=async_scheduling,
        enable_prefix_caching=True,
    )
    model = OuroModel.from_checkpoint(toy_checkpoint)
    limits = load_model_limits(toy_checkpoint)
    driver = SchedulerDriver(config, limits, TextCodec.from_checkpoint(toy_checkpoint))
    prompts = {"a": [5, 9, 33, 71, 2, 18], "b": [101, 7, 7, 250], "c": list(range(40, 52))}
    for rid, ids in prompts.items():
        out = driver.add(_admitted(rid, ids), track=f"rlt.v1.adm.x.{rid}")
        assert not out.relays and [n.state for _, n in out.notices] == ["accepted"]
    runner = ModelRunner(model, config.num_blocks, config.block_size, config.kv_layout)
    events: list = []
    stale = []
    driver.bind("w1")
    for step in range(200):
        out = driver.step()
        assert not out.notices  # a relayed stream's terminal event tells admission itself
        events += relayed_events(out)
        results = [run_on(runner, wb) for wb in out.batches]
        if step == 7:
            # the worker dies with these batches in flight; a new one starts empty
            stale = results
            driver.worker_lost("test")
            runner = ModelRunner(model, config.num_blocks, config.block_size, config.kv_layout)
            driver.bind("w2")
            continue
        for r in results:
            assert driver.on_result(r)
        if driver.idle:
            break
    assert driver.idle and stale
    for r in stale:  # the dead epoch's results: never applied
        assert not driver.on_result(r)
    by_rid: dict[str, list] = {}
    for e in events:
        by_rid.setdefault(e.request_id, []).append(e)
    engine = LLMEngine(model, config)
    expected = engine.generate(list(prompts.values()), [_admitted("x", []).params] * len(prompts))
    for rid, want in zip(prompts, expected, strict=True):
        got = check_stream(by_rid[rid])  # each token streamed exactly once
        assert isinstance(got, FinishedEvent)
        assert (got.token_ids, got.exit_depths) == (want.token_ids, want.exit_depths)
    assert driver.num_worker_losses == 1
    assert driver.scheduler.kv.num_free_blocks == config.num_blocks


@pytest.mark.unit
def test_driver_deadlines(toy_checkpoint: Path) -> None:
    config = SchedulerConfig(block_size=4, num_blocks=64)
    driver = SchedulerDriver(config, load_model_limits(toy_checkpoint))
    driver.add(_admitted("old", [1, 2, 3]))
    driver.add(_admitted("young", [1, 2, 3]))
    driver.add(_admitted("young2", [1, 2, 3]))
    driver.streams["old"].started -= 100
    out = driver.expire(time.monotonic(), max_request_s=50, no_worker_since=None, worker_wait_s=10)
    assert [(e.request_id, e.code) for e in relayed_events(out)] == [("old", "timeout")]
    # no worker for a while: everyone who waited long enough gives up
    out = driver.expire(
        time.monotonic() + 11, max_request_s=50, no_worker_since=time.monotonic(), worker_wait_s=10
    )
    assert {(e.request_id, e.code) for e in relayed_events(out)} == {
        ("young", "unavailable"),
        ("young2", "unavailable"),
    }
    assert driver.idle and driver.scheduler.kv.num_free_blocks == 64


def _declare_suspects(table: OpenRequests, now: float, connected_since: float) -> list:
    """What admission does once nats-server confirms the suspects' schedulers are gone."""
    return table.declare(list(table.suspects(now, connected_since)))


class _RecordingBus:
    """A NATS client stand-in that yields on every publish (as a busy one may)."""

    is_connected = True
    max_payload = 1 << 20

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    async def publish(self, subject: str, data: bytes, reply: str = "", headers=None) -> None:  # type: ignore[no-untyped-def]
        await asyncio.sleep(0)
        self.sent.append((subject, data))


class _OpenBus:
    """A fence host that is never dark."""

    instance_id = "s"
    bus_connected = True
    bus_connected_since = 0.0

    def __init__(self, nc: _RecordingBus) -> None:
        self.nc = nc


@pytest.mark.unit
async def test_outputs_go_out_whole_in_the_order_the_driver_handed_them_out(
    toy_checkpoint: Path,
) -> None:
    """A handler's output never overtakes the loop's: the loop's relayed token goes out
    before the finished event a handler produced after it, though the loop's batch went
    first and awaited."""
    driver = SchedulerDriver(SchedulerConfig(), load_model_limits(toy_checkpoint))
    bus = _RecordingBus()
    fence = Fence(_OpenBus(bus), reconnect_grace_s=0.0, scheduler_lost_s=10.0)  # type: ignore[arg-type]
    publisher = OutputPublisher(
        bus,  # type: ignore[arg-type]
        driver,
        fence,
        prefix_publisher=None,
        timings=StepTimings(),
        log=driver.log,
        shard_id="0",
        scheduler_id="s",
    )
    relay = subjects.admission_relay("a")
    token = TokenEvent(request_id="r", index=0, token_id=3, exit_depth=1, text="")
    finished = FinishedEvent(
        request_id="r", finish_reason="abort", token_ids=[3], exit_depths=[1], num_prompt_tokens=1
    )
    batch = WorkerBatch(
        epoch=driver.epoch, batch=Batch(seq=0, kind=BatchKind.RECURRENT, rows=[]), worker_id="w"
    )
    loop_out = StepOutput(
        batches=[batch], relays=[Relay(relay, "a", RelayedEvent(seq=1, event=token))]
    )
    handler_out = StepOutput(relays=[Relay(relay, "a", RelayedEvent(seq=1, event=finished))])
    await asyncio.gather(publisher.publish(loop_out), publisher.publish(handler_out))
    relayed = [
        type(event).__name__
        for subject, data in bus.sent
        if subject == relay
        for event in (e.event for e in decode_msgpack(data, RelayBatch).events)
        if event is not None
    ]
    assert relayed == ["TokenEvent", "FinishedEvent"]


@pytest.mark.unit
def test_open_requests_table() -> None:
    table = OpenRequests(scheduler_lost_s=2.0, max_request_s=100.0)
    table.opened(1, "a", "_INBOX.a", "", now=0.0)
    table.opened(2, "b", "_INBOX.b", "", now=0.0)
    table.opened(3, "c", "_INBOX.c", "", now=0.0)
    table.notice(1, RequestNotice(request_id="a", scheduler_id="s1", state="accepted"), 0.1)
    table.notice(2, RequestNotice(request_id="b", scheduler_id="s1", state="accepted"), 0.1)
    table.notice(2, RequestNotice(request_id="b", scheduler_id="s1", state="done"), 0.2)
    table.notice(3, RequestNotice(request_id="WRONG", scheduler_id="s1", state="done"), 0.2)
    assert len(table) == 2
    table.heard_from("s1", 1.5)
    assert _declare_suspects(table, 1.9, connected_since=0.0) == []
    # "c" was never accepted: after scheduler_lost_s it is given up; "a"'s s1 is alive
    assert [e.request_id for e in _declare_suspects(table, 2.1, connected_since=0.0)] == ["c"]
    # our own outage does not count against s1
    assert _declare_suspects(table, 5.0, connected_since=4.0) == []
    assert [e.request_id for e in _declare_suspects(table, 6.5, connected_since=4.0)] == ["a"]
    table.opened(4, "d", "_INBOX.d", "", now=7.0)
    assert table.unanswered(4) is not None and len(table) == 0
    # past max_request_s the scheduler's own timeout is awaited scheduler_lost_s more (it
    # is no suspect meanwhile); then admission ends it itself
    table.opened(5, "e", "_INBOX.e", "", now=10.0)
    table.heard_from("s1", 112.0)
    assert table.suspects(112.0, 0.0) == {} and table.expired(111.0) == []
    assert [e.request_id for e in table.expired(112.5)] == ["e"] and len(table) == 0


@pytest.mark.unit
def test_open_requests_move_only_while_open_and_not_aborted() -> None:
    table = OpenRequests(scheduler_lost_s=2.0)
    admitted = _admitted("m", [1, 2, 3])
    table.opened(1, "m", "_INBOX.m", "", now=0.0, shard="a", admitted=admitted)
    entry = table.get(1)
    assert entry is not None and table.is_open(entry) and table.can_move(entry, max_moves=2)
    table.moved(entry, 2, "b", now=1.0)
    assert table.is_open(entry) and entry.seq == 2 and table.get(1) is None
    table.moved(entry, 3, "a", now=2.0)
    assert not table.can_move(entry, max_moves=2)  # moved too often: it ends
    assert table.can_move(entry, max_moves=3)
    entry.abort_requested = True  # its abort may be lost with its shard: it ends
    assert not table.can_move(entry, max_moves=3)
    # ended while a move of it was pending (the caller awaited): not open, nothing to move
    table.close(3)
    assert not table.is_open(entry)
    # a request another admission routed: nothing to resubmit
    table.opened(4, "n", "_INBOX.n", "", now=3.0)
    other = table.get(4)
    assert other is not None and not table.can_move(other, max_moves=3)
    assert [e.request_id for e in table.close_all()] == ["n"] and len(table) == 0


class _Msg:
    def __init__(self, data: bytes, header: str | None) -> None:
        self.data = data
        self.headers = {HEADER_CHUNK: header} if header else None


@pytest.mark.unit
def test_reassembler() -> None:
    r = Reassembler(max_partial=2)
    assert r.feed(_Msg(b"whole", None)) == b"whole"  # type: ignore[arg-type]
    assert r.feed(_Msg(b"B", "m 1 3")) is None  # type: ignore[arg-type]
    assert r.feed(_Msg(b"A", "m 0 3")) is None  # type: ignore[arg-type]
    assert r.feed(_Msg(b"C", "m 2 3")) == b"ABC"  # type: ignore[arg-type]
    for bad in ("x", "m 3 3", "m -1 3", "m 0 999999", "m a b", ""):
        assert r.feed(_Msg(b"?", bad or "  ")) is None  # type: ignore[arg-type]
    for i in range(5):  # bounded: old partial messages are dropped
        r.feed(_Msg(b"x", f"p{i} 0 2"))  # type: ignore[arg-type]
    assert len(r._partial) == 2


@pytest.mark.unit
@pytest.mark.parametrize(
    ("tenant", "reply", "ok"),
    [
        ("", "_INBOX.abc.1", True),
        # outside every inbox the services may publish to: every event would be refused
        ("", "my.inbox", False),
        ("", "rlt.v1.worker.batch.x", False),
        ("", "$SRV.PING", False),
        ("", "_RLT_INBOX.rlt-admission.x", False),
        ("", "a b", False),
        ("", "a.*", False),
        ("", "a..b", False),
        ("", "", False),
        # a tenant's inboxes are its own: nobody else may point a stream there
        ("", "_INBOX.tenant.acme.x", False),
        ("acme", "_INBOX.tenant.acme.x.1", True),
        ("acme", "_INBOX.tenant.beta.x", False),
        ("acme", "_INBOX.abc.1", False),
        ("acme", "_INBOX.tenant.acme", False),
    ],
)
def test_reply_subject_check(tenant: str, reply: str, ok: bool) -> None:
    assert (AdmissionCore.check_reply_subject(reply, tenant) is None) == ok


@pytest.mark.services
@pytest.mark.usefixtures("torch_single_thread")
@pytest.mark.parametrize("where", ["thread", "loop"])
async def test_hung_batch_hits_the_deadline_and_the_worker_is_used_again(
    where: str, nats_server: NatsServer, toy_checkpoint: Path, run_dir: Path
) -> None:
    """One batch hangs: the batch deadline declares the worker lost (suspect); once the hung
    batch returns and the worker reports idle, it is bound again under a new epoch and the
    request completes unchanged. On the compute thread its heartbeats go on meanwhile; a
    short CPU batch that hangs on the event loop silences them for as long (compute.py)."""
    config = SchedulerConfig(block_size=4, num_blocks=128)
    async with services_up(nats_server.url, toy_checkpoint, config) as services:
        sched, worker = services["scheduler"], services["worker"]
        sched.options = dataclasses.replace(sched.options, batch_timeout_s=0.5)
        if where == "thread":
            worker.queue.inline_max_s = 0.0  # type: ignore[attr-defined]
        real = worker.runner.execute  # type: ignore[attr-defined]
        hung = []

        def execute(batch):  # type: ignore[no-untyped-def]
            on_loop = threading.current_thread() is threading.main_thread()
            if batch.seq >= 3 and not hung and on_loop == (where == "loop"):
                hung.append(batch.seq)
                time.sleep(1.5)
            return worker.runner_execute(batch)  # type: ignore[attr-defined]

        worker.runner_execute = real  # type: ignore[attr-defined]
        worker.runner.execute = execute  # type: ignore[attr-defined]
        original = worker.runner_host.make_runner  # type: ignore[attr-defined]

        def make_runner(*args):  # type: ignore[no-untyped-def]
            original(*args)  # a reset builds a fresh runner: keep the hook on it
            worker.runner_execute = worker.runner.execute  # type: ignore[attr-defined]
            worker.runner.execute = execute  # type: ignore[attr-defined]

        worker.runner_host.make_runner = make_runner  # type: ignore[attr-defined]
        async with Client.connect(nats_server.url) as client:
            events = await client.generate(
                {"prompt_token_ids": [5, 6, 7], "max_tokens": 8, "temperature": 0.0,
                 "ignore_eos": True},
                timeout=30,
            )  # fmt: skip
        terminal = check_stream(events)
        assert isinstance(terminal, FinishedEvent), terminal
        assert hung and sched.driver.num_worker_losses >= 1  # type: ignore[attr-defined]
        expected = LLMEngine.from_checkpoint(toy_checkpoint, config).generate(
            [[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        )
        assert terminal.token_ids == expected[0].token_ids
