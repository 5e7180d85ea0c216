"""The transfer thread alone (two in-process NIXL agents, real READs): pulls move in chunks,
byte-exact; a short pull is not queued behind a long one (shortest first, chunk by chunk);
every pull reports once, by its deadline, whatever it waits for; a new arena ends the pulls
submitted before it."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from messages.kv_transfer import KVPull, KVSourceInfo
from services.worker.kv_transfer import agent as kvt
from services.worker.kv_transfer.agent import (
    KVArena,
    KVTransferAgent,
    PostedChunk,
    ReadPlan,
    TransferError,
    split_indices,
)
from services.worker.kv_transfer.pull_queue import PullJob, PullOutcome, PullQueue

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(not kvt.nixl_available(), reason="NIXL is not installed"),
]

SHAPE = (2, 64, 4, 2, 8)  # layers, blocks, block size, heads, dim: 256-byte blocks
BLOCK_BYTES = 4 * 2 * 8 * 4


def test_split_indices_cuts_whole_blocks_and_keeps_the_pairs() -> None:
    b = 100
    local, remote = np.arange(8, dtype=np.int32), np.arange(10, 18, dtype=np.int32)
    chunks = split_indices(local, remote, b, 3 * b + 50)  # 3 blocks a chunk
    assert [lo.tolist() for lo, _ in chunks] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert [re.tolist() for _, re in chunks] == [[10, 11, 12], [13, 14, 15], [16, 17]]
    # a chunk smaller than a block still moves whole blocks
    assert [len(lo) for lo, _ in split_indices(local, remote, b, 10)] == [1] * 8


class Pair:
    """A source agent (filled arena) and a reader whose transfer thread is the queue."""

    def __init__(
        self,
        hold_s: float = 0.0,
        chunk_bytes: int = 4 * BLOCK_BYTES,
        agent: type[KVTransferAgent] = KVTransferAgent,
    ) -> None:
        self.src = KVArena(torch.randn(SHAPE), torch.randn(SHAPE))
        self.dst = KVArena(torch.zeros(SHAPE), torch.zeros(SHAPE))
        self.source = KVTransferAgent(f"pq-src-{id(self)}")
        self.source.register(self.src, "e", self.src.layout("last_exited", 4))
        self.outcomes: list[PullOutcome] = []
        self.done = threading.Event()
        self.queue = PullQueue(
            lambda: agent(f"pq-dst-{id(self)}"),
            self._on_done,
            chunk_bytes=chunk_bytes,
            hold_s=hold_s,
        )
        self.queue.start().result(timeout=30)
        layout = self.dst.layout("last_exited", 4)
        self.queue.call(lambda a: a.register(self.dst, "e", layout), resets=True).result(10)
        self.n = 0

    def _on_done(self, outcome: PullOutcome) -> None:
        self.outcomes.append(outcome)
        self.done.set()

    def info(self) -> concurrent.futures.Future[KVSourceInfo]:
        future: concurrent.futures.Future[KVSourceInfo] = concurrent.futures.Future()
        future.set_result(self.source.source_info())
        return future

    def submit(
        self,
        remote: list[int],
        local: list[int],
        timeout_s: float = 10.0,
        source: concurrent.futures.Future[KVSourceInfo] | None = None,
    ) -> str:
        self.n += 1
        tid = f"t{self.n}"
        pull = KVPull(
            transfer_id=tid, request_id=tid, worker_id="src", worker_epoch="e",
            remote_blocks=remote, local_blocks=local, timeout_s=timeout_s,
        )  # fmt: skip
        self.queue.submit(PullJob("e", pull, source or self.info()))
        return tid

    def wait(self, n: int, timeout: float = 20.0) -> list[PullOutcome]:
        deadline = time.monotonic() + timeout
        while len(self.outcomes) < n:
            assert time.monotonic() < deadline, self.outcomes
            time.sleep(0.005)
        return self.outcomes

    def landed(self, remote: list[int], local: list[int]) -> bool:
        return all(
            torch.equal(self.dst.k[:, m], self.src.k[:, r])
            and torch.equal(self.dst.v[:, m], self.src.v[:, r])
            for r, m in zip(remote, local, strict=True)
        )

    def close(self) -> None:
        self.queue.close()


def test_the_pull_with_the_fewest_bytes_left_goes_first() -> None:
    pair = Pair()
    try:
        # both wait for one description, so both are planned in the same step
        source: concurrent.futures.Future[KVSourceInfo] = concurrent.futures.Future()
        long_r, long_l = list(range(0, 40)), list(range(10, 50))  # 10 chunks of 4 blocks
        short_r, short_l = [50, 51], [60, 61]
        first = pair.submit(long_r, long_l, source=source)
        second = pair.submit(short_r, short_l, source=source)
        time.sleep(0.05)
        source.set_result(pair.source.source_info())
        outcomes = pair.wait(2)
        assert [o.job.pull.transfer_id for o in outcomes] == [second, first]
        assert all(o.error is None for o in outcomes)
        by_id = {o.job.pull.transfer_id: o for o in outcomes}
        assert by_id[first].num_bytes == 2 * 2 * 40 * BLOCK_BYTES  # K and V, 2 layers
        assert by_id[second].num_bytes == 2 * 2 * 2 * BLOCK_BYTES
        assert pair.landed(long_r, long_l) and pair.landed(short_r, short_l)
        assert not pair.dst.k[:, 0].any()  # nothing else written
        assert pair.queue.num_active == 0 and pair.queue.num_started == 0
    finally:
        pair.close()


class _ArrivalAgent(KVTransferAgent):
    """Calls ``on_start(plan, index)`` as each chunk is posted (on the transfer thread)."""

    on_start: Any = None

    def start(self, plan: ReadPlan, index: int) -> PostedChunk:
        if self.on_start is not None:
            self.on_start(plan, index)
        return super().start(plan, index)


def test_a_pull_under_way_does_not_hold_back_a_new_one() -> None:
    """A short pull submitted while a long one is moving (its third chunk being posted)
    lands before the long one's next chunks: the thread looks for new pulls between
    chunks, even when each post moves its chunk at once."""
    pair = Pair(agent=_ArrivalAgent)
    try:
        long_r, long_l = list(range(0, 40)), list(range(10, 50))  # 40 chunks
        short: list[str] = []

        def arrive(plan: ReadPlan, index: int) -> None:
            if index == 2 and not short and plan.num_bytes > 2 * 2 * 2 * BLOCK_BYTES:
                short.append(pair.submit([50, 51], [60, 61]))

        pair.queue.call(lambda agent: setattr(agent, "on_start", arrive)).result(10)
        first = pair.submit(long_r, long_l)
        outcomes = pair.wait(2)
        assert [o.job.pull.transfer_id for o in outcomes] == [short[0], first]
        by_id = {o.job.pull.transfer_id: o for o in outcomes}
        assert by_id[first].copy_s > 0  # chunks in flight together may add up past the wall time
        assert pair.landed(long_r, long_l) and pair.landed([50, 51], [60, 61])
    finally:
        pair.close()


def test_a_held_pull_moves_one_chunk_at_a_time() -> None:
    """The test hold (RLT_KV_TRANSFER_TEST_HOLD_S): a pull is under way for as long as its
    chunks times the hold, one chunk landed at a time."""
    pair = Pair(hold_s=0.05)
    try:
        pair.submit(list(range(0, 16)), list(range(0, 16)))  # 16 chunks
        while pair.queue.num_started == 0:
            time.sleep(0.001)
        assert pair.queue.num_active == 1
        (outcome,) = pair.wait(1)
        assert outcome.error is None and outcome.seconds >= 15 * 0.05
    finally:
        pair.close()


def test_every_pull_reports_once_by_its_deadline() -> None:
    pair = Pair(hold_s=0.3)
    try:
        never: concurrent.futures.Future[KVSourceInfo] = concurrent.futures.Future()
        lost: concurrent.futures.Future[KVSourceInfo] = concurrent.futures.Future()
        lost.set_exception(TransferError(kvt.SOURCE_LOST, "worker x did not describe its KV"))
        started = time.monotonic()
        waiting = pair.submit([1], [1], timeout_s=0.3, source=never)  # no description
        failed = pair.submit([2], [2], source=lost)
        slow = pair.submit(list(range(8, 24)), list(range(8, 24)), timeout_s=0.5)  # held
        out = {o.job.pull.transfer_id: o for o in pair.wait(3)}
        took = time.monotonic() - started
        assert out[failed].error is not None and out[failed].error.cause == kvt.SOURCE_LOST
        assert out[waiting].error is not None and out[waiting].error.cause == kvt.TIMEOUT
        assert out[slow].error is not None and out[slow].error.cause == kvt.TIMEOUT
        assert not out[slow].abort_unconfirmed and out[slow].num_bytes == 0
        assert took < 2.0
        time.sleep(0.1)
        assert len(pair.outcomes) == 3  # once each
    finally:
        pair.close()


def test_a_new_arena_ends_the_pulls_submitted_before_it() -> None:
    pair = Pair(hold_s=0.2)
    try:
        old = pair.submit(list(range(0, 16)), list(range(0, 16)))
        while pair.queue.num_started == 0:
            time.sleep(0.001)
        fresh = KVArena(torch.zeros(SHAPE), torch.zeros(SHAPE))
        layout = fresh.layout("last_exited", 4)
        pair.queue.call(lambda a: a.register(fresh, "e2", layout), resets=True).result(10)
        (outcome,) = pair.wait(1)
        assert outcome.job.pull.transfer_id == old and outcome.error is not None
        assert outcome.error.cause == kvt.LOCAL_RESET
        pair.dst = fresh
        pair.submit([3, 4], [5, 6])
        assert pair.wait(2)[1].error is None and pair.landed([3, 4], [5, 6])
    finally:
        pair.close()


def test_a_layout_mismatch_fails_the_pull_by_name() -> None:
    pair = Pair()
    try:
        other = KVArena(torch.randn(3, 64, 4, 2, 8), torch.randn(3, 64, 4, 2, 8))
        agent = KVTransferAgent("pq-other")
        agent.register(other, "e", other.layout("last_exited", 4))
        source: concurrent.futures.Future[KVSourceInfo] = concurrent.futures.Future()
        source.set_result(agent.source_info())
        pair.submit([0], [0], source=source)
        (outcome,) = pair.wait(1)
        assert outcome.error is not None and outcome.error.cause == kvt.LAYOUT_MISMATCH
        assert "num_layers: 2 vs 3" in str(outcome.error)
    finally:
        pair.close()


async def test_a_worker_without_kv_transfer_fails_a_pull_by_name(toy_checkpoint) -> None:  # type: ignore[no-untyped-def]
    """A decode scheduler's pull sent to a worker started without --role: it fails
    (``unavailable``) and says so to its scheduler, from the compute thread too."""
    import asyncio

    from services.common.config import SchedulerConfig
    from services.worker.service import WorkerService

    worker = WorkerService(
        "nats://127.0.0.1:1", toy_checkpoint, SchedulerConfig(), inline_max_s=0.0
    )
    await worker.setup()
    try:
        assert worker.kv is not None
        pull = KVPull(
            transfer_id="t", request_id="r", worker_id="w", worker_epoch="e",
            remote_blocks=[1], local_blocks=[2],
        )  # fmt: skip
        worker.kv.prepare([pull])
        await asyncio.to_thread(worker.kv.before_batch, worker.runner, "e", "last_exited", [pull])
        epoch, result = await asyncio.wait_for(worker.kv.results.get(), 5)
        assert (epoch, result.ok, result.cause) == ("e", False, kvt.UNAVAILABLE)
    finally:
        await worker.teardown()


async def test_a_replaced_runner_leaves_nixl_before_its_kv_is_freed(toy_checkpoint) -> None:  # type: ignore[no-untyped-def]
    """A new runner (a new epoch) is built only once the old one's KV has left NIXL and
    nothing holds it: on a GPU the new KV is sized to the memory the old one frees, so a
    reference kept to the old one would fail every rebuild."""
    import asyncio
    import gc
    import weakref

    from services.common.config import SchedulerConfig
    from services.worker.service import WorkerService

    config = SchedulerConfig(num_blocks=32, block_size=4)
    worker = WorkerService(
        "nats://127.0.0.1:1", toy_checkpoint, config, inline_max_s=0.0, kv_transfer=True
    )
    await worker.setup()
    try:
        assert worker.kv is not None and worker.runner is not None
        await asyncio.to_thread(worker.kv.before_batch, worker.runner, "e1", "last_exited", [])
        assert (await worker.kv.source_info()).epoch == "e1"  # registered
        old = weakref.ref(worker.runner.k_cache)
        await asyncio.to_thread(worker.runner_host.make_runner, 32, 4, "last_exited")
        gc.collect()
        # a host arena is held a while for late peer reads (retired.py), by that alone
        assert old() is not None and len(worker.kv.retired) == 1
        worker.kv.retired.expire(float("inf"))
        gc.collect()
        assert old() is None
        assert (await worker.kv.source_info()).error  # nothing offered until a batch runs
        await asyncio.to_thread(worker.kv.before_batch, worker.runner, "e2", "last_exited", [])
        assert (await worker.kv.source_info()).epoch == "e2"
    finally:
        await worker.teardown()


class _StuckAgent(KVTransferAgent):
    """Its posts never finish and it confirms no abort until ``confirms`` is set."""

    confirms = False

    def start(self, plan: ReadPlan, index: int) -> PostedChunk:
        return PostedChunk(handle=object(), done=False, arena=plan.arena)

    def finished(self, transfer: PostedChunk) -> bool:
        return False

    def abort(self, transfer: PostedChunk, grace_s: float = 0.0) -> bool:
        return super().abort(transfer, grace_s=0.0)

    def _try_release(self, handle: object) -> bool:
        return self.confirms


def test_an_arena_a_late_write_may_reach_is_freed_only_once_nixl_confirms() -> None:
    """A pull whose abort NIXL did not confirm may still write its landing blocks: their
    arena stays allocated even once a new one replaces it (else the write could land in
    memory the new KV reuses), until a later release of the chunk is confirmed; then it
    is freed (a GPU worker can rebuild its KV again)."""
    import gc
    import weakref

    pair = Pair(agent=_StuckAgent)
    try:
        old = weakref.ref(pair.dst.k)
        pair.submit([1, 2], [3, 4], timeout_s=0.2)
        (outcome,) = pair.wait(1)
        assert outcome.error is not None and outcome.error.cause == kvt.TIMEOUT
        assert outcome.abort_unconfirmed
        fresh = KVArena(torch.zeros(SHAPE), torch.zeros(SHAPE))
        layout = fresh.layout("last_exited", 4)
        pair.queue.call(lambda a: a.register(fresh, "e2", layout), resets=True).result(10)
        pair.dst = fresh
        del outcome
        pair.outcomes.clear()
        gc.collect()
        assert old() is not None
        agent = pair.queue._agent
        assert agent is not None and agent.num_unconfirmed >= 1  # each chunk in flight
        type(agent).confirms = True  # NIXL now confirms the abort: nothing can write it
        deadline = time.monotonic() + 5
        while agent.num_unconfirmed and time.monotonic() < deadline:
            time.sleep(0.02)
        gc.collect()
        assert agent.num_unconfirmed == 0 and old() is None
    finally:
        _StuckAgent.confirms = False
        pair.close()
