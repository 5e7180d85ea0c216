"""When a refused head of the queue could start, and which requests finish before then
(backfilling, as batch job schedulers do it: a job may jump the queue if it ends before the
first waiting job's reserved start).

Everything here counts engine steps, estimated (``steps_left``): a request's remaining
prompt in chunks and the wavefront's depths, the known tokens it must replay, and each token
it may still generate at the loops its tokens have run so far (``max_loops`` before it has
any). Estimates, not guarantees: a step whose token budget is spent elsewhere delays a
request, and early exit or a stop token ends it sooner. Both sides of a comparison are
estimated the same way, and a request that has not generated anything yet (most candidates
for a backfill) is estimated at its ``max_loops``, so the error leans toward not passing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from services.scheduler.core.kv.kv_admission import Commitment
from services.scheduler.core.request import Request


def steps_left(request: Request, chunk_size: int) -> int:
    """Engine steps until ``request`` finishes, estimated:

    - its prompt: what its deepest level has left, one chunk a step, then one step per
      depth as the wavefront drains (prefill runs every depth, whatever ``max_loops``);
    - known tokens still to replay (after a preemption, a lost worker or a shard move): a
      decode row per loop each, at the loops it ran before;
    - tokens still to generate: at the mean loops of those it has generated after its first
      (which comes out of the prefill), or ``max_loops`` while there are none;
    - less the loops the token in progress has already run."""
    depths = request.total_ut_steps
    ranges = request.prefill_depth_ranges
    done = ranges[-1][1] if ranges else 0
    prompt_left = max(0, request.num_prompt_tokens - done)
    steps = -(-prompt_left // chunk_size) + depths if prompt_left else 0
    loops = request.output_exit_loops
    known = len(request.output_token_ids)
    # the output the next decode row produces (feeding position p produces output
    # p - prompt + 1); output 0 comes out of the prefill
    next_output = (
        1 if prompt_left else max(1, request.num_computed_tokens - request.num_prompt_tokens + 1)
    )
    steps += sum(loops[next_output:known])
    generated = loops[1:known]
    per_token = sum(generated) / len(generated) if generated else request.params.max_loops
    steps += math.ceil(max(0, request.params.max_tokens - known) * per_token)
    return max(0, steps - request.decode_depth)


def reserved_start(
    running: Iterable[Request],
    chunk_size: int,
    release: Callable[[Request], tuple[int, Commitment]],
    fits: Callable[[int, Commitment], bool],
) -> int | None:
    """The head's reservation: the estimated step (from now) at which it could start if
    nothing else started, i.e. once enough running requests have finished, taken in the
    order their estimates end. ``release(r)``: the blocks ``r`` holds and what it would still
    allocate; ``fits(freed, released)``: whether the head fits the KV policy with ``freed``
    more blocks free and ``released`` less committed. None if it never would."""
    freed, released = 0, Commitment()
    for request in sorted(running, key=lambda r: steps_left(r, chunk_size)):
        blocks, commitment = release(request)
        freed += blocks
        released += commitment
        if fits(freed, released):
            return steps_left(request, chunk_size)
    return None
