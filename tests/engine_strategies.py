"""Hypothesis strategies for engine workloads, shared by the oracle property tests."""

from __future__ import annotations

from hypothesis import strategies as st

from messages.sampling import SamplingParams
from tests.engine_harness import Arrival

D = 4  # toy total_ut_steps
VOCAB_TRAINED = 500


@st.composite
def request_params(draw: st.DrawFn) -> SamplingParams:
    min_loops = draw(st.integers(1, D))
    max_loops = draw(st.integers(min_loops, D))
    return SamplingParams(
        max_tokens=draw(st.integers(1, 7)),
        temperature=0.0,
        min_loops=min_loops,
        max_loops=max_loops,
        exit_threshold=draw(st.sampled_from([1.0, 0.7, 0.0])),
        ignore_eos=draw(st.booleans()),
    )


@st.composite
def workloads(draw: st.DrawFn) -> list[Arrival]:
    n = draw(st.integers(1, 4))
    # often a shared prefix, so prefix caching (when drawn) has something to hit
    shared = draw(st.lists(st.integers(1, VOCAB_TRAINED), min_size=2, max_size=14))
    return [
        Arrival(
            request_id=f"r{i}",
            prompt=(shared if draw(st.booleans()) else [])
            + draw(st.lists(st.integers(1, VOCAB_TRAINED), min_size=1, max_size=12)),
            params=draw(request_params()),
            step=draw(st.sampled_from([0, 0, 1, 3, 8, 15, 25])),
        )
        for i in range(n)
    ]


def max_kv_blocks(arrivals: list[Arrival], block_size: int) -> int:
    longest = max(len(a.prompt) + a.params.max_tokens - 1 for a in arrivals)
    return -(-longest // block_size) * D
