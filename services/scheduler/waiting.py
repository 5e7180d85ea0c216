"""Admission of waiting requests: the KV policy (``--kv-admission``), parking on a prefix a
running prefill is still writing, and claiming a cached prefix.

The waiting heap itself is ``SchedulerState.waiting`` (new requests and preempted ones are
pushed there); this module decides who leaves it, in queue order, and counts what is due.
"""

from __future__ import annotations

import heapq
import itertools

from messages.batch import Phase
from messages.prefix import cacheable_prefix_blocks
from services.common.config import KVAdmission
from services.scheduler.inflight_prefix import ParkedReaders, add_writer, prefix_writers
from services.scheduler.kv_admission import Commitment, admits
from services.scheduler.request import Request
from services.scheduler.running import (
    committed,
    footprint,
    insert_running,
    preempt,
    unallocated,
)
from services.scheduler.state import SchedulerState


class Admission:
    """Moves waiting requests into the running set, in queue order, while seats and the KV
    policy allow; holds the readers parked on an in-flight prefix."""

    def __init__(self, state: SchedulerState) -> None:
        self._state = state
        config = state.config
        self._share_inflight = config.enable_prefix_caching and config.share_inflight_prefill
        self._parked = ParkedReaders()

    def admit_waiting(self) -> None:
        """Admits waiting requests in queue order while seats and KV allow. With in-flight
        sharing, a request whose next uncached prompt block a running prefill of the same or
        higher priority is writing is parked on it (``inflight_prefix.py``) and queued again
        once the writer published it or stopped; requests behind it may be admitted
        meanwhile (and take seats and KV). Once back, it is the head like any other."""
        state = self._state
        config, waiting = state.config, state.waiting
        if self._parked:
            for entry in self._parked.ready():
                heapq.heappush(waiting, entry)
        by_kv = config.kv_admission is not KVAdmission.INCREMENTAL
        exact: Commitment | None = None  # the exact sum, once KV is tight
        writers: dict[int, Request] | None = None  # built when a request first needs it
        while waiting and len(state.running) < config.max_num_seqs:
            _, request = waiting[0]
            if request.is_finished:
                heapq.heappop(waiting)
                continue  # aborted while waiting
            if self._share_inflight and request.block_hashes:
                if writers is None:
                    writers = prefix_writers(state.running)
                if self._park_if_in_flight(request, writers):
                    continue
            made_room = False
            if by_kv and not self._kv_admits(request, state.running_footprints):
                exact = committed(state) if exact is None else exact
                if not self._kv_admits(request, exact):
                    if not self._make_room_by_priority(request):
                        return  # in queue order: a later, smaller request never jumps the head
                    made_room = True
            heapq.heappop(waiting)
            request.reset_prefill(origin=self._claim_cached_prefix(request))
            state.running_footprints += footprint(state.kv, request)
            if exact is not None:
                exact += unallocated(state.kv, request)
            if config.kv_admission is KVAdmission.RESERVE:
                state.stats.num_reserved_blocks += state.kv.blocks_for(request.kv_footprint_tokens)
            request.phase = Phase.PREFILLING_PRELUDE if config.split_prefill else Phase.PREFILL
            insert_running(state, request)
            state.pending_new.append(request)
            if writers is not None:
                add_writer(request, writers)
            if made_room:
                return  # the requests it preempted do not come straight back in this batch

    def num_waiting(self) -> int:
        waiting = sum(1 for _, r in self._state.waiting if not r.is_finished)
        return waiting + sum(1 for r in self._parked if not r.is_finished)

    def num_prefill_tokens_due(self) -> int:
        """Prompt tokens the waiting requests will compute (the load a router weighs): with
        in-flight sharing a block is computed once, by a running prefill or by the first
        waiting request that needs it; everyone else claims it."""
        state = self._state
        bs = state.config.block_size
        in_flight: set[int] = set(prefix_writers(state.running)) if self._share_inflight else set()
        # a burst's readers walk the same run of in-flight blocks: the first walk from a
        # block is remembered (its end and the hash there), and a reader whose chain has
        # that hash at that index shares the whole run (chain hashes), so it skips it
        runs: dict[int, tuple[int, int]] = {}
        total = 0
        for request in itertools.chain((r for _, r in state.waiting), self._parked):
            if request.is_finished:
                continue
            usable = self._usable_hashes(request)
            # none if it computes its whole prompt (it still writes them for the others)
            hashes = usable if request.prompt_logprobs is None else []
            covered = start = state.kv.lookup_prefix(hashes)
            if covered < len(hashes) and in_flight:
                end, end_hash = runs.get(hashes[covered], (covered, 0))
                if end > covered and end <= len(hashes) and hashes[end - 1] == end_hash:
                    covered = end
                while covered < len(hashes) and hashes[covered] in in_flight:
                    covered += 1
                if covered > start:
                    runs[hashes[start]] = (covered, hashes[covered - 1])
            total += request.num_prompt_tokens - covered * bs
            if self._share_inflight:
                in_flight.update(usable[covered:])
        return total

    def _park_if_in_flight(self, request: Request, writers: dict[int, Request]) -> bool:
        """Parks the head of the queue if the first prompt block it cannot claim now is being
        written by a running prefill no less urgent than it (chain hashes: the same hash is
        the same prefix at the same index). A less urgent writer is not waited for: its
        rows are selected after everything of higher priority."""
        state = self._state
        hashes = self._claimable_hashes(request)
        hits = state.kv.lookup_prefix(hashes, before_batch_seq=state.next_seq)
        if hits == len(hashes):
            return False
        writer = writers.get(hashes[hits])
        if writer is None or writer.params.priority > request.params.priority:
            return False
        self._parked.park(heapq.heappop(state.waiting), hashes[hits], hits, writer)
        state.stats.num_prefix_deferrals += 1
        return True

    def _kv_admits(self, request: Request, commitment: Commitment, extra_free: int = 0) -> bool:
        """The reserve / watermark test for the head of the queue (nothing is claimed);
        ``extra_free``: blocks assumed freed (preemption candidates)."""
        state = self._state
        config, kv = state.config, state.kv
        claimed = parked = 0
        if config.enable_prefix_caching:
            claimed, parked = kv.claimable_prefix(
                self._claimable_hashes(request), before_batch_seq=state.next_seq
            )
        planes = kv.num_planes
        return admits(
            config.kv_admission,
            config.kv_watermark,
            free_blocks=kv.num_free_blocks + extra_free - parked * planes,
            committed=commitment,
            candidate=unallocated(kv, request, claimed=claimed * planes),
        )

    def _make_room_by_priority(self, request: Request) -> bool:
        """A waiting request of strictly higher priority may preempt running ones, lowest
        first and none with work in flight, as it would once admitted under incremental
        admission. Equal priorities never do: that is the thrash reserve/watermark avoid."""
        state = self._state
        victims = [
            r
            for r in reversed(state.running)
            if r.params.priority > request.params.priority and r.inflight_batches == 0
        ]
        if not victims:
            return False
        held = sum(state.kv.num_held_blocks(r.request_id) for r in victims)
        rest = committed(state) - sum((unallocated(state.kv, r) for r in victims), Commitment())
        if not self._kv_admits(request, rest, extra_free=held):
            return False  # even all of them would not make room: preempt nobody
        for victim in victims:
            preempt(state, victim, for_request_id=request.request_id)
            if self._kv_admits(request, committed(state)):
                return True
        return False

    def _usable_hashes(self, request: Request) -> list[int]:
        """The prompt blocks a cache hit could cover (never the last prompt token)."""
        usable = cacheable_prefix_blocks(request.num_prompt_tokens, self._state.config.block_size)
        return request.block_hashes[:usable]

    def _claimable_hashes(self, request: Request) -> list[int]:
        """Those the request may claim: none while it waits for its prompt logprobs, which
        need every position computed."""
        return [] if request.prompt_logprobs is not None else self._usable_hashes(request)

    def _claim_cached_prefix(self, request: Request) -> int:
        """Attaches the longest cached prefix (never the last prompt token) and returns the
        prefill origin it gives. The scheduler's own table is the authority on hits."""
        state = self._state
        if not state.config.enable_prefix_caching:
            return 0
        hits = state.kv.claim_prefix(
            request.request_id,
            self._claimable_hashes(request),
            before_batch_seq=state.next_seq,
        )
        request.num_published_blocks = hits
        request.num_cached_tokens = hits * state.config.block_size
        return request.num_cached_tokens
