"""The head's reservation and the step estimates backfilling compares (reservation.py)."""

from __future__ import annotations

import math

import pytest

from messages.sampling import SamplingParams
from services.scheduler.core.kv.kv_admission import Commitment
from services.scheduler.core.kv.reservation import reserved_start, steps_left
from services.scheduler.core.request import Request

D = 4


def request(rid: str, prompt: int, max_tokens: int, max_loops: int = D) -> Request:
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, max_loops=max_loops
    ).resolve(D, 512)
    r = Request(rid, list(range(1, prompt + 1)), params, seed=0, arrival_seq=0, total_ut_steps=D)
    r.reset_prefill(origin=0)
    return r


@pytest.mark.unit
def test_steps_left_counts_prompt_chunks_then_loops_per_token() -> None:
    r = request("a", prompt=1000, max_tokens=3)
    assert steps_left(r, chunk_size=512) == 2 + D + 3 * D  # two chunks, the wavefront's depth
    # prompt done, its first token out of the prefill, the next one a loop in
    r.prefill_depth_ranges = [(0, 1000)] * D
    r.num_computed_tokens = 1000
    r.output_token_ids, r.output_exit_loops = [7], [D]
    r.decode_depth = 1
    assert steps_left(r, chunk_size=512) == 2 * D - 1
    # prefill runs every depth whatever max_loops; tokens run max_loops
    assert steps_left(request("b", 8, 3, max_loops=2), chunk_size=512) == 1 + D + 3 * 2


@pytest.mark.unit
def test_steps_left_replays_known_tokens_and_learns_their_loops() -> None:
    """A preempted (or resumed) request prefills again, then replays each known token at
    the loops it ran; what it still generates runs at the mean of those (bar the first,
    which came out of the prefill)."""
    r = request("p", prompt=8, max_tokens=6)
    r.output_token_ids, r.output_exit_loops = [7, 8, 9], [D, 1, 2]
    assert steps_left(r, chunk_size=512) == (1 + D) + (1 + 2) + math.ceil(3 * 1.5)
    # back in decode, output 1 replayed: output 2's replay is left, then 3 new tokens
    r.prefill_depth_ranges = [(0, 8)] * D
    r.num_computed_tokens = 9
    assert steps_left(r, chunk_size=512) == 2 + 5


@pytest.mark.unit
def test_the_reservation_is_when_enough_requests_have_ended_in_estimate_order() -> None:
    short, mid, long = request("s", 4, 2), request("m", 4, 6), request("l", 4, 20)
    held = {"s": 10, "m": 20, "l": 40}

    def release(r: Request) -> tuple[int, Commitment]:
        return held[r.request_id], Commitment(decode=1)

    def needs(blocks: int):
        return lambda freed, released: freed >= blocks and released.decode >= 1

    running = [long, short, mid]  # order given does not matter
    assert reserved_start(running, 512, release, needs(10)) == steps_left(short, 512)
    assert reserved_start(running, 512, release, needs(25)) == steps_left(mid, 512)
    assert reserved_start(running, 512, release, needs(70)) == steps_left(long, 512)
    assert reserved_start(running, 512, release, needs(71)) is None
