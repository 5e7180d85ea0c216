"""The one progress path: what a submitted batch and a worker result change.

Prefill progress is applied at submission (async scheduling, so the next batch can be built
before this one finishes) or with the result (sync); both go through
``_apply_prefill_progress`` so they cannot diverge. Results then apply exit decisions,
sampled tokens and stops, strictly in batch order.
"""

from __future__ import annotations

from messages.api import ErrorEvent, StreamEvent, TokenEvent
from messages.batch import BatchResult, RowKind, RowResult
from messages.errors import ErrorCode
from services.scheduler.core.batch import ScheduledBatch, ScheduledTask
from services.scheduler.core.logprobs import fill_prompt_logprobs, prompt_entries, token_logprobs
from services.scheduler.core.request import Request, RequestState
from services.scheduler.core.running import finish, preempt
from services.scheduler.core.state import SchedulerState

# per-row comparisons by identity against module globals (see selection.py)
_DECODE, _FOLLOW_ON, _PRELUDE = RowKind.DECODE, RowKind.FOLLOW_ON, RowKind.PRELUDE
_DECODE_KINDS = (_DECODE, _FOLLOW_ON)  # rows of the token being generated
_FINISHED = RequestState.FINISHED


class SchedulerInvariantError(RuntimeError):
    """A progress update broke a frontier rule; this is a bug, never bad client input."""


