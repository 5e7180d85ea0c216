"""The scheduler core: admission, depth-major selection, and one shared progress path.

Pure Python, no NATS and no torch. One ``schedule()`` returns one batch (one phase; a
RECURRENT batch holds decode rows first, then split-prefill recurrent rows). Progress is
applied by ``update_after_submission`` (async scheduling) or ``update_from_output`` (sync);
both go through ``_apply_prefill_phase_progress`` so they cannot diverge.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from messages.api import (
    ErrorEvent,
    FinishedEvent,
    StreamEvent,
    TokenEvent,
    TokenLogprobs,
    TopLogprob,
)
from messages.batch import (
    Batch,
    BatchResult,
    BatchRow,
    NewRequest,
    Phase,
    PromptLogprobs,
    RowKind,
    RowResult,
    WorkerSampling,
)
from messages.errors import ErrorCode, RequestError
from messages.prefix import (
    AllBlocksCleared,
    PrefixEventBatch,
    cacheable_prefix_blocks,
    prompt_block_hashes,
)
from messages.sampling import SamplingParams
from services.common.config import KVAdmission, ModelLimits, SchedulerConfig
from services.common.fit import check_request_fits
from services.scheduler.batch import ScheduledBatch, ScheduledTask
from services.scheduler.inflight_prefix import ParkedReaders, add_writer, prefix_writers
from services.scheduler.kv_admission import Commitment, Preemption, admits
from services.scheduler.kv_manager import KVManager
from services.scheduler.prefix_events import PrefixEventLog
from services.scheduler.request import PREFILL_PHASES, Request

# The per-row loops compare enum members by identity against module globals: on Python 3.11
# an Enum class attribute (RowKind.DECODE) costs ~75 ns a lookup, a module global ~10.
_DECODE, _FOLLOW_ON = RowKind.DECODE, RowKind.FOLLOW_ON
_PREFILL, _PRELUDE = RowKind.PREFILL, RowKind.PRELUDE
_ATOMIC, _RECURRENT = Phase.PREFILL, Phase.RECURRENT
_SPLIT_PRELUDE, _SPLIT_RECURRENT = Phase.PREFILLING_PRELUDE, Phase.PREFILLING_RECURRENT
_SPLIT_PREFILLING = (_SPLIT_PRELUDE, _SPLIT_RECURRENT)
_DECODE_KINDS = (_DECODE, _FOLLOW_ON)  # rows of the token being generated
_FINISHED = Phase.FINISHED


def _priority_key(request: Request) -> tuple[int, int]:
    return request.priority_key


class SchedulerInvariantError(RuntimeError):
    """A progress update broke a frontier rule; this is a bug, never bad client input."""


@dataclass
class _Selection:
    """State of one batch while it is being selected."""

    budget_left: int
    max_seqs: int
    selected: dict[str, Request] = field(default_factory=dict)
    tasks: list[ScheduledTask] = field(default_factory=list)


@dataclass
class SchedulerStats:
    num_batches: int = 0
    num_preemptions: int = 0
    num_decode_rows: int = 0
    num_batches_with_mixed_depths: int = 0
    # what preemption wastes: prompt positions prefilled again (counted at depth 0), the
    # same in core work (token x loop, the unit of a core pass's rows), and decode loops
    # replayed to rebuild dropped generated tokens
    num_recomputed_prompt_tokens: int = 0
    num_recomputed_prompt_token_loops: int = 0
    num_recomputed_decode_loops: int = 0
    # what reserve admission wastes: blocks reserved (whole footprints) and, of those, the
    # ones never written because the request stopped early (EOS, stop ids, abort)
    num_reserved_blocks: int = 0
    num_reserved_unused_blocks: int = 0
    # waiting requests parked on a prompt block a running prefill was writing
    # (share_inflight_prefill), once per block waited for
    num_prefix_deferrals: int = 0


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        limits: ModelLimits,
        seed: int = 0,
        producer_id: str = "scheduler-0",
        cache_salt: bytes = b"",
    ) -> None:
        self.config = config
        self.limits = limits
        self.total_depths = limits.total_ut_steps
        self.kv = KVManager(
            config.num_blocks,
            config.block_size,
            config.num_planes(limits.total_ut_steps),
            enable_prefix_caching=config.enable_prefix_caching,
        )
        # prefix events leave in envelopes with a per-producer event_seq and a fresh epoch
        self.prefix_log = PrefixEventLog(producer_id)
        self.cache_salt = cache_salt
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []  # kept in queue order (priority, arrival)
        self._waiting: list[tuple[tuple[int, int], Request]] = []
        self._arrivals = 0
        self._next_seq = 0
        self._last_phase: Phase | None = None
        self._pending_new: list[Request] = []
        self._pending_finished: list[str] = []
        self._pending_preemptions: list[Preemption] = []
        # the running requests' whole footprints: a bound on what they will still allocate
        # that admission checks first, so the exact sum is only taken when KV is tight
        self._running_footprints = Commitment()
        self._rng = random.Random(seed)
        self.stats = SchedulerStats()
        # async refill: a request whose decode row is in flight sends its next loop as a
        # follow-on row instead of sitting out a batch (cohort batching holds rows anyway)
        self._follow_ons = config.async_scheduling and config.refill
        self._share_inflight = config.enable_prefix_caching and config.share_inflight_prefill
        self._parked = ParkedReaders()

    # ------------------------------------------------------------------ requests in/out
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        trace_id: str = "",
        known_outputs: tuple[list[int], list[int]] | None = None,
    ) -> Request:
        """Validates and queues a request; raises RequestError and changes nothing on failure.

        ``known_outputs`` (token ids, exit loops) resumes a request another shard started:
        it is queued as a preempted request is, so its prompt is prefilled and the known
        tokens are replayed with their recorded exits (never streamed again)."""
        if not isinstance(request_id, str) or not request_id:
            raise RequestError("request_id must be a non-empty string")
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already live")
        self._validate_prompt(prompt_token_ids)
        resolved = self.limits.resolve(params)
        check_request_fits(
            len(prompt_token_ids),
            resolved.max_tokens,
            self.limits.max_position_embeddings,
            self.kv.geometry,
        )
        known_ids, known_loops = known_outputs or ([], [])
        self._validate_known_outputs(known_ids, known_loops, resolved)
        seed = resolved.seed if resolved.seed is not None else self._rng.getrandbits(63)
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=resolved,
            seed=seed,
            arrival_seq=self._arrivals,
            total_depths=self.total_depths,
            trace_id=trace_id,
            output_token_ids=list(known_ids),
            output_exit_depths=list(known_loops),
        )
        if self.config.enable_prefix_caching:
            request.block_hashes = prompt_block_hashes(
                request.prompt_token_ids, self.config.block_size, self.cache_salt
            )
        if resolved.prompt_logprobs is not None and not known_ids:
            request.prompt_logprobs = [None] * request.num_prompt_tokens
        self._arrivals += 1
        self.requests[request_id] = request
        heapq.heappush(self._waiting, (request.priority_key, request))
        return request

    def _validate_known_outputs(
        self, token_ids: list[int], exit_loops: list[int], params: SamplingParams
    ) -> None:
        if len(token_ids) != len(exit_loops):
            raise RequestError(
                f"resumed outputs: {len(token_ids)} token ids but {len(exit_loops)} exit depths"
            )
        if token_ids and params.max_tokens is not None and len(token_ids) > params.max_tokens:
            raise RequestError(
                f"resumed outputs: {len(token_ids)} tokens exceed max_tokens {params.max_tokens}"
            )
        vocab, depths = self.limits.vocab_size, self.total_depths
        for tok, loops in zip(token_ids, exit_loops, strict=True):
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab:
                raise RequestError(f"resumed token id {tok!r} is outside the vocabulary")
            if isinstance(loops, bool) or not isinstance(loops, int) or not 1 <= loops <= depths:
                raise RequestError(f"resumed exit depth {loops!r} is outside [1, {depths}]")

    def finish_if_complete(self, request_id: str) -> list[StreamEvent]:
        """A resumed request whose known outputs already end it (its last token was a stop,
        or it has max_tokens of them) finishes at once, without running anything."""
        request = self.requests.get(request_id)
        if request is None or not request.output_token_ids:
            return []
        params, last = request.params, request.output_token_ids[-1]
        reason = None
        if last in params.stop_token_ids or (
            not params.ignore_eos and last in self.limits.eos_token_ids
        ):
            reason = "stop"
        elif len(request.output_token_ids) >= params.max_tokens:
            reason = "length"
        if reason is None:
            return []
        events: list[StreamEvent] = []
        self._finish(request, reason, events)
        return events

    def _validate_prompt(self, prompt_token_ids: list[int]) -> None:
        if not isinstance(prompt_token_ids, list) or not prompt_token_ids:
            raise RequestError("prompt must contain at least one token")
        vocab = self.limits.vocab_size
        for tok in prompt_token_ids:
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab:
                raise RequestError(
                    f"prompt token id {tok!r} is outside the vocabulary [0, {vocab})"
                )

    def abort_request(self, request_id: str) -> list[StreamEvent]:
        request = self.requests.get(request_id)
        if request is None:
            raise RequestError(f"unknown request id {request_id!r}", ErrorCode.NOT_FOUND)
        events: list[StreamEvent] = []
        self._finish(request, "abort", events)
        return events

    def fail_request(
        self, request_id: str, message: str, code: ErrorCode = ErrorCode.INTERNAL
    ) -> list[StreamEvent]:
        """Ends a live request with an error event (e.g. the worker failed its batch), freeing
        its KV; [] if it already ended."""
        request = self.requests.get(request_id)
        if request is None:
            return []
        events: list[StreamEvent] = []
        self._finish(request, "error", events)
        events[-1] = ErrorEvent(request_id=request_id, code=str(code), message=message)
        return events

    def reset_after_worker_loss(self) -> list[str]:
        """The worker's device state is gone (it died or was replaced). Every running request
        returns to the waiting queue with its outputs kept; on the next worker it is prefilled
        again and its known tokens are replayed with their recorded exit depths, so its KV and
        its further outputs equal an uninterrupted run. Results of batches sent before this
        call are stale (generation bumped) and are ignored if they still arrive.
        Returns the ids of the requests that will be recomputed."""
        affected = [r.request_id for r in self.running]
        for request in list(self.running):
            request.inflight_batches = 0
            self._preempt(request)
        # the new worker starts empty: nothing to free there, and no cached prefix survives
        self._pending_finished = []
        self.kv = KVManager(
            self.config.num_blocks,
            self.config.block_size,
            self.config.num_planes(self.total_depths),
            enable_prefix_caching=self.config.enable_prefix_caching,
        )
        if self.config.enable_prefix_caching:
            self.prefix_log.emit([AllBlocksCleared()])
        return affected

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def num_waiting(self) -> int:
        waiting = sum(1 for _, r in self._waiting if not r.is_finished)
        return waiting + sum(1 for r in self._parked if not r.is_finished)

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> ScheduledBatch | None:
        self._admit_waiting()
        # the requests with prompt work, in queue order (one scan of `running` per step)
        prefilling = [r for r in self.running if r.phase in PREFILL_PHASES]
        for phase in self._phase_preference(prefilling):
            selection = _Selection(self.config.max_num_batched_tokens, self.config.max_num_seqs)
            if phase == Phase.RECURRENT:
                self._take_decode_rows(selection)
            self._take_wavefront_phase(phase, selection, prefilling)
            if selection.tasks:
                return self._build_batch(phase, selection.tasks)
        return None

    def _admit_waiting(self) -> None:
        """Admits waiting requests in queue order while seats and KV allow. With in-flight
        sharing, a request whose next uncached prompt block a running prefill of the same or
        higher priority is writing is parked on it (``inflight_prefix.py``) and queued again
        once the writer published it or stopped; requests behind it may be admitted
        meanwhile (and take seats and KV). Once back, it is the head like any other."""
        if self._parked:
            for entry in self._parked.ready():
                heapq.heappush(self._waiting, entry)
        by_kv = self.config.kv_admission is not KVAdmission.INCREMENTAL
        committed: Commitment | None = None  # the exact sum, once KV is tight
        writers: dict[int, Request] | None = None  # built when a request first needs it
        while self._waiting and len(self.running) < self.config.max_num_seqs:
            _, request = self._waiting[0]
            if request.is_finished:
                heapq.heappop(self._waiting)
                continue  # aborted while waiting
            if self._share_inflight and request.block_hashes:
                if writers is None:
                    writers = prefix_writers(self.running)
                if self._park_if_in_flight(request, writers):
                    continue
            made_room = False
            if by_kv and not self._kv_admits(request, self._running_footprints):
                committed = self._committed() if committed is None else committed
                if not self._kv_admits(request, committed):
                    if not self._make_room_by_priority(request):
                        return  # in queue order: a later, smaller request never jumps the head
                    made_room = True
            heapq.heappop(self._waiting)
            request.reset_prefill(origin=self._claim_cached_prefix(request))
            self._running_footprints += self._footprint(request)
            if committed is not None:
                committed += self._unallocated(request)
            if self.config.kv_admission is KVAdmission.RESERVE:
                self.stats.num_reserved_blocks += self.kv.blocks_for(request.kv_footprint_tokens)
            request.phase = Phase.PREFILLING_PRELUDE if self.config.split_prefill else Phase.PREFILL
            self._insert_running(request)
            self._pending_new.append(request)
            if writers is not None:
                add_writer(request, writers)
            if made_room:
                return  # the requests it preempted do not come straight back in this batch

    def _park_if_in_flight(self, request: Request, writers: dict[int, Request]) -> bool:
        """Parks the head of the queue if the first prompt block it cannot claim now is being
        written by a running prefill no less urgent than it (chain hashes: the same hash is
        the same prefix at the same index). A less urgent writer is not waited for: its
        rows are selected after everything of higher priority."""
        hashes = self._claimable_hashes(request)
        hits = self.kv.lookup_prefix(hashes, before_batch_seq=self._next_seq)
        if hits == len(hashes):
            return False
        writer = writers.get(hashes[hits])
        if writer is None or writer.params.priority > request.params.priority:
            return False
        self._parked.park(heapq.heappop(self._waiting), hashes[hits], hits, writer)
        self.stats.num_prefix_deferrals += 1
        return True

    def num_prefill_tokens_due(self) -> int:
        """Prompt tokens the waiting requests will compute (the load a router weighs): with
        in-flight sharing a block is computed once, by a running prefill or by the first
        waiting request that needs it; everyone else claims it."""
        bs = self.config.block_size
        in_flight: set[int] = set(prefix_writers(self.running)) if self._share_inflight else set()
        # a burst's readers walk the same run of in-flight blocks: the first walk from a
        # block is remembered (its end and the hash there), and a reader whose chain has
        # that hash at that index shares the whole run (chain hashes), so it skips it
        runs: dict[int, tuple[int, int]] = {}
        total = 0
        for request in itertools.chain((r for _, r in self._waiting), self._parked):
            if request.is_finished:
                continue
            usable = self._usable_hashes(request)
            # none if it computes its whole prompt (it still writes them for the others)
            hashes = usable if request.prompt_logprobs is None else []
            covered = start = self.kv.lookup_prefix(hashes)
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

    def _unallocated(self, request: Request, claimed: int = 0) -> Commitment:
        """Blocks of the request's footprint it does not hold yet (nor would get from a
        ``claimed`` prefix hit), split into its prompt's and its decode's."""
        held = self.kv.num_held_blocks(request.request_id) + claimed
        prompt = max(0, self.kv.blocks_for(request.num_prompt_tokens) - held)
        total = max(0, self.kv.blocks_for(request.kv_footprint_tokens) - held)
        return Commitment(prompt=prompt, decode=total - prompt)

    def _footprint(self, request: Request) -> Commitment:
        """The request's whole footprint, split like ``_unallocated`` (its upper bound)."""
        prompt = self.kv.blocks_for(request.num_prompt_tokens)
        return Commitment(
            prompt=prompt, decode=self.kv.blocks_for(request.kv_footprint_tokens) - prompt
        )

    def _committed(self) -> Commitment:
        return sum((self._unallocated(r) for r in self.running), Commitment())

    def _kv_admits(self, request: Request, committed: Commitment, extra_free: int = 0) -> bool:
        """The reserve / watermark test for the head of the queue (nothing is claimed);
        ``extra_free``: blocks assumed freed (preemption candidates)."""
        claimed = parked = 0
        if self.config.enable_prefix_caching:
            claimed, parked = self.kv.claimable_prefix(
                self._claimable_hashes(request), before_batch_seq=self._next_seq
            )
        planes = self.kv.num_planes
        return admits(
            self.config.kv_admission,
            self.config.kv_watermark,
            free_blocks=self.kv.num_free_blocks + extra_free - parked * planes,
            committed=committed,
            candidate=self._unallocated(request, claimed=claimed * planes),
        )

    def _make_room_by_priority(self, request: Request) -> bool:
        """A waiting request of strictly higher priority may preempt running ones, lowest
        first and none with work in flight, as it would once admitted under incremental
        admission. Equal priorities never do: that is the thrash reserve/watermark avoid."""
        victims = [
            r
            for r in reversed(self.running)
            if r.params.priority > request.params.priority and r.inflight_batches == 0
        ]
        if not victims:
            return False
        held = sum(self.kv.num_held_blocks(r.request_id) for r in victims)
        rest = self._committed() - sum((self._unallocated(r) for r in victims), Commitment())
        if not self._kv_admits(request, rest, extra_free=held):
            return False  # even all of them would not make room: preempt nobody
        for victim in victims:
            self._preempt(victim, for_request_id=request.request_id)
            if self._kv_admits(request, self._committed()):
                return True
        return False

    def _usable_hashes(self, request: Request) -> list[int]:
        """The prompt blocks a cache hit could cover (never the last prompt token)."""
        usable = cacheable_prefix_blocks(request.num_prompt_tokens, self.config.block_size)
        return request.block_hashes[:usable]

    def _claimable_hashes(self, request: Request) -> list[int]:
        """Those the request may claim: none while it waits for its prompt logprobs, which
        need every position computed."""
        return [] if request.prompt_logprobs is not None else self._usable_hashes(request)

    def _claim_cached_prefix(self, request: Request) -> int:
        """Attaches the longest cached prefix (never the last prompt token) and returns the
        prefill origin it gives. The scheduler's own table is the authority on hits."""
        if not self.config.enable_prefix_caching:
            return 0
        hits = self.kv.claim_prefix(
            request.request_id,
            self._claimable_hashes(request),
            before_batch_seq=self._next_seq,
        )
        request.num_published_blocks = hits
        request.num_cached_tokens = hits * self.config.block_size
        return request.num_cached_tokens

    def take_prefix_events(self) -> PrefixEventBatch | None:
        """Drains block stored/removed events into the next envelope of the producer log."""
        if not self.config.enable_prefix_caching:
            return None
        return self.prefix_log.emit(self.kv.take_prefix_events())

    def _insert_running(self, request: Request) -> None:
        # queue order; after equal keys (there are none: arrival_seq is unique)
        bisect.insort_right(self.running, request, key=_priority_key)

    def _phase_preference(self, prefilling: list[Request]) -> list[Phase]:
        if not self.config.split_prefill:
            # atomic prefill and decode cannot share a batch: alternate when both have work
            if self._last_phase == Phase.PREFILL:
                return [Phase.RECURRENT, Phase.PREFILL]
            return [Phase.PREFILL, Phase.RECURRENT]
        # split: the prelude is cheap; run it when some request's depth-0 work has caught
        # up with its prelude (it would stall otherwise), else keep the core busy
        starved = any(
            r.phase is _SPLIT_PRELUDE and r.prefill_right(0) >= r.num_preluded_tokens
            for r in prefilling
        )
        if starved:
            return [Phase.PREFILLING_PRELUDE, Phase.RECURRENT]
        return [Phase.RECURRENT, Phase.PREFILLING_PRELUDE]

    # ------------------------------------------------------------------ selection
    def _take_decode_rows(self, sel: _Selection) -> None:
        """Decode rows come first in a RECURRENT batch, one loop per request."""
        cohort_busy = not self.config.refill and any(
            r.phase is _RECURRENT and r.decode_depth > 0 for r in self.running
        )
        for request in list(self.running):
            if request.phase is not _RECURRENT:
                continue
            if request.awaiting_output:
                task = self._follow_on_task(request)
                if task is not None:
                    self._accept_task(task, sel)
            elif cohort_busy and request.decode_depth == 0:
                continue  # no-refill baseline: wait for the whole cohort to exit
            else:
                self._accept_decode_row(request, sel)
            if sel.budget_left <= 0:
                return

    def _accept_decode_row(self, request: Request, sel: _Selection) -> None:
        """``_accept_task`` for a plain decode row (one token, one loop), without the
        generic branches: it runs for every decoding request in every step. Its KV slot is
        allocated with its depth-0 row."""
        rid = request.request_id
        selected = sel.selected
        if sel.budget_left <= 0 or (len(selected) >= sel.max_seqs and rid not in selected):
            return
        position = request.num_computed_tokens
        depth = request.decode_depth
        if depth == 0 and not self._ensure_execution_capacity(request, position + 1, sel):
            return
        # Request.forced_exit_loops_at, inlined
        index = position - request.num_prompt_tokens + 1
        forced = request.output_exit_depths[index] if index < len(request.output_token_ids) else 0
        # positional: (request, kind, token_start, token_count, depth, num_loops, embed,
        # compute_logits, forced_exit_loops, generation)
        task = ScheduledTask(
            request, _DECODE, position, 1, depth, 1, depth == 0, forced == 0, forced,
            request.generation,
        )  # fmt: skip
        sel.budget_left -= 1
        selected[rid] = request
        sel.tasks.append(task)
        if request.prefill_high_water:  # preempted before: this may rebuild dropped KV
            self._count_recompute(task)

    def _follow_on_task(self, request: Request) -> ScheduledTask | None:
        """The request's next decode loop while its previous row is still in flight.

        Whatever that row's result (exit or not), the next loop is one 1-token row, so it can
        be scheduled now and resolved by the worker. Not while recorded exits are replayed
        (their tokens are not the worker's to choose), and not when the rows in flight may
        already produce the last token: a follow-on there could need a KV slot past the
        request's footprint.
        """
        if not self._follow_ons:
            return None
        if request.forced_exit_loops_at(request.num_computed_tokens):
            return None  # replaying a recorded exit
        if len(request.output_token_ids) + request.pending_token_rows >= request.params.max_tokens:
            return None
        # if every loop in flight exits, the follow-on feeds this position
        furthest = request.num_computed_tokens + request.pending_decode_loops
        return ScheduledTask(request=request, kind=_FOLLOW_ON, token_start=furthest, token_count=1)

    def _take_wavefront_phase(
        self, phase: Phase, sel: _Selection, candidates: list[Request]
    ) -> None:
        """Depth-major selection shared by PRELUDE, split RECURRENT and atomic PREFILL.

        For each level (PRELUDE: chunk order; RECURRENT: depth 0..D-1; PREFILL: one level)
        every candidate (a request with prompt work, in queue order) offers its ready task;
        ``_accept_task`` checks KV capacity and charges (and truncates to) the budget as each
        task is accepted.
        """
        if not candidates or sel.budget_left <= 0:
            return
        prelude_cursors: dict[str, int] | None = {} if phase == Phase.PREFILLING_PRELUDE else None
        for level in self._levels(phase):
            accepted_any = False
            for request in candidates:
                if request.phase not in PREFILL_PHASES:
                    continue  # preempted by an earlier acceptance in this batch
                task = self._make_wavefront_task(request, phase, level, prelude_cursors)
                if task is None:
                    continue
                accepted = self._accept_task(task, sel)
                if accepted is not None:
                    accepted_any = True
                    if prelude_cursors is not None:
                        prelude_cursors[request.request_id] = accepted.token_end
                if sel.budget_left <= 0:
                    return
            if prelude_cursors is not None and not accepted_any:
                return  # PRELUDE levels go on only while some request still advances

    def _levels(self, phase: Phase) -> Iterable[int]:
        if phase == Phase.PREFILLING_PRELUDE:
            return _count_up()
        if phase == Phase.PREFILL:
            return (0,)
        return range(self.total_depths)

    def _chunk_end(self, request: Request, start: int) -> int:
        """Chunk boundaries are measured from the prefill origin (the prefix-cache hit)."""
        origin = request.prefill_window_origin
        size = self.config.prefill_chunk_size
        end = origin + ((start - origin) // size + 1) * size
        return min(end, request.num_prompt_tokens)

    def _make_wavefront_task(
        self,
        request: Request,
        phase: Phase,
        level: int,
        prelude_cursors: dict[str, int] | None,
    ) -> ScheduledTask | None:
        prompt_len = request.num_prompt_tokens
        if phase is _SPLIT_PRELUDE:
            if request.phase is not _SPLIT_PRELUDE or prelude_cursors is None:
                return None
            start = prelude_cursors.get(request.request_id, request.num_preluded_tokens)
            if start >= prompt_len:
                return None
            end = self._chunk_end(request, start)
            return self._task(request, _PRELUDE, start, end, depth=0, loops=0)

        if phase is _ATOMIC:
            if request.phase is not _ATOMIC:
                return None
            start = request.prefill_right(self.total_depths - 1)
            if start >= prompt_len:
                return None
            end = self._chunk_end(request, start)
            return self._task(
                request, _PREFILL, start, end, depth=0, loops=self.total_depths, embed=True
            )

        if request.phase not in _SPLIT_PREFILLING:
            return None
        depth = level
        start = request.prefill_right(depth)
        # ready as of the start of the step: [right_d, ...) bounded by the level above
        limit = request.ready_end(depth)
        end = min(self._chunk_end(request, start), limit)
        if end <= start:
            return None
        loops = 1
        if not self.config.wavefront_chunked_prefill:
            # depth-serial split prefill: run every depth whose frontier is level with this
            # one in the same task (several depths of one request in one update)
            while (
                depth + loops < self.total_depths and request.prefill_right(depth + loops) == start
            ):
                loops += 1
        return self._task(request, _PREFILL, start, end, depth=depth, loops=loops)

    def _task(
        self,
        request: Request,
        kind: RowKind,
        start: int,
        end: int,
        *,
        depth: int,
        loops: int,
        embed: bool = False,
    ) -> ScheduledTask:
        return ScheduledTask(
            request=request,
            kind=kind,
            token_start=start,
            token_count=end - start,
            depth=depth,
            num_loops=loops,
            embed=embed,
            generation=request.generation,
        )

    def _accept_task(self, task: ScheduledTask, sel: _Selection) -> ScheduledTask | None:
        """Admits one task into the batch: seats, budget (truncating), then KV capacity."""
        # called once per row: enum members compare by identity, locals save lookups
        request = task.request
        selected = sel.selected
        if len(selected) >= sel.max_seqs and request.request_id not in selected:
            return None
        budget = sel.budget_left
        if budget <= 0:
            return None
        count = task.token_count if task.token_count <= budget else budget
        kind = task.kind
        # prelude spans need no KV (decode rows take the other path: _accept_decode_row)
        needs_kv = kind is _FOLLOW_ON or kind is _PREFILL
        if needs_kv and not self._ensure_execution_capacity(request, task.token_start + count, sel):
            return None
        task.token_count = count
        task.generation = request.generation
        if kind is _PREFILL:
            reaches_coda = (
                task.depth + task.num_loops == self.total_depths
                and task.token_end == request.num_prompt_tokens
            )
            # a recomputed request already knows its first token
            task.compute_logits = reaches_coda and not request.output_token_ids
        sel.budget_left = budget - count
        selected[request.request_id] = request
        sel.tasks.append(task)
        if request.prefill_high_water:  # preempted before: part of this may be recompute
            self._count_recompute(task)
        return task

    def _count_recompute(self, task: ScheduledTask) -> None:
        request, stats = task.request, self.stats
        if task.kind is _DECODE:
            if task.forced_exit_loops:  # rebuilding a dropped generated token's KV
                stats.num_recomputed_decode_loops += 1
            return
        if task.kind is not _PREFILL:
            return  # prelude spans are embeddings, not core work
        start, end = task.token_start, task.token_end
        stats.num_recomputed_prompt_token_loops += request.recomputed_prompt_work(
            task.depth, task.num_loops, start, end
        )
        if task.depth == 0:
            stats.num_recomputed_prompt_tokens += request.recomputed_prompt_work(0, 1, start, end)

    def _ensure_execution_capacity(
        self, request: Request, num_tokens: int, sel: _Selection
    ) -> bool:
        """Allocates KV for ``num_tokens`` positions, preempting lower-priority requests.

        Never preempts a request already selected in this batch, one with work in flight,
        or one ahead of ``request`` in queue order (that would thrash).
        """
        if self.kv.ensure(request.request_id, num_tokens):
            return True
        shortfall = self.kv.blocks_to_grow(request.request_id, num_tokens)
        reclaimable = sum(
            self.kv.num_held_blocks(r.request_id) for r in self._victims(request, sel)
        )
        if reclaimable < shortfall - self.kv.num_free_blocks:
            return False  # preempting them all would throw their work away and still not fit
        while not self.kv.ensure(request.request_id, num_tokens):
            victim = self._pick_victim(request, sel)
            if victim is None:
                return False
            self._preempt(victim, for_request_id=request.request_id)
        return True

    def _pick_victim(self, request: Request, sel: _Selection) -> Request | None:
        return next(self._victims(request, sel), None)

    def _victims(self, request: Request, sel: _Selection) -> Iterator[Request]:
        """Who ``request`` may preempt, first victim first: behind it in queue order, not
        selected in this batch, no work in flight, holding KV."""
        for candidate in reversed(self.running):
            if candidate.priority_key <= request.priority_key:
                return
            if (
                candidate.request_id not in sel.selected
                and candidate.inflight_batches == 0
                and self.kv.num_held_blocks(candidate.request_id) > 0
            ):
                yield candidate

    def _preempt(self, request: Request, for_request_id: str = "") -> None:
        """Recompute-style preemption: free KV, keep outputs, requeue at its old priority."""
        self._record_preemption(request, for_request_id)
        self._note_kv_release(request)
        request.note_dropped_prefill()
        self.kv.free(request.request_id)
        self.running.remove(request)
        request.generation += 1
        request.phase = Phase.WAITING
        request.reset_prefill(origin=0)
        self._pending_finished.append(request.request_id)
        if request in self._pending_new:
            self._pending_new.remove(request)
        heapq.heappush(self._waiting, (request.priority_key, request))
        self.stats.num_preemptions += 1

    def _record_preemption(self, request: Request, for_request_id: str) -> None:
        decoding = request.phase is _RECURRENT
        prompt = request.num_prompt_tokens if decoding else request.prefill_right(0)
        output = request.num_computed_tokens - request.num_prompt_tokens if decoding else 0
        self._pending_preemptions.append(
            Preemption(
                seq=self._next_seq,
                request_id=request.request_id,
                for_request_id=for_request_id,
                prompt_tokens=prompt,
                output_tokens=max(0, output),
                blocks=self.kv.num_held_blocks(request.request_id),
                generation=request.generation + 1,  # _preempt bumps it next
            )
        )

    def _note_kv_release(self, request: Request) -> None:
        """A running request gives its KV back (it leaves ``running``): what its reservation
        never wrote is waste."""
        self._running_footprints -= self._footprint(request)
        if self.config.kv_admission is KVAdmission.RESERVE:
            unused = self._unallocated(request)
            self.stats.num_reserved_unused_blocks += unused.prompt + unused.decode

    # ------------------------------------------------------------------ batch building
    def _build_batch(self, phase: Phase, tasks: list[ScheduledTask]) -> ScheduledBatch:
        decode = [t for t in tasks if t.kind in _DECODE_KINDS]
        prompt = [t for t in tasks if t.kind not in _DECODE_KINDS]
        # execution order only: selection, budget and queue order are already settled
        prompt.sort(key=lambda t: (t.request.priority_key, t.token_start))
        ordered = decode + prompt
        seq = self._next_seq
        self._next_seq += 1
        wire = Batch(
            seq=seq,
            phase=phase,
            rows=[self._wire_row(t) for t in ordered],
            new_requests=[self._new_request(r) for r in self._pending_new],
            block_deltas=self.kv.take_deltas(),
            finished_request_ids=self._pending_finished,
            trace_ids={r.request_id: r.trace_id for r in self._pending_new if r.trace_id},
        )
        self._pending_new = []
        self._pending_finished = []
        preemptions, self._pending_preemptions = self._pending_preemptions, []
        self._last_phase = phase
        self.stats.num_batches += 1
        self.stats.num_decode_rows += len(decode)
        if _mixed_depths(ordered):
            self.stats.num_batches_with_mixed_depths += 1
        return ScheduledBatch(
            seq=seq, phase=phase, tasks=ordered, wire=wire, preemptions=preemptions
        )

    def _wire_row(self, task: ScheduledTask) -> BatchRow:
        request = task.request
        if task.kind is _FOLLOW_ON:  # the worker fills in everything it has and we do not
            return BatchRow(
                request_id=request.request_id,
                kind=_FOLLOW_ON,
                token_start=task.token_start,
                token_count=1,
                compute_logits=True,
            )
        if task.kind is _DECODE:
            return BatchRow(
                request_id=request.request_id,
                kind=_DECODE,
                token_start=task.token_start,
                token_count=1,
                depth=task.depth,
                num_loops=1,
                embed=task.embed,
                input_token_id=request.token_at(task.token_start),
                remaining=request.decode_remaining,
                forced_exit_loops=task.forced_exit_loops,
                compute_logits=task.compute_logits,
                output_index=len(request.output_token_ids),
            )
        return BatchRow(
            request_id=request.request_id,
            kind=task.kind,
            token_start=task.token_start,
            token_count=task.token_count,
            depth=task.depth,
            num_loops=task.num_loops,
            embed=task.embed or task.kind is _PRELUDE,
            compute_logits=task.compute_logits,
            output_index=len(request.output_token_ids),
        )

    def _new_request(self, request: Request) -> NewRequest:
        p = request.params
        assert p.max_loops is not None
        return NewRequest(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling=WorkerSampling(
                temperature=p.temperature,
                top_p=p.top_p,
                top_k=p.top_k,
                seed=request.seed,
                min_loops=p.min_loops,
                max_loops=p.max_loops,
                exit_threshold=p.exit_threshold,
                logprobs=-1 if p.logprobs is None else p.logprobs,
                prompt_logprobs=-1 if request.prompt_logprobs is None else p.prompt_logprobs,
            ),
        )

    # ------------------------------------------------------------------ progress
    def update_after_submission(self, batch: ScheduledBatch) -> None:
        """Called when the batch is handed to the worker. With async scheduling the prefill
        progress is applied here, so the next batch can be built before this one finishes.
        It produces no client events (a submission only advances prefill); blocks it
        completes are published for ``take_prefix_events``."""
        if batch.submitted:
            raise SchedulerInvariantError(f"batch {batch.seq} submitted twice")
        batch.submitted = True
        for task in batch.tasks:
            request = task.request
            request.inflight_batches += 1
            if task.kind in _DECODE_KINDS:
                request.pending_token_rows += 1
                request.pending_decode_loops += 1
            elif task.compute_logits:
                request.pending_token_rows += 1
        if self.config.async_scheduling:
            self._apply_prefill_phase_progress(batch)

    def update_from_output(self, batch: ScheduledBatch, result: BatchResult) -> list[StreamEvent]:
        """Applies a worker result: prefill progress (if not applied at submission), exit
        decisions, sampled tokens, stops. Results of preempted/aborted requests are dropped."""
        if batch.outputs_applied:
            raise SchedulerInvariantError(f"batch {batch.seq} output applied twice")
        if result.seq != batch.seq or len(result.rows) != len(batch.tasks):
            raise SchedulerInvariantError(
                f"result for batch {result.seq} with {len(result.rows)} rows does not match "
                f"batch {batch.seq} with {len(batch.tasks)} rows"
            )
        batch.outputs_applied = True
        events: list[StreamEvent] = []
        if not batch.progress_applied:
            self._apply_prefill_phase_progress(batch)
        for task, row in zip(batch.tasks, result.rows, strict=True):
            request = task.request
            # _is_stale, inlined: this runs once per row per step
            if request.phase is _FINISHED or task.generation != request.generation:
                continue
            request.inflight_batches -= 1
            if row.skipped:
                raise SchedulerInvariantError(
                    f"{request.request_id}: the worker skipped a row of batch {batch.seq} "
                    "for a live request"
                )
            if row.error is not None:  # this row alone failed: only its request ends
                events.extend(self.fail_request(request.request_id, row.error))
                continue
            if task.kind in _DECODE_KINDS:
                request.pending_token_rows -= 1
                request.pending_decode_loops -= 1
                self._apply_decode_output(task, row, events)
                continue
            if row.prompt_logprobs is not None:
                _fill_prompt_logprobs(request, row.prompt_logprobs)
            if task.compute_logits:
                request.pending_token_rows -= 1
                self._append_token(request, row, self.total_depths, events)
        return events

    def fail_batch(self, batch: ScheduledBatch, message: str) -> list[StreamEvent]:
        """``batch`` failed (on the worker, or while the scheduler applied it): every live
        request in it ends with an error. With async scheduling their blocks may already be
        published (at submission) by this batch or later ones: those are withdrawn, and a
        request that already claimed one is recomputed. Results apply in seq order, so blocks
        published before this batch were written by batches that succeeded."""
        batch.outputs_applied = True
        events: list[StreamEvent] = []
        failed: set[str] = set()
        for task in batch.tasks:
            if not self._is_stale(task):
                failed.add(task.request.request_id)
                events.extend(self.fail_request(task.request.request_id, message))
        if failed and self.config.enable_prefix_caching:
            for request_id in self.kv.withdraw(failed, batch.seq):
                claimant = self.requests[request_id]
                claimant.inflight_batches = 0  # its batches in flight are stale from now on
                self._preempt(claimant)
        return events

    def _is_stale(self, task: ScheduledTask) -> bool:
        return task.request.is_finished or task.generation != task.request.generation

    def _apply_prefill_phase_progress(self, batch: ScheduledBatch) -> None:
        """The one progress path: groups the batch's prompt rows once per request and phase
        and advances frontiers through ``_advance_prefill_depth_frontier``. Blocks it
        completes are published here (drained by ``take_prefix_events``), so submission-time
        and output-time progress publish identically."""
        batch.progress_applied = True
        groups: dict[tuple[str, RowKind], list[ScheduledTask]] = {}
        for task in batch.tasks:
            if task.kind in _DECODE_KINDS or self._is_stale(task):
                continue
            groups.setdefault((task.request.request_id, task.kind), []).append(task)
        for (_, kind), tasks in groups.items():
            request = tasks[0].request
            if kind is _PRELUDE:
                self._apply_prelude_spans(request, tasks)
                continue
            for task in tasks:
                if task.embed:  # atomic prefill runs its prelude in the same task
                    self._apply_prelude_spans(request, [task])
                if self._advance_prefill_depth_frontier(
                    request, task.depth, task.token_start, task.token_end, task.num_loops
                ):
                    self._retire_prefill_chunk(request, task.token_start, task.token_end, batch.seq)

    def _apply_prelude_spans(self, request: Request, tasks: list[ScheduledTask]) -> None:
        """One pass over the spans in token order: they must continue the prelude frontier
        without gaps; contiguous spans merge into one advance."""
        frontier = request.num_preluded_tokens
        for task in sorted(tasks, key=lambda t: t.token_start):
            if task.token_start != frontier:
                raise SchedulerInvariantError(
                    f"{request.request_id}: prelude span starts at {task.token_start}, "
                    f"frontier is {frontier}"
                )
            frontier = task.token_end
        request.num_preluded_tokens = frontier
        if frontier == request.num_prompt_tokens and request.phase == (Phase.PREFILLING_PRELUDE):
            request.phase = Phase.PREFILLING_RECURRENT

    def _advance_prefill_depth_frontier(
        self, request: Request, depth: int, start: int, end: int, loop_count: int
    ) -> bool:
        """The only per-step writer of ``prefill_depth_ranges``. Returns True when the
        task's last loop is the final depth."""
        if loop_count <= 0:
            return False
        for d in range(depth, depth + loop_count):
            origin, right = request.prefill_depth_ranges[d]
            if start != right:
                raise SchedulerInvariantError(
                    f"{request.request_id}: depth {d} frontier is at {right}, "
                    f"task starts at {start}"
                )
            if end > request.ready_end(d):
                above = "the prelude" if d == 0 else f"depth {d - 1}"
                raise SchedulerInvariantError(
                    f"{request.request_id}: depth {d} task ends at {end}, beyond {above}'s "
                    f"frontier {request.ready_end(d)}"
                )
            request.prefill_depth_ranges[d] = (origin, end)
        return depth + loop_count == self.total_depths

    def _retire_prefill_chunk(self, request: Request, start: int, end: int, batch_seq: int) -> None:
        """The final depth passed [start, end): those prompt positions are complete, and
        every full block behind the frontier is published as written by ``batch_seq``."""
        if start != request.prefill_reclaimable_tokens:
            raise SchedulerInvariantError(
                f"{request.request_id}: chunk [{start}, {end}) retired out of prompt order "
                f"(retired up to {request.prefill_reclaimable_tokens})"
            )
        request.prefill_reclaimable_tokens = end
        self._publish_full_blocks(request, end, batch_seq)
        if end == request.num_prompt_tokens:
            request.num_computed_tokens = end
            request.decode_depth = 0
            request.decode_remaining = 1.0
            request.phase = Phase.RECURRENT

    def _publish_full_blocks(self, request: Request, end: int, batch_seq: int) -> None:
        if not request.block_hashes:
            return
        complete = min(end // self.config.block_size, len(request.block_hashes))
        for index in range(request.num_published_blocks, complete):
            parent = request.block_hashes[index - 1] if index else None
            self.kv.publish(
                request.request_id, index, request.block_hashes[index], parent, batch_seq
            )
        request.num_published_blocks = max(request.num_published_blocks, complete)

    def _apply_decode_output(
        self, task: ScheduledTask, row: RowResult, events: list[StreamEvent]
    ) -> None:
        request = task.request
        # results apply in batch order, so the request's cursor is where this row ran
        # (a follow-on row's depth is only known this way)
        depth = request.decode_depth
        if task.kind is _DECODE and task.depth != depth:
            raise SchedulerInvariantError(
                f"{request.request_id}: row scheduled at depth {task.depth}, cursor at {depth}"
            )
        if not row.exited:
            request.decode_depth += 1
            request.decode_remaining = row.remaining
            return
        exit_loops = row.exit_loops
        if exit_loops != depth + 1:
            raise SchedulerInvariantError(
                f"{request.request_id}: row at depth {depth} reported an exit after "
                f"{exit_loops} loops"
            )
        request.num_computed_tokens += 1
        request.decode_depth = 0
        request.decode_remaining = 1.0
        if task.forced_exit_loops:
            return  # replayed position: its token is already known
        self._append_token(request, row, exit_loops, events)

    def _append_token(
        self, request: Request, row: RowResult, exit_loops: int, events: list[StreamEvent]
    ) -> None:
        token_id = row.token_id
        prompt = None
        if request.prompt_logprobs is not None:  # asked for: they go with the first token
            prompt, request.prompt_logprobs = _prompt_entries(request), None
        request.output_token_ids.append(token_id)
        # the public API names this loop count "exit_depth" (docs/ARCHITECTURE.md)
        request.output_exit_depths.append(exit_loops)
        events.append(
            TokenEvent(
                request_id=request.request_id,
                index=len(request.output_token_ids) - 1,
                token_id=token_id,
                exit_depth=exit_loops,
                text="",  # filled in by the output processor
                logprobs=None if row.logprobs is None else _token_logprobs(row, token_id),
                prompt_logprobs=prompt,
            )
        )
        params = request.params
        if token_id in params.stop_token_ids or (
            not params.ignore_eos and token_id in self.limits.eos_token_ids
        ):
            self._finish(request, "stop", events)
        elif len(request.output_token_ids) >= params.max_tokens:
            self._finish(request, "length", events)

    def _finish(self, request: Request, reason: str, events: list[StreamEvent]) -> None:
        request.phase = Phase.FINISHED
        request.finish_reason = reason
        running = request in self.running
        if running:
            self._note_kv_release(request)
        self.kv.free(request.request_id)
        if running:
            self.running.remove(request)
            self._pending_finished.append(request.request_id)
        if request in self._pending_new:
            self._pending_new.remove(request)
        self.requests.pop(request.request_id, None)
        events.append(
            FinishedEvent(
                request_id=request.request_id,
                finish_reason=reason,
                token_ids=list(request.output_token_ids),
                exit_depths=list(request.output_exit_depths),
                num_prompt_tokens=request.num_prompt_tokens,
                num_cached_tokens=request.num_cached_tokens,
            )
        )


def _token_logprobs(row: RowResult, token_id: int) -> TokenLogprobs:
    """The worker's log-probabilities as the stream carries them (token texts are filled in
    with the event's text, by the output processor)."""
    sampled = row.logprobs
    assert sampled is not None
    return TokenLogprobs(
        token_id=token_id,
        logprob=sampled.logprob,
        top_logprobs=_top(sampled.top_ids, sampled.top_logprobs),
    )


def _top(ids: list[int], logprobs: list[float]) -> list[TopLogprob]:
    return [TopLogprob(token_id=t, logprob=lp) for t, lp in zip(ids, logprobs, strict=False)]


def _fill_prompt_logprobs(request: Request, scored: PromptLogprobs) -> None:
    """A final-depth prefill row's prompt log-probabilities, by position (a chunk computed
    again after a preemption overwrites its earlier copy); nothing once they were sent."""
    slots = request.prompt_logprobs
    if slots is None:
        return
    prompt = request.prompt_token_ids
    rows = zip(scored.logprobs, scored.top_ids, scored.top_logprobs, strict=False)
    for position, (logprob, ids, values) in enumerate(rows, start=scored.start):
        if 0 < position < len(slots):
            slots[position] = TokenLogprobs(
                token_id=prompt[position], logprob=logprob, top_logprobs=_top(ids, values)
            )


def _prompt_entries(request: Request) -> list[TokenLogprobs]:
    """The prompt's entries as the first token event carries them: the first token with
    no log-probability (nothing predicts it, as in vLLM), and so any position no row
    scored (the simulated device scores none)."""
    slots = request.prompt_logprobs
    assert slots is not None
    return [
        slot or TokenLogprobs(token_id=token, logprob=None)
        for slot, token in zip(slots, request.prompt_token_ids, strict=True)
    ]


def _mixed_depths(tasks: list[ScheduledTask]) -> bool:
    """Whether rows of at least two depths share this batch's core passes (a follow-on's
    depth is not known here, a prelude span runs no loop)."""
    first = -1
    for task in tasks:
        if task.kind is _DECODE or task.kind is _PREFILL:
            if first < 0:
                first = task.depth
            elif task.depth != first:
                return True
    return False


def _count_up() -> Iterator[int]:
    level = 0
    while True:
        yield level
        level += 1
