"""The running set's transitions: a request joins it at admission and leaves it either for
the waiting queue (recompute preemption) or for good (finish).

Every exit gives the request's KV back here, so the footprint sum admission relies on, the
reserve-waste counter and the finished ids the worker frees cannot drift apart. Also the
footprint arithmetic both admission and these exits use.
"""

from __future__ import annotations

import bisect
import heapq

from messages.api import FinishedEvent, StreamEvent
from services.common.config import KVAdmission
from services.scheduler.core.kv.kv_admission import Commitment, Preemption
from services.scheduler.core.kv.kv_manager import KVManager
from services.scheduler.core.request import Request, RequestState
from services.scheduler.core.state import SchedulerState


def _priority_key(request: Request) -> tuple[int, int]:
    return request.priority_key


def unallocated(kv: KVManager, request: Request, claimed: int = 0) -> Commitment:
    """Blocks of the request's footprint it does not hold yet (nor would get from a
    ``claimed`` prefix hit), split into its prompt's and its decode's."""
    held = kv.num_held_blocks(request.request_id) + claimed
    prompt = max(0, kv.blocks_for(request.num_prompt_tokens) - held)
    total = max(0, kv.blocks_for(request.kv_footprint_tokens) - held)
    return Commitment(prompt=prompt, decode=total - prompt)


def footprint(kv: KVManager, request: Request) -> Commitment:
    """The request's whole footprint, split like ``unallocated`` (its upper bound)."""
    prompt = kv.blocks_for(request.num_prompt_tokens)
    return Commitment(prompt=prompt, decode=kv.blocks_for(request.kv_footprint_tokens) - prompt)


def committed(state: SchedulerState) -> Commitment:
    """What the running requests will still allocate, exactly."""
    return sum((unallocated(state.kv, r) for r in state.running), Commitment())


def insert_running(state: SchedulerState, request: Request) -> None:
    # queue order; after equal keys (there are none: arrival_seq is unique)
    bisect.insort_right(state.running, request, key=_priority_key)


def preempt(state: SchedulerState, request: Request, for_request_id: str = "") -> None:
    """Recompute-style preemption: free KV, keep outputs, requeue at its old priority."""
    _record_preemption(state, request, for_request_id)
    _release_kv(state, request)
    request.note_dropped_prefill()
    state.kv.free(request.request_id)
    state.running.remove(request)
    request.incarnation += 1
    request.state = RequestState.WAITING
    request.reset_prefill(origin=0)
    state.pending_finished.append(request.request_id)
    if request in state.pending_new:
        state.pending_new.remove(request)
    heapq.heappush(state.waiting, (request.priority_key, request))
    state.stats.num_preemptions += 1


def finish(state: SchedulerState, request: Request, reason: str, events: list[StreamEvent]) -> None:
    """Ends the request (running or waiting) and appends its finished event."""
    request.state = RequestState.FINISHED
    request.finish_reason = reason
    if request.kv_source is not None:  # ended before its pull started: never read
        state.unused_handoffs.append(request.kv_source)
        request.kv_source = None
    running = request in state.running
    if running:
        _release_kv(state, request)
    state.kv.free(request.request_id)
    if running:
        state.running.remove(request)
        state.pending_finished.append(request.request_id)
    if request in state.pending_new:
        state.pending_new.remove(request)
    state.requests.pop(request.request_id, None)
    shed = request.num_shed_tokens
    # the public event gives every token's budget (max_loops where none was lowered)
    full = request.params.max_loops
    budgets = [full if b is None else b for b in request.output_loop_budgets] if shed else None
    events.append(
        FinishedEvent(
            request_id=request.request_id,
            finish_reason=reason,
            token_ids=list(request.output_token_ids),
            exit_depths=list(request.output_exit_loops),
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            shed_tokens=shed,
            depth_budgets=budgets,
            prefill_rows=request.num_prefill_rows,
        )
    )


def detach(state: SchedulerState, request: Request, holder: str) -> list[list[int]]:
    """Ends a running request without freeing its KV, which ``holder`` keeps (a prefill
    shard's handoff: the decode shard reads it from there). Returns its block tables."""
    _release_kv(state, request)
    tables = state.kv.detach(request.request_id, holder)
    state.running.remove(request)
    state.pending_finished.append(request.request_id)
    if request in state.pending_new:
        state.pending_new.remove(request)
    state.requests.pop(request.request_id, None)
    request.state = RequestState.FINISHED
    request.finish_reason = "handoff"
    return tables


def _record_preemption(state: SchedulerState, request: Request, for_request_id: str) -> None:
    decoding = request.state is RequestState.RECURRENT
    prompt = request.num_prompt_tokens if decoding else request.prefill_right(0)
    output = request.num_computed_tokens - request.num_prompt_tokens if decoding else 0
    state.pending_preemptions.append(
        Preemption(
            seq=state.next_seq,
            request_id=request.request_id,
            for_request_id=for_request_id,
            prompt_tokens=prompt,
            output_tokens=max(0, output),
            blocks=state.kv.num_held_blocks(request.request_id),
            incarnation=request.incarnation + 1,  # preempt bumps it next
        )
    )


def _release_kv(state: SchedulerState, request: Request) -> None:
    """A running request gives its KV back (it leaves ``running``): what its reservation
    never wrote is waste."""
    state.running_footprints -= footprint(state.kv, request)
    if state.config.kv_admission is KVAdmission.RESERVE:
        unused = unallocated(state.kv, request)
        state.stats.num_reserved_unused_blocks += unused.prompt + unused.decode