class Progress:
    """Applies submissions and results to the requests: frontiers, decode cursors, tokens,
    stops and failures. Ends requests through ``running.finish``."""

    def __init__(self, state: SchedulerState) -> None:
        self._state = state
        # read per row: plain attributes, not lookups through the config
        self._total_ut_steps = state.total_ut_steps
        self._eos_token_ids = state.limits.eos_token_ids
        self._async = state.config.async_scheduling

    # ------------------------------------------------------------------ batches
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
        if self._async:
            self._apply_prefill_progress(batch)

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
            self._apply_prefill_progress(batch)
        for task, row in zip(batch.tasks, result.rows, strict=True):
            request = task.request
            # _is_stale, inlined: this runs once per row per step
            if request.state is _FINISHED or task.incarnation != request.incarnation:
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
                fill_prompt_logprobs(request, row.prompt_logprobs)
            if task.compute_logits:
                request.pending_token_rows -= 1
                # the prompt's token: full depth, never shed
                self._append_token(request, row, self._total_ut_steps, None, events)
        return events

    def fail_batch(self, batch: ScheduledBatch, message: str) -> list[StreamEvent]:
        """``batch`` failed (on the worker, or while the scheduler applied it): every live
        request in it ends with an error. With async scheduling their blocks may already be
        published (at submission) by this batch or later ones: those are withdrawn, and a
        request that already claimed one is recomputed. Results apply in seq order, so blocks
        published before this batch were written by batches that succeeded."""
        state = self._state
        batch.outputs_applied = True
        events: list[StreamEvent] = []
        failed: set[str] = set()
        for task in batch.tasks:
            if not _is_stale(task):
                failed.add(task.request.request_id)
                events.extend(self.fail_request(task.request.request_id, message))
        if failed and state.config.enable_prefix_caching:
            for request_id in state.kv.withdraw(failed, batch.seq):
                claimant = state.requests[request_id]
                claimant.inflight_batches = 0  # its batches in flight are stale from now on
                preempt(state, claimant)
        return events

    # ------------------------------------------------------------------ request ends
    def fail_request(
        self, request_id: str, message: str, code: ErrorCode = ErrorCode.INTERNAL
    ) -> list[StreamEvent]:
        """Ends a live request with an error event (e.g. the worker failed its batch), freeing
        its KV; [] if it already ended."""
        request = self._state.requests.get(request_id)
        if request is None:
            return []
        events: list[StreamEvent] = []
        finish(self._state, request, "error", events)
        events[-1] = ErrorEvent(request_id=request_id, code=str(code), message=message)
        return events

    def finish_if_complete(self, request_id: str) -> list[StreamEvent]:
        """A resumed request whose known outputs already end it (its last token was a stop,
        or it has max_tokens of them) finishes at once, without running anything. The same
        stop rule as ``_append_token``'s."""
        request = self._state.requests.get(request_id)
        if request is None or not request.output_token_ids:
            return []
        params, last = request.params, request.output_token_ids[-1]
        reason = None
        if last in params.stop_token_ids or (not params.ignore_eos and last in self._eos_token_ids):
            reason = "stop"
        elif len(request.output_token_ids) >= params.max_tokens:
            reason = "length"
        if reason is None:
            return []
        events: list[StreamEvent] = []
        finish(self._state, request, reason, events)
        return events

    # ------------------------------------------------------------------ prefill frontiers
    def _apply_prefill_progress(self, batch: ScheduledBatch) -> None:
        """The one progress path: groups the batch's prompt rows once per request and row kind
        and advances frontiers through ``_advance_prefill_depth_frontier``. Blocks it
        completes are published here (drained by ``take_prefix_events``), so submission-time
        and output-time progress publish identically."""
        batch.progress_applied = True
        groups: dict[tuple[str, RowKind], list[ScheduledTask]] = {}
        for task in batch.tasks:
            if task.kind in _DECODE_KINDS or _is_stale(task):
                continue
            groups.setdefault((task.request.request_id, task.kind), []).append(task)
        for (_, kind), tasks in groups.items():
            request = tasks[0].request
            if kind is _PRELUDE:
                self._apply_prelude_spans(request, tasks)
                continue
            for task in tasks:
                self._count_prefill_rows(request, task)
                if task.embed:  # atomic prefill runs its prelude in the same task
                    self._apply_prelude_spans(request, [task])
                if task.window_active and not self._advance_sparse_fragment(request, task):
                    continue  # the window's loop is not over: its frontier waits
                if self._advance_prefill_depth_frontier(
                    request, task.depth, task.token_start, task.token_end, task.num_loops
                ):
                    self._retire_prefill_chunk(request, task.token_start, task.token_end, batch.seq)

    def _count_prefill_rows(self, request: Request, task: ScheduledTask) -> None:
        rows = task.core_rows
        request.num_prefill_rows += rows
        stats = self._state.stats
        stats.num_prefill_rows += rows
        if task.window_active and task.active_start + task.active_count == task.window_active:
            # the window's sparse loop is over: its frozen tokens are the rows it saved
            stats.num_prefill_rows_saved += task.token_count - task.window_active

    def _advance_sparse_fragment(self, request: Request, task: ScheduledTask) -> bool:
        """A fragment of a window's sparse loop: its active rows continue where the last
        one stopped. Returns True when it is the window's last, which moves the depth's
        frontier over the whole window (``_advance_prefill_depth_frontier``)."""
        done = request.sparse_rows_done
        depth = task.depth
        if task.active_start != done[depth]:
            raise SchedulerInvariantError(
                f"{request.request_id}: sparse fragment of depth {depth} starts at active row "
                f"{task.active_start}, {done[depth]} of the window ran"
            )
        end = task.active_start + task.active_count
        if end < task.window_active:
            done[depth] = end
            return False
        done[depth] = 0
        return True

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
        if (
            frontier == request.num_prompt_tokens
            and request.state is RequestState.PREFILLING_PRELUDE
        ):
            request.state = RequestState.PREFILLING_RECURRENT

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
        return depth + loop_count == self._total_ut_steps

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
            request.state = RequestState.RECURRENT

    def _publish_full_blocks(self, request: Request, end: int, batch_seq: int) -> None:
        if not request.block_hashes:
            return
        kv = self._state.kv
        complete = min(end // self._state.config.block_size, len(request.block_hashes))
        for index in range(request.num_published_blocks, complete):
            parent = request.block_hashes[index - 1] if index else None
            kv.publish(request.request_id, index, request.block_hashes[index], parent, batch_seq)
        request.num_published_blocks = max(request.num_published_blocks, complete)

    # ------------------------------------------------------------------ decode outputs
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
        if depth == 0:  # this row started the token: its budget is the token's (as the worker's)
            request.token_loop_budget = task.loop_budget
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
        self._append_token(request, row, exit_loops, request.token_loop_budget, events)

    def _append_token(
        self,
        request: Request,
        row: RowResult,
        exit_loops: int,
        loop_budget: int | None,
        events: list[StreamEvent],
    ) -> None:
        token_id = row.token_id
        prompt = None
        if request.prompt_logprobs is not None:  # asked for: they go with the first token
            prompt, request.prompt_logprobs = prompt_entries(request), None
        request.output_token_ids.append(token_id)
        # the public API names this loop count "exit_depth" (docs/ARCHITECTURE.md)
        request.output_exit_loops.append(exit_loops)
        params = request.params
        request.output_loop_budgets.append(loop_budget)
        if loop_budget is not None:
            self._state.stats.num_shed_tokens += 1
        index = len(request.output_token_ids) - 1
        events.append(
            TokenEvent(
                request_id=request.request_id,
                index=index,
                token_id=token_id,
                exit_depth=exit_loops,
                text="",  # filled in by the output processor
                logprobs=None if row.logprobs is None else token_logprobs(row, token_id),
                prompt_logprobs=prompt,
                num_prompt_tokens=request.num_prompt_tokens if index == 0 else None,
                num_cached_tokens=request.num_cached_tokens if index == 0 else None,
                depth_budget=loop_budget,
            )
        )
        if token_id in params.stop_token_ids or (
            not params.ignore_eos and token_id in self._eos_token_ids
        ):
            finish(self._state, request, "stop", events)
        elif len(request.output_token_ids) >= params.max_tokens:
            finish(self._state, request, "length", events)


def _is_stale(task: ScheduledTask) -> bool:
    return task.request.is_finished or task.incarnation != task.request.incarnation
