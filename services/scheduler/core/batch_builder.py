"""Turning selected tasks into a ``ScheduledBatch`` and its wire ``Batch``: row order, rows,
the requests the worker learns of, KV block deltas and the ids it may free."""

from __future__ import annotations

from messages.batch import (
    Batch,
    BatchKind,
    BatchRow,
    NewRequest,
    RowKind,
    SparseFragment,
    WorkerSampling,
)
from services.scheduler.core.batch import ScheduledBatch, ScheduledTask
from services.scheduler.core.request import Request
from services.scheduler.core.state import SchedulerState

# per-row comparisons by identity against module globals (see selection.py)
_DECODE, _FOLLOW_ON = RowKind.DECODE, RowKind.FOLLOW_ON
_PREFILL, _PRELUDE = RowKind.PREFILL, RowKind.PRELUDE
_DECODE_KINDS = (_DECODE, _FOLLOW_ON)  # rows of the token being generated


def build_batch(
    state: SchedulerState, kind: BatchKind, tasks: list[ScheduledTask]
) -> ScheduledBatch:
    """Numbers the batch and drains what it carries besides its rows."""
    decode = [t for t in tasks if t.kind in _DECODE_KINDS]
    prompt = [t for t in tasks if t.kind not in _DECODE_KINDS]
    # execution order only: selection, budget and queue order are already settled
    prompt.sort(key=lambda t: (t.request.priority_key, t.token_start))
    ordered = decode + prompt
    seq = state.next_seq
    state.next_seq += 1
    pending_new = state.pending_new
    wire = Batch(
        seq=seq,
        kind=kind,
        rows=[_wire_row(t) for t in ordered],
        new_requests=[_new_request(r) for r in pending_new],
        block_deltas=state.kv.take_deltas(),
        finished_request_ids=state.pending_finished,
        trace_ids={r.request_id: r.trace_id for r in pending_new if r.trace_id},
        kv_pulls=state.pending_pulls,
    )
    state.pending_pulls = []
    state.pending_new = []
    state.pending_finished = []
    preemptions, state.pending_preemptions = state.pending_preemptions, []
    stats = state.stats
    stats.num_batches += 1
    stats.num_decode_rows += len(decode)
    if _mixed_depths(ordered):
        stats.num_batches_with_mixed_depths += 1
    return ScheduledBatch(
        seq=seq,
        kind=kind,
        tasks=ordered,
        wire=wire,
        preemptions=preemptions,
        depth_budget=state.depth_budget,
    )


def _wire_row(task: ScheduledTask) -> BatchRow:
    request = task.request
    if task.kind is _FOLLOW_ON:  # the worker fills in everything it has and we do not
        return BatchRow(
            request_id=request.request_id,
            kind=_FOLLOW_ON,
            token_start=task.token_start,
            token_count=1,
            compute_logits=True,
            max_loops=task.loop_budget,
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
            max_loops=task.loop_budget,
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
        fragment=SparseFragment(
            task.active_start, task.active_start + task.active_count, task.window_active
        )
        if task.window_active
        else None,
    )


def _new_request(request: Request) -> NewRequest:
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
            logprobs=p.logprobs,
            # None once they went out with the first token (a replay scores them no more)
            prompt_logprobs=None if request.prompt_logprobs is None else p.prompt_logprobs,
            structured_output=p.structured_output,
        ),
        # the worker rebuilds the grammar's state from what the request has generated
        generated_token_ids=list(request.output_token_ids) if p.structured_output else [],
        sparse_prefill=None if request.sparse is None else request.sparse.to_wire(),
    )


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
