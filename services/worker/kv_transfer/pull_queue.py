"""The transfer thread: a worker's KV pulls, interleaved chunk by chunk, off the event loop.

Every NIXL call of the worker is made here, on one thread (the agent is not thread-safe).
A pull is cut into chunks (``ReadPlan``); the thread keeps up to ``max_in_flight`` chunks
posted and always posts next from the pull with the fewest bytes left, so a chat request's
short pull waits for at most one chunk of a long prompt's, not all of it. (Over UCX's
shared-memory copy a post moves its chunk before it returns, so pulls interleave rather
than overlap; over TCP or RDMA several chunks are in flight at once.)

Each pull has a deadline from the moment it is submitted: past it, its posted chunks are
aborted and it fails with ``timeout``, whatever it was waiting for (its source's
description, its turn, NIXL). A pull reports once (``on_done``, called on this thread):
moved, or failed with a cause. A failed pull's landing blocks are written by nothing once
it is reported, unless NIXL could not confirm an abort (``PullOutcome.abort_unconfirmed``).

Calls other than pulls (register the arena, describe it to a peer) queue in order with the
pulls. Registering a new arena ends every pull submitted before it (``local_reset``): they
landed in the previous runner's KV, which a new epoch has replaced.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from messages.kv_transfer import KVPull, KVSourceInfo
from services.worker.kv_transfer import agent as kvt
from services.worker.kv_transfer.agent import (
    KVArena,
    KVTransferAgent,
    ReadPlan,
    Transfer,
    TransferError,
)

MAX_IN_FLIGHT = 4  # chunks posted and not done, over all pulls
_IDLE_POLL_S = 0.002  # while pulls wait for a source or a test hold
_MAX_PAUSE_S = 0.005  # between polls of chunks in flight


@dataclass
class PullJob:
    """One pull handed to the thread. ``source`` resolves (on the event loop) to the source
    worker's description, or fails with a TransferError."""

    epoch: str
    pull: KVPull
    source: concurrent.futures.Future[KVSourceInfo]
    submitted: float = field(default_factory=time.monotonic)

    @property
    def deadline(self) -> float:
        return self.submitted + self.pull.timeout_s


@dataclass
class PullOutcome:
    job: PullJob
    error: TransferError | None
    num_bytes: int
    seconds: float  # submitted -> reported: what the request waited
    copy_s: float  # its own chunks, posted -> done (bytes / copy_s: the link's rate)
    abort_unconfirmed: bool = False  # its landing blocks may still be written


@dataclass
class _Active:
    job: PullJob
    order: int
    plan: ReadPlan | None = None
    next_chunk: int = 0
    in_flight: list[tuple[Transfer, int, float]] = field(default_factory=list)
    moved: int = 0
    copy_s: float = 0.0
    not_before: float = 0.0  # test hold: no chunk is posted before this

    @property
    def bytes_left(self) -> int:
        assert self.plan is not None
        return sum(self.plan.chunk_bytes[self.next_chunk :])

    @property
    def all_posted(self) -> bool:
        return self.plan is not None and self.next_chunk >= len(self.plan.chunks)


@dataclass
class _Call:
    fn: Callable[[KVTransferAgent], Any]
    future: concurrent.futures.Future[Any]
    resets: bool  # a new arena: pulls submitted before it end first


_STOP = object()


