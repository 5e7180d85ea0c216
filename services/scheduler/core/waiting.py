"""Admission of waiting requests: the KV policy (``--kv-admission``), parking on a prefix a
running prefill is still writing, and claiming a cached prefix.

The waiting heap itself is ``SchedulerState.waiting`` (new requests and preempted ones are
pushed there); this module decides who leaves it, in queue order, and counts what is due.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from messages.prefix import cacheable_prefix_blocks
from services.common.config import KVAdmission
from services.scheduler.core.kv.inflight_prefix import (
    ParkedReaders,
    QueueEntry,
    add_writer,
    prefix_writers,
)
from services.scheduler.core.kv.kv_admission import Commitment, admits
from services.scheduler.core.kv.reservation import reserved_start, steps_left
from services.scheduler.core.request import Request, RequestState
from services.scheduler.core.running import (
    committed,
    footprint,
    insert_running,
    preempt,
    unallocated,
)
from services.scheduler.core.state import SchedulerState

# How many requests refused for KV admission sets aside in one scan, looking for one behind
# them that fits: each costs a heap pop and push (and a KV test) per step while KV is short
_BYPASS_SCAN_LIMIT = 32


@dataclass
class _Scan:
    """One admission scan: the requests it set aside and what it learnt about KV."""

    refused: list[QueueEntry] = field(default_factory=list)  # in queue order
    exact: Commitment | None = None  # the running requests' exact sum, once KV is tight
    # the first refused head's reserved start (reservation.py), once estimated
    reserved: int | None = None
    reserved_known: bool = False
    # footprints refused so far, none covering another (without prefix caching)
    refused_needs: list[Commitment] = field(default_factory=list)


def _at_least(a: Commitment, b: Commitment) -> bool:
    return a.prompt >= b.prompt and a.decode >= b.decode


class Admission:
    """Moves waiting requests into the running set, in queue order, while seats and the KV
    policy allow; holds the readers parked on an in-flight prefix.

    When the head of the queue does not fit the KV policy, requests behind it of the same
    priority that fit as they are (no preemption for them) may start ahead of it, in two
    ways, unless ``max_admission_bypasses`` (N) is 0, which is strict queue order:

    - Backfill: the request is estimated to finish before the head could start anyway, at
      its reservation (``reservation.py``: when enough running requests will have finished).
      It takes KV the head cannot use yet and gives it back in time, so it is not counted.
    - Counted pass: any other request that fits, at most N per head in its current wait.
      It may hold KV the head will need. After N the head is protected: only backfills
      still pass it.

    The counts are kept here per waiting request, bumped only while it is the head, and
    dropped when it starts (a preempted request waits afresh) or ends. Requests refused
    behind a refused head are passed too, uncounted: they wait for that head anyway, and
    each head ahead of them lets at most N counted passes by. Backfills have no count: a
    head waits for them only as far as the step estimates err, and a backfill must be
    estimated to end before the running requests the head waits for. A head that
    preempted others and still does not fit is sealed: nothing passes it, so what its
    victims freed waits for it. A less urgent request never passes a refused one: it would
    take the KV the other needs (which would preempt it back out at admission)."""

    def __init__(self, state: SchedulerState) -> None:
        self._state = state
        config = state.config
        self._share_inflight = config.enable_prefix_caching and config.share_inflight_prefill
        self._parked = ParkedReaders()
        # heads refused for KV: how often a later request started ahead of one in its wait
        # (backfills not counted), and those sealed (they preempted others and still wait)
        self._passed: dict[Request, int] = {}
        self._sealed: set[Request] = set()
        self._chunk_size = config.prefill_chunk_size

    def admit_waiting(self) -> None:
        """Admits waiting requests in queue order while seats and KV allow. With in-flight
        sharing, a request whose next uncached prompt block a running prefill of the same or
        higher priority is writing is parked on it (``inflight_prefix.py``) and queued again
        once the writer published it or stopped; requests behind it may be admitted
        meanwhile (and take seats and KV). Once back, it is the head like any other. A head
        the KV policy refuses may be passed (class docstring)."""
        state = self._state
        waiting = state.waiting
        if self._parked:
            for entry in self._parked.ready():
                heapq.heappush(waiting, entry)
        scan = _Scan()
        try:
            self._admit_in_order(scan)
        finally:
            for entry in scan.refused:
                heapq.heappush(waiting, entry)

    def _admit_in_order(self, scan: _Scan) -> None:
        """The admission loop; requests that must wait for a refused head but do not stop
        the scan are moved from the heap to ``scan.refused`` (the caller puts them back)."""
        state = self._state
        config, waiting = state.config, state.waiting
        by_kv = config.kv_admission is not KVAdmission.INCREMENTAL
        refused = scan.refused
        writers: dict[int, Request] | None = None  # built when a request first needs it
        while waiting and len(state.running) < config.max_num_seqs:
            _, request = waiting[0]
            if request.is_finished:
                heapq.heappop(waiting)
                self._forget(request)
                continue  # aborted while waiting
            if refused and request.params.priority != refused[0][1].params.priority:
                return  # a less urgent request never passes a refused one
            if self._share_inflight and request.block_hashes:
                if writers is None:
                    writers = prefix_writers(state.running)
                if self._park_if_in_flight(request, writers):
                    continue
            made_room = False
            if by_kv and not self._fits(request, scan):
                # only the head may preempt: a request passing it must fit as it is
                room = False if refused else self._make_room_by_priority(request)
                if room is None:
                    # it preempted, yet does not fit: what its victims freed waits for it
                    # rather than going to any request behind it
                    self._sealed.add(request)
                    return
                if not room:
                    if not self._set_aside(scan):
                        return  # strict order, or sealed: nothing behind it starts for KV
                    continue
                made_room = True
            elif refused and not self._may_pass(request, scan):
                if not self._set_aside(scan):
                    return  # it fits, but waits for the refused head like the rest
                continue
            heapq.heappop(waiting)
            self._start(request)
            if scan.exact is not None:
                scan.exact += unallocated(state.kv, request)
            if writers is not None:
                add_writer(request, writers)
            if made_room:
                return  # the requests it preempted do not come straight back in this batch

    def _set_aside(self, scan: _Scan) -> bool:
        """Moves the request at the top of the heap, which must wait for the first refused
        one (or is it), to ``scan.refused`` so the scan may look behind it; False, leaving it
        on the heap, when nothing may pass the first refused one or the scan is long enough."""
        head = scan.refused[0][1] if scan.refused else self._state.waiting[0][1]
        if self._state.config.max_admission_bypasses == 0 or head in self._sealed:
            return False
        if len(scan.refused) >= _BYPASS_SCAN_LIMIT:
            return False
        scan.refused.append(heapq.heappop(self._state.waiting))
        return True

    def _may_pass(self, request: Request, scan: _Scan) -> bool:
        """Whether ``request``, which fits, may start ahead of the refused head: as a
        backfill if it is estimated to finish before the head could start anyway, else as
        one of the head's N counted passes."""
        head = scan.refused[0][1]
        stats = self._state.stats
        reserved = self._reservation(head, scan)
        if reserved is not None and steps_left(request, self._chunk_size) < reserved:
            stats.num_admission_backfills += 1
            return True
        passes = self._passed.get(head, 0)
        if passes >= self._state.config.max_admission_bypasses:
            return False  # protected
        self._passed[head] = passes + 1
        stats.num_admission_bypasses += 1
        scan.reserved_known = False  # the pass takes KV the head may need: ask again
        return True

    def _reservation(self, head: Request, scan: _Scan) -> int | None:
        """The head's reserved start in steps (``reservation.py``), once per scan and pass."""
        if not scan.reserved_known:
            state = self._state
            kv = state.kv
            # the exact sum this scan keeps once KV is tight (it is, the head was refused)
            commitment = scan.exact if scan.exact is not None else committed(state)
            test = self._kv_test(head)
            scan.reserved = reserved_start(
                state.running,
                self._chunk_size,
                release=lambda r: (kv.num_held_blocks(r.request_id), unallocated(kv, r)),
                fits=lambda freed, released: test(commitment - released, freed),
            )
            scan.reserved_known = True
        return scan.reserved

    def _forget(self, request: Request) -> None:
        """Its wait is over (it started or ended): a later wait starts afresh."""
        self._passed.pop(request, None)
        self._sealed.discard(request)

    def _fits(self, request: Request, scan: _Scan) -> bool:
        """The KV policy's verdict: against the running requests' whole footprints first
        (enough while KV is loose), then against the exact sum, taken once per scan. Without
        prefix caching a waiting request needs its footprint, and KV only tightens as
        requests start, so one no smaller than a refused one is refused unchecked."""
        state = self._state
        if scan.exact is None:
            if self._kv_admits(request, state.running_footprints):
                return True
            scan.exact = committed(state)
        if state.config.enable_prefix_caching:
            return self._kv_admits(request, scan.exact)
        need = footprint(state.kv, request)
        if any(_at_least(need, r) for r in scan.refused_needs):
            return False
        if self._kv_admits(request, scan.exact):
            return True
        scan.refused_needs = [r for r in scan.refused_needs if not _at_least(r, need)] + [need]
        return False

    def _start(self, request: Request) -> None:
        """Moves a request just taken off the queue into the running set."""
        state = self._state
        config = state.config
        self._forget(request)
        request.reset_prefill(origin=self._claim_cached_prefix(request))
        state.running_footprints += footprint(state.kv, request)
        if config.kv_admission is KVAdmission.RESERVE:
            state.stats.num_reserved_blocks += state.kv.blocks_for(request.kv_footprint_tokens)
        request.state = (
            RequestState.PREFILLING_PRELUDE if config.split_prefill else RequestState.PREFILL
        )
        insert_running(state, request)
        state.pending_new.append(request)

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
        return self._kv_test(request)(commitment, extra_free)

    def _kv_test(self, request: Request) -> Callable[[Commitment, int], bool]:
        """``_kv_admits`` for one request against many commitments, its prefix hit looked
        up once."""
        state = self._state
        config, kv = state.config, state.kv
        claimed = parked = 0
        if config.enable_prefix_caching:
            claimed, parked = kv.claimable_prefix(
                self._whole_windows(request, self._claimable_hashes(request)),
                before_batch_seq=state.next_seq,
            )
        planes = kv.num_planes
        free = kv.num_free_blocks - parked * planes
        candidate = unallocated(kv, request, claimed=claimed * planes)

        def test(commitment: Commitment, extra_free: int) -> bool:
            return admits(
                config.kv_admission,
                config.kv_watermark,
                free_blocks=free + extra_free,
                committed=commitment,
                candidate=candidate,
            )

        return test

    def _make_room_by_priority(self, request: Request) -> bool | None:
        """A waiting request of strictly higher priority may preempt running ones, lowest
        first and none with work in flight, as it would once admitted under incremental
        admission. Equal priorities never do: that is the thrash reserve/watermark avoid.
        True: it fits now; False: nobody was preempted; None: some were, and it still does
        not fit (blocks the victims share through the prefix cache free once, not per
        victim, so the estimate below can be short)."""
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
        return None

    def _usable_hashes(self, request: Request) -> list[int]:
        """The prompt blocks a cache hit could cover (never the last prompt token)."""
        usable = cacheable_prefix_blocks(request.num_prompt_tokens, self._state.config.block_size)
        return request.block_hashes[:usable]

    def _claimable_hashes(self, request: Request) -> list[int]:
        """Those the request may claim: none while it waits for its prompt logprobs, which
        need every position computed."""
        return [] if request.prompt_logprobs is not None else self._usable_hashes(request)

    def _whole_windows(self, request: Request, hashes: list[int]) -> list[int]:
        """Under token-sparse prefill a hit must end at a window boundary (a window's active
        tokens are chosen from all of it): ``hashes`` cut to the cached run, rounded down to
        a position that ends both a block and a window. Unchanged for a dense request."""
        sparse = request.sparse
        if sparse is None or not hashes:
            return hashes
        state = self._state
        hits = state.kv.lookup_prefix(hashes, before_batch_seq=state.next_seq)
        return hashes[: sparse.whole_window_blocks(hits, state.config.block_size)]

    def _claim_cached_prefix(self, request: Request) -> int:
        """Attaches the longest cached prefix (never the last prompt token) and returns the
        prefill origin it gives. The scheduler's own table is the authority on hits."""
        state = self._state
        if not state.config.enable_prefix_caching:
            return 0
        hits = state.kv.claim_prefix(
            request.request_id,
            self._whole_windows(request, self._claimable_hashes(request)),
            before_batch_seq=state.next_seq,
        )
        request.num_published_blocks = hits
        request.num_cached_tokens = hits * state.config.block_size
        return request.num_cached_tokens
