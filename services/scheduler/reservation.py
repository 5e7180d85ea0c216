"""When a refused head of the queue could start, and which requests finish before then
(backfilling, as batch job schedulers do it: a job may jump the queue if it ends before the
first waiting job's reserved start).

Everything here counts engine steps, estimated from above: a request's remaining prompt in
chunks plus one step per loop of each token it may still generate, at its ``max_loops``.
Estimates, not guarantees: a step whose token budget is spent elsewhere delays a request past
its estimate, and early exit or a stop token ends it sooner. Both sides of every comparison
are estimated the same way, so their order is what matters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from services.scheduler.kv_admission import Commitment
from services.scheduler.request import Request


def steps_left(request: Request, chunk_size: int) -> int:
    """Engine steps until ``request`` finishes if every token runs all its loops: what is
    left of its prompt (one chunk a step, then one step per loop for the wavefront's deeper
    levels), and its ungenerated tokens at ``max_loops`` steps each."""
    loops = request.params.max_loops or request.total_ut_steps
    ranges = request.prefill_depth_ranges
    done = ranges[-1][1] if ranges else 0
    prompt_left = max(0, request.num_prompt_tokens - done)
    prompt_steps = -(-prompt_left // chunk_size) + loops if prompt_left else 0
    tokens_left = max(0, request.params.max_tokens - len(request.output_token_ids))
    return prompt_steps + tokens_left * loops - request.decode_depth


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
