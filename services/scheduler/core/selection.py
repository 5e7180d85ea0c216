"""Choosing one batch's tasks: its kind, decode rows and follow-ons, depth-major wavefront
selection of prompt work, and the preemption that makes KV room for an accepted task.

Selection only decides rows and allocates their KV; the batch is built from the tasks by
``batch_builder.py`` and progress is applied by ``progress.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from messages.batch import BatchKind, RowKind
from services.scheduler.core.batch import ScheduledTask
from services.scheduler.core.depth_budget import token_budget
from services.scheduler.core.progress import SchedulerInvariantError
from services.scheduler.core.request import PREFILL_STATES, Request, RequestState
from services.scheduler.core.running import preempt
from services.scheduler.core.speculation import Speculator
from services.scheduler.core.state import SchedulerState

# The per-row loops compare enum members by identity against module globals: on Python 3.11
# an Enum class attribute (RowKind.DECODE) costs ~75 ns a lookup, a module global ~10.
_DECODE, _FOLLOW_ON = RowKind.DECODE, RowKind.FOLLOW_ON
_PREFILL, _PRELUDE = RowKind.PREFILL, RowKind.PRELUDE
# batch kinds and request states the per-candidate loops compare, likewise
_ATOMIC_BATCH, _PRELUDE_BATCH = BatchKind.PREFILL, BatchKind.PREFILLING_PRELUDE
_ATOMIC, _SPLIT_PRELUDE = RequestState.PREFILL, RequestState.PREFILLING_PRELUDE
_SPLIT_PREFILLING = (RequestState.PREFILLING_PRELUDE, RequestState.PREFILLING_RECURRENT)


@dataclass
class Selection:
    """State of one batch while it is being selected."""

    budget_left: int
    max_seqs: int
    selected: dict[str, Request] = field(default_factory=dict)
    tasks: list[ScheduledTask] = field(default_factory=list)


class Selector:
    """Builds one batch's task list per ``select()``; remembers only the last batch kind it chose
    (atomic prefill alternates with decode)."""

    def __init__(self, state: SchedulerState, speculator: Speculator | None = None) -> None:
        self._state = state
        self._spec = speculator if speculator is not None and speculator.enabled else None
        config = state.config
        self._total_ut_steps = state.total_ut_steps
        # async refill: a request whose decode row is in flight sends its next loop as a
        # follow-on row instead of sitting out a batch (cohort batching holds rows anyway)
        self._follow_ons = config.async_scheduling and config.refill
        self._last_kind: BatchKind | None = None

    def select(self) -> tuple[BatchKind, list[ScheduledTask]] | None:
        """The next batch's kind and tasks (KV allocated), or None if nothing can run."""
        config = self._state.config
        # the requests with prompt work, in queue order (one scan of `running` per step)
        prefilling = [r for r in self._state.running if r.state in PREFILL_STATES]
        for kind in self._kind_preference(prefilling):
            selection = Selection(config.max_num_batched_tokens, config.max_num_seqs)
            if kind is BatchKind.RECURRENT:
                self._take_decode_rows(selection)
            self._take_wavefront(kind, selection, prefilling)
            if selection.tasks:
                self._last_kind = kind
                return kind, selection.tasks
        return None

    def _kind_preference(self, prefilling: list[Request]) -> list[BatchKind]:
        if not self._state.config.split_prefill:
            # atomic prefill and decode cannot share a batch: alternate when both have work
            if self._last_kind is BatchKind.PREFILL:
                return [BatchKind.RECURRENT, BatchKind.PREFILL]
            return [BatchKind.PREFILL, BatchKind.RECURRENT]
        # split: the prelude is cheap; run it when some request's depth-0 work has caught
        # up with its prelude (it would stall otherwise), else keep the core busy
        starved = any(
            r.state is _SPLIT_PRELUDE and r.prefill_right(0) >= r.num_preluded_tokens
            for r in prefilling
        )
        if starved:
            return [BatchKind.PREFILLING_PRELUDE, BatchKind.RECURRENT]
        return [BatchKind.RECURRENT, BatchKind.PREFILLING_PRELUDE]

    # ------------------------------------------------------------------ decode rows
    def _take_decode_rows(self, sel: Selection) -> None:
        """Decode rows come first in a RECURRENT batch, one loop per request."""
        running = self._state.running
        decoding = RequestState.RECURRENT  # a local: compared once per running request
        cohort_busy = not self._state.config.refill and any(
            r.state is decoding and r.decode_depth > 0 for r in running
        )
        for request in list(running):
            if request.state is not decoding or request.hand_off:
                continue  # (a request handed off after its first token decodes elsewhere)
            if self._spec is not None and self._spec.applies(request):
                self._accept_speculative(request, sel)
            elif request.awaiting_output:
                task = self._follow_on_task(request)
                if task is not None:
                    self._accept_task(task, sel)
            elif cohort_busy and request.decode_depth == 0:
                continue  # no-refill baseline: wait for the whole cohort to exit
            else:
                self._accept_decode_row(request, sel)
            if sel.budget_left <= 0:
                return

    def _accept_decode_row(self, request: Request, sel: Selection) -> None:
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
        forced = request.output_exit_loops[index] if index < len(request.output_token_ids) else 0
        # a token keeps the budget its first loop ran under; a replayed exit needs none
        if forced:
            budget = None
        elif depth:
            budget = request.token_loop_budget
        else:
            budget = self._token_budget(request)
        # positional: (request, kind, token_start, token_count, depth, num_loops, embed,
        # compute_logits, forced_exit_loops, incarnation, loop_budget)
        task = ScheduledTask(
            request, _DECODE, position, 1, depth, 1, depth == 0, forced == 0, forced,
            request.incarnation, budget,
        )  # fmt: skip
        sel.budget_left -= 1
        selected[rid] = request
        sel.tasks.append(task)
        if request.prefill_high_water:  # preempted before: this may rebuild dropped KV
            self._count_recompute(task)

    def _accept_speculative(self, request: Request, sel: Selection) -> None:
        """A speculating request's one row: the next pass of its cycle (speculation.py)."""
        assert self._spec is not None
        rid = request.request_id
        if sel.budget_left <= 0 or (len(sel.selected) >= sel.max_seqs and rid not in sel.selected):
            return
        task = self._spec.task(
            request,
            sel.budget_left,
            lambda r, n: self._ensure_execution_capacity(r, n, sel),
        )
        if task is None:
            return
        sel.budget_left -= task.token_count
        sel.selected[rid] = request
        sel.tasks.append(task)

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
        # the budget a new token would start under (the worker ignores it for a later loop)
        return ScheduledTask(
            request=request,
            kind=_FOLLOW_ON,
            token_start=furthest,
            token_count=1,
            loop_budget=self._token_budget(request),
        )

    def _token_budget(self, request: Request) -> int | None:
        budget = self._state.depth_budget
        return None if budget >= self._total_ut_steps else token_budget(request, budget)

    # ------------------------------------------------------------------ prompt work
    def _take_wavefront(self, kind: BatchKind, sel: Selection, candidates: list[Request]) -> None:
        """Depth-major selection shared by every batch kind: PREFILLING_PRELUDE, the split
        prefill rows of RECURRENT, and atomic PREFILL.

        For each level (PRELUDE: chunk order; RECURRENT: depth 0..D-1; PREFILL: one level)
        every candidate (a request with prompt work, in queue order) offers its ready task;
        ``_accept_task`` checks KV capacity and charges (and truncates to) the budget as each
        task is accepted.
        """
        if not candidates or sel.budget_left <= 0:
            return
        prelude = kind is BatchKind.PREFILLING_PRELUDE
        prelude_cursors: dict[str, int] | None = {} if prelude else None
        for level in self._levels(kind):
            accepted_any = False
            for request in candidates:
                if request.state not in PREFILL_STATES:
                    continue  # preempted by an earlier acceptance in this batch
                task = self._make_wavefront_task(request, kind, level, prelude_cursors)
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

    def _levels(self, kind: BatchKind) -> Iterable[int]:
        if kind is BatchKind.PREFILLING_PRELUDE:
            return _count_up()
        if kind is BatchKind.PREFILL:
            return (0,)
        return range(self._total_ut_steps)

    def _chunk_end(self, request: Request, start: int) -> int:
        """Chunk boundaries are measured from the prefill origin (the prefix-cache hit)."""
        origin = request.prefill_window_origin
        size = self._state.config.prefill_chunk_size
        end = origin + ((start - origin) // size + 1) * size
        return min(end, request.num_prompt_tokens)

    def _make_wavefront_task(
        self,
        request: Request,
        kind: BatchKind,
        level: int,
        prelude_cursors: dict[str, int] | None,
    ) -> ScheduledTask | None:
        prompt_len = request.num_prompt_tokens
        total_ut_steps = self._total_ut_steps
        state = request.state
        if kind is _PRELUDE_BATCH:
            if state is not _SPLIT_PRELUDE or prelude_cursors is None:
                return None
            start = prelude_cursors.get(request.request_id, request.num_preluded_tokens)
            if start >= prompt_len:
                return None
            end = self._chunk_end(request, start)
            return _task(request, _PRELUDE, start, end, depth=0, loops=0)

        if kind is _ATOMIC_BATCH:
            if state is not _ATOMIC:
                return None
            start = request.prefill_right(total_ut_steps - 1)
            if start >= prompt_len:
                return None
            end = self._chunk_end(request, start)
            return _task(request, _PREFILL, start, end, depth=0, loops=total_ut_steps, embed=True)

        if state not in _SPLIT_PREFILLING:
            return None
        depth = level
        sparse = request.sparse
        if sparse is not None and sparse.is_sparse(depth):
            return _sparse_fragment(request, depth)
        start = request.prefill_right(depth)
        # ready as of the start of the step: [right_d, ...) bounded by the level above
        limit = request.ready_end(depth)
        end = min(self._chunk_end(request, start), limit)
        if end <= start:
            return None
        loops = 1
        if not self._state.config.wavefront_chunked_prefill:
            # depth-serial split prefill: run every depth whose frontier is level with this
            # one in the same task (several depths of one request in one update), up to the
            # first sparse depth, which runs by windows
            last = total_ut_steps if sparse is None else sparse.first_sparse_loop
            while depth + loops < last and request.prefill_right(depth + loops) == start:
                loops += 1
        return _task(request, _PREFILL, start, end, depth=depth, loops=loops)

    # ------------------------------------------------------------------ acceptance and KV
    def _accept_task(self, task: ScheduledTask, sel: Selection) -> ScheduledTask | None:
        """Admits one task into the batch: seats, budget (truncating), then KV capacity."""
        # called once per row: enum members compare by identity, locals save lookups
        request = task.request
        selected = sel.selected
        if len(selected) >= sel.max_seqs and request.request_id not in selected:
            return None
        budget = sel.budget_left
        if budget <= 0:
            return None
        # a sparse fragment is charged, and cut, by its active rows; its window stays whole
        fragment = task.window_active > 0
        wanted = task.active_count if fragment else task.token_count
        count = wanted if wanted <= budget else budget
        kind = task.kind
        # prelude spans need no KV (decode rows take the other path: _accept_decode_row)
        needs_kv = kind is _FOLLOW_ON or kind is _PREFILL
        kv_end = task.token_end if fragment else task.token_start + count
        if needs_kv and not self._ensure_execution_capacity(request, kv_end, sel):
            return None
        if fragment:
            task.active_count = count
        else:
            task.token_count = count
        task.incarnation = request.incarnation
        if kind is _PREFILL:
            reaches_coda = (
                task.depth + task.num_loops == self._total_ut_steps
                and task.token_end == request.num_prompt_tokens
                # the prompt's last token is its window's last active row
                and (not fragment or task.active_start + count == task.window_active)
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
        request, stats = task.request, self._state.stats
        if task.kind is _DECODE:
            if task.forced_exit_loops:  # rebuilding a dropped generated token's KV
                stats.num_recomputed_decode_loops += 1
            return
        if task.kind is not _PREFILL:
            return  # prelude spans are embeddings, not core work
        start, end = task.token_start, task.token_end
        if task.window_active:  # a sparse fragment: its rows, once the window ran before
            if request.prefill_high_water[task.depth] >= end:
                stats.num_recomputed_prompt_token_loops += task.active_count
            return
        stats.num_recomputed_prompt_token_loops += request.recomputed_prompt_work(
            task.depth, task.num_loops, start, end
        )
        if task.depth == 0:
            stats.num_recomputed_prompt_tokens += request.recomputed_prompt_work(0, 1, start, end)

    def _ensure_execution_capacity(self, request: Request, num_tokens: int, sel: Selection) -> bool:
        """Allocates KV for ``num_tokens`` positions, preempting lower-priority requests.

        Never preempts a request already selected in this batch, one with work in flight,
        or one ahead of ``request`` in queue order (that would thrash).
        """
        kv = self._state.kv
        if kv.ensure(request.request_id, num_tokens):
            return True
        shortfall = kv.blocks_to_grow(request.request_id, num_tokens)
        reclaimable = kv.releasable_blocks([r.request_id for r in self._victims(request, sel)])
        if reclaimable < shortfall - kv.num_free_blocks:
            return False  # preempting them all would throw their work away and still not fit
        while not kv.ensure(request.request_id, num_tokens):
            victim = next(self._victims(request, sel), None)
            if victim is None:
                return False
            preempt(self._state, victim, for_request_id=request.request_id)
        return True

    def _victims(self, request: Request, sel: Selection) -> Iterator[Request]:
        """Who ``request`` may preempt, first victim first: behind it in queue order, not
        selected in this batch, no work in flight, holding KV."""
        kv = self._state.kv
        for candidate in reversed(self._state.running):
            if candidate.priority_key <= request.priority_key:
                return
            if (
                candidate.request_id not in sel.selected
                and candidate.inflight_batches == 0
                and kv.num_held_blocks(candidate.request_id) > 0
            ):
                yield candidate


def _task(
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
        incarnation=request.incarnation,
    )


def _sparse_fragment(request: Request, depth: int) -> ScheduledTask | None:
    """The next fragment of the window at a sparse depth's frontier, once the depth above
    covers the whole window (the active tokens are chosen from the whole window's scores).
    Its rows are the window's active rows not yet run; acceptance cuts them to the budget."""
    sparse = request.sparse
    assert sparse is not None
    prompt_len = request.num_prompt_tokens
    start = request.prefill_right(depth)
    if start >= prompt_len:
        return None
    window_start, window_end = sparse.window_bounds(start, prompt_len)
    if window_start != start:
        raise SchedulerInvariantError(
            f"{request.request_id}: sparse depth {depth} frontier {start} is inside the "
            f"window starting at {window_start}"
        )
    if request.ready_end(depth) < window_end:
        return None
    active = sparse.active_count(depth, window_end - window_start)
    done = request.sparse_rows_done[depth]
    return ScheduledTask(
        request=request,
        kind=_PREFILL,
        token_start=window_start,
        token_count=window_end - window_start,
        depth=depth,
        num_loops=1,
        incarnation=request.incarnation,
        active_start=done,
        active_count=active - done,
        window_active=active,
    )


def _count_up() -> Iterator[int]:
    level = 0
    while True:
        yield level
        level += 1