class PullQueue:
    def __init__(
        self,
        make_agent: Callable[[], KVTransferAgent],
        on_done: Callable[[PullOutcome], None],
        *,
        chunk_bytes: int = kvt.DEFAULT_CHUNK_BYTES,
        max_in_flight: int = MAX_IN_FLIGHT,
        hold_s: float = 0.0,
    ) -> None:
        """``on_done`` runs on the transfer thread; ``hold_s`` (tests only) moves each pull
        one chunk at a time and keeps it waiting that long after each, so a fault can
        strike mid-pull."""
        self._make_agent = make_agent
        self._on_done = on_done
        self.chunk_bytes = chunk_bytes
        self.max_in_flight = max(1, max_in_flight)
        self.hold_s = hold_s
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._active: list[_Active] = []
        self._order = itertools.count()
        self._agent: KVTransferAgent | None = None
        # arenas a pull whose abort NIXL did not confirm may still write: never freed (a
        # late write must not land in memory a new arena reuses); rare, and one entry each
        self._unsafe_arenas: list[KVArena] = []
        self._ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, name="rlt-kv", daemon=True)
        # read by health from other threads (plain ints: a moment stale at worst)
        self.num_active = 0
        self.num_started = 0  # of the active: those with a chunk landed

    def start(self) -> concurrent.futures.Future[None]:
        """Starts the thread; the future resolves once its NIXL agent exists (or fails)."""
        self._thread.start()
        return self._ready

    def call(
        self, fn: Callable[[KVTransferAgent], Any], *, resets: bool = False
    ) -> concurrent.futures.Future[Any]:
        """``fn(agent)`` on the thread, after everything submitted before it."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._inbox.put(_Call(fn, future, resets))
        return future

    def submit(self, job: PullJob) -> None:
        self._inbox.put(job)

    def close(self, timeout: float = 5.0) -> None:
        """Aborts what is in flight and stops the thread (blocking)."""
        if self._thread.is_alive():
            self._inbox.put(_STOP)
            self._thread.join(timeout)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        try:
            self._agent = self._make_agent()
        except BaseException as exc:
            self._ready.set_exception(exc)
            return
        self._ready.set_result(None)
        while True:
            if not self._take_inbox():
                break
            try:
                self._step(time.monotonic())
            except Exception as exc:  # a bug here must not strand pulls: they all fail
                for active in list(self._active):
                    self._fail(active, TransferError(kvt.ERROR, repr(exc)[:300]))
        for active in list(self._active):
            self._fail(active, TransferError(kvt.ERROR, "the worker is stopping"))
        self._agent.deregister()

    def _take_inbox(self) -> bool:
        """Takes what was submitted (waiting for it when there is nothing else to do);
        False once told to stop."""
        block, timeout = self._wait()
        while True:
            try:
                item = self._inbox.get(block=block, timeout=timeout)
            except queue.Empty:
                return True
            block = False
            if item is _STOP:
                return False
            if isinstance(item, PullJob):
                self._active.append(_Active(item, next(self._order)))
                self.num_active = len(self._active)
            else:
                self._run_call(item)

    def _wait(self) -> tuple[bool, float | None]:
        """How long the inbox may be waited on: forever when idle, a moment while pulls
        wait for something, not at all while one can post."""
        if not self._active:
            return True, None
        now = time.monotonic()
        runnable = any(
            a.in_flight or (a.plan is None and a.job.source.done()) or self._may_post(a, now)
            for a in self._active
        )
        if runnable:
            return False, None
        return True, _IDLE_POLL_S

    def _run_call(self, call: _Call) -> None:
        assert self._agent is not None
        if call.resets:
            for active in list(self._active):
                why = "this worker's KV was rebuilt (a new epoch) before the pull landed"
                self._fail(active, TransferError(kvt.LOCAL_RESET, why))
        try:
            call.future.set_result(call.fn(self._agent))
        except BaseException as exc:
            call.future.set_exception(exc)

    def _step(self, now: float) -> None:
        for active in list(self._active):
            if now > active.job.deadline:
                timeout = active.job.pull.timeout_s
                self._fail(active, TransferError(kvt.TIMEOUT, f"not done after {timeout:g} s"))
            elif active.plan is None:
                self._plan(active)
        progressed = self._poll()
        progressed |= self._post(now)
        if not progressed and any(a.in_flight for a in self._active):
            time.sleep(_MAX_PAUSE_S)

    def _plan(self, active: _Active) -> None:
        """Once its source is described: checks and descriptors (or its failure)."""
        assert self._agent is not None
        source = active.job.source
        if not source.done():
            return
        pull = active.job.pull
        try:
            info = source.result()
            active.plan = self._agent.plan(
                info, pull.remote_blocks, pull.local_blocks, self.chunk_bytes
            )
        except TransferError as exc:
            self._fail(active, exc)
        except Exception as exc:
            self._fail(active, TransferError(kvt.ERROR, repr(exc)[:300]))
        else:
            if not active.plan.chunks:  # nothing to move (a prefix hit covered it all)
                self._report(active, None)

    def _poll(self) -> bool:
        """Chunks in flight that finished (or failed)."""
        assert self._agent is not None
        progressed = False
        for active in list(self._active):
            for entry in list(active.in_flight):
                transfer, index, started = entry
                try:
                    if not self._agent.finished(transfer):
                        continue
                except TransferError as exc:
                    active.in_flight.remove(entry)
                    self._fail(active, exc)
                    break
                active.in_flight.remove(entry)
                self._landed(active, index, started)
                progressed = True
                if active not in self._active:
                    break  # reported: its last chunk
        return progressed

    def _post(self, now: float) -> bool:
        """Posts chunks while fewer than ``max_in_flight`` are out: each from the pull with
        the fewest bytes left (the oldest among equals). Back to the inbox after a chunk
        that the post itself moved (a shared-memory copy): a pull submitted meanwhile is
        weighed before the next chunk."""
        assert self._agent is not None
        posted = False
        while sum(len(a.in_flight) for a in self._active) < self.max_in_flight:
            ready = [a for a in self._active if self._may_post(a, now)]
            if not ready:
                break
            active = min(ready, key=lambda a: (a.bytes_left, a.order))
            assert active.plan is not None
            index = active.next_chunk
            started = time.monotonic()
            try:
                transfer = self._agent.start(active.plan, index)
            except TransferError as exc:
                self._fail(active, exc)
                continue
            active.next_chunk += 1
            posted = True
            if transfer.done:
                self._landed(active, index, started)
                break
            active.in_flight.append((transfer, index, started))
        return posted

    def _may_post(self, active: _Active, now: float) -> bool:
        if active.plan is None or active.all_posted or active.not_before > now:
            return False
        return not (self.hold_s > 0 and active.in_flight)  # held: one chunk at a time

    def _landed(self, active: _Active, index: int, started: float) -> None:
        """A chunk is done; the pull is reported at once if it was its last."""
        assert active.plan is not None
        if active.moved == 0:
            self.num_started += 1
        active.moved += active.plan.chunk_bytes[index]
        active.copy_s += time.monotonic() - started
        if active.all_posted and not active.in_flight:
            self._report(active, None)
        elif self.hold_s > 0:
            active.not_before = time.monotonic() + self.hold_s

    def _fail(self, active: _Active, error: TransferError) -> None:
        """Aborts its chunks in flight, then reports it."""
        assert self._agent is not None
        confirmed = True
        for transfer, _, _ in active.in_flight:
            confirmed &= self._agent.abort(transfer)
        active.in_flight.clear()
        if not confirmed and active.plan is not None:
            arena = active.plan.arena
            if all(kept is not arena for kept in self._unsafe_arenas):
                self._unsafe_arenas.append(arena)
        if error.cause == kvt.SOURCE_LOST and active.plan is not None:
            self._agent.forget(active.plan.agent_name)
        self._report(active, error, abort_unconfirmed=not confirmed)

    def _report(
        self, active: _Active, error: TransferError | None, *, abort_unconfirmed: bool = False
    ) -> None:
        if active not in self._active:
            return
        self._active.remove(active)
        if active.moved:
            self.num_started -= 1
        job = active.job
        outcome = PullOutcome(
            job,
            error,
            active.moved if error is None else 0,
            time.monotonic() - job.submitted,
            active.copy_s,
            abort_unconfirmed,
        )
        self.num_active = len(self._active)
        self._on_done(outcome)
