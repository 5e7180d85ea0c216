"""The one progress path (DESIGN.md §3, the seed review's test plan): submission-time
progress with batches really in flight, multi-depth updates, prefix publication at
submission, sync/async equivalence of frontiers, and the error paths of the frontier
writer. Pure scheduler: no model, a fake worker."""

from __future__ import annotations

import pytest

from messages.batch import BatchKind, BatchResult, RowKind, RowResult
from messages.prefix import BlockStored, prompt_block_hashes
from messages.sampling import SamplingParams
from services.common.config import ModelLimits, SchedulerConfig
from services.scheduler.core.batch import ScheduledBatch, ScheduledTask
from services.scheduler.core.request import RequestState
from services.scheduler.core.running import insert_running
from services.scheduler.core.scheduler import Scheduler, SchedulerInvariantError
from services.scheduler.core.selection import Selection

pytestmark = pytest.mark.unit

D = 4
LIMITS = ModelLimits(
    total_ut_steps=D, vocab_size=100, max_position_embeddings=4096, eos_token_ids=(0,)
)
PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


def fake_result(batch: ScheduledBatch, token: int = 7) -> BatchResult:
    """Decode rows exit after one loop; coda rows sample ``token``."""
    rows = []
    for i, task in enumerate(batch.tasks):
        if task.kind == RowKind.DECODE:
            rows.append(RowResult(row_index=i, exited=True, exit_loops=1, token_id=token))
        else:
            rows.append(RowResult(row_index=i, token_id=token if task.compute_logits else -1))
    return BatchResult(seq=batch.seq, rows=rows)


def rights(s: Scheduler, rid: str) -> list[int]:
    return [r for _, r in s.requests[rid].prefill_depth_ranges]


# ---------------------------------------------------------------------- submission path
def test_multi_depth_split_update_at_submission_publishes_blocks_while_in_flight() -> None:
    """Async, depth-serial split prefill with prefix caching: each RECURRENT task runs all D
    depths of a chunk. The progress (every depth's frontier, chunk retirement, block
    publication) is applied when the batch is submitted, while earlier batches are still in
    flight, and the outputs applied later change no frontier again."""
    config = SchedulerConfig(
        split_prefill=True,
        prefill_chunk_size=4,
        max_num_batched_tokens=64,
        block_size=4,
        num_blocks=256,
        enable_prefix_caching=True,
        async_scheduling=True,
    )
    s = Scheduler(config, LIMITS)
    prompt = list(range(1, 13))
    s.add_request("a", prompt, PARAMS)
    hashes = prompt_block_hashes(prompt, 4)
    inflight: list[ScheduledBatch] = []

    prelude = s.schedule()
    assert prelude is not None and prelude.kind == BatchKind.PREFILLING_PRELUDE
    s.update_after_submission(prelude)
    inflight.append(prelude)
    assert s.requests["a"].num_preluded_tokens == 12  # advanced at submission

    first = s.schedule()  # builds on the prelude still in flight
    assert first is not None
    (task,) = first.tasks
    assert (task.token_start, task.token_count, task.depth, task.num_loops) == (0, 4, 0, D)
    s.update_after_submission(first)
    inflight.append(first)
    assert rights(s, "a") == [4] * D  # several depths of one request in one update
    assert s.requests["a"].prefill_reclaimable_tokens == 4
    envelope = s.take_prefix_events()
    assert envelope is not None
    (stored,) = envelope.events
    assert isinstance(stored, BlockStored)
    assert (stored.block_hashes, stored.batch_seq) == ([hashes[0]], first.seq)

    second = s.schedule()  # two batches still in flight
    assert second is not None and [t.key() for t in second.tasks] == [("a", 4, 4, 0)]
    s.update_after_submission(second)
    inflight.append(second)
    assert rights(s, "a") == [8] * D
    envelope = s.take_prefix_events()
    assert envelope is not None and envelope.events[0].block_hashes == [hashes[1]]

    # the outputs arrive afterwards, in order: frontiers and publications stay as they are
    for batch in inflight:
        assert s.update_from_output(batch, fake_result(batch)) == []
    assert rights(s, "a") == [8] * D
    assert s.take_prefix_events() is None


def test_a_second_submission_of_one_batch_raises_instead_of_double_counting() -> None:
    config = SchedulerConfig(split_prefill=True, prefill_chunk_size=4, async_scheduling=True)
    s = Scheduler(config, LIMITS)
    s.add_request("a", list(range(1, 9)), PARAMS)
    batch = s.schedule()
    assert batch is not None
    s.update_after_submission(batch)
    before = (s.requests["a"].num_preluded_tokens, s.requests["a"].inflight_batches)
    with pytest.raises(SchedulerInvariantError, match="submitted twice"):
        s.update_after_submission(batch)
    assert (s.requests["a"].num_preluded_tokens, s.requests["a"].inflight_batches) == before


@pytest.mark.parametrize("wavefront", [False, True])
def test_sync_and_async_reach_the_same_frontiers_after_every_batch(wavefront: bool) -> None:
    """The submission path (async) and the output path (sync) leave the same frontiers,
    prelude frontier, retirement point and state after every batch, and the same events."""

    def run(async_scheduling: bool) -> tuple[list, list]:
        config = SchedulerConfig(
            max_num_seqs=2,
            max_num_batched_tokens=5,
            prefill_chunk_size=2,
            split_prefill=True,
            wavefront_chunked_prefill=wavefront,
            async_scheduling=async_scheduling,
        )
        s = Scheduler(config, LIMITS)
        s.add_request("a", list(range(1, 11)), PARAMS)
        s.add_request("b", list(range(11, 18)), PARAMS)
        states, events = [], []
        for batch in iter(s.schedule, None):
            s.update_after_submission(batch)
            events += s.update_from_output(batch, fake_result(batch))
            states.append(
                [
                    (
                        r.request_id,
                        str(r.state),
                        r.num_preluded_tokens,
                        [right for _, right in r.prefill_depth_ranges],
                        r.prefill_reclaimable_tokens,
                    )
                    for r in s.running
                ]
            )
        return states, events

    sync_states, sync_events = run(False)
    async_states, async_events = run(True)
    assert len(sync_states) >= 10
    assert async_states == sync_states
    assert async_events == sync_events


# ---------------------------------------------------------------------- error paths
def split_request(s: Scheduler) -> object:
    s.add_request("a", list(range(1, 11)), PARAMS)
    request = s.requests["a"]
    request.reset_prefill(origin=0)
    request.state = RequestState.PREFILLING_PRELUDE
    return request


def task(request, kind: RowKind, start: int, count: int, depth: int = 0, loops: int = 1):
    return ScheduledTask(
        request=request,
        kind=kind,
        token_start=start,
        token_count=count,
        depth=depth,
        num_loops=loops,
    )


def test_a_gap_in_prelude_spans_raises_and_moves_nothing() -> None:
    s = Scheduler(SchedulerConfig(split_prefill=True), LIMITS)
    request = split_request(s)
    spans = [task(request, RowKind.PRELUDE, 0, 2), task(request, RowKind.PRELUDE, 3, 2)]
    with pytest.raises(SchedulerInvariantError, match="prelude span starts at 3"):
        s._progress._apply_prelude_spans(request, spans)
    assert request.num_preluded_tokens == 0
    with pytest.raises(SchedulerInvariantError, match="prelude span starts at 2"):
        s._progress._apply_prelude_spans(request, [task(request, RowKind.PRELUDE, 2, 2)])
    # contiguous spans in any order merge into one advance
    s._progress._apply_prelude_spans(
        request, [task(request, RowKind.PRELUDE, 2, 3), task(request, RowKind.PRELUDE, 0, 2)]
    )
    assert request.num_preluded_tokens == 5


def test_a_span_ending_beyond_the_shallower_frontier_raises() -> None:
    s = Scheduler(SchedulerConfig(split_prefill=True), LIMITS)
    request = split_request(s)
    request.num_preluded_tokens = 6
    with pytest.raises(SchedulerInvariantError, match="beyond the prelude's frontier 6"):
        s._progress._advance_prefill_depth_frontier(request, 0, 0, 8, 1)
    s._progress._advance_prefill_depth_frontier(request, 0, 0, 6, 1)
    with pytest.raises(SchedulerInvariantError, match="beyond depth 0's frontier 6"):
        s._progress._advance_prefill_depth_frontier(request, 1, 0, 7, 1)
    assert rights(s, "a") == [6, 0, 0, 0]
    # a multi-depth task moves every depth it runs, each bounded by the one above it
    assert s._progress._advance_prefill_depth_frontier(request, 1, 0, 4, 3) is True
    assert rights(s, "a") == [6, 4, 4, 4]
    with pytest.raises(SchedulerInvariantError, match="depth 1 task ends at 8, beyond depth 0"):
        s._progress._advance_prefill_depth_frontier(request, 1, 4, 8, 3)


@pytest.mark.parametrize("loops", [0, -1])
def test_a_task_without_loops_moves_no_frontier_and_never_reaches_the_final_depth(
    loops: int,
) -> None:
    s = Scheduler(SchedulerConfig(split_prefill=True), LIMITS)
    request = split_request(s)
    request.num_preluded_tokens = 10
    assert s._progress._advance_prefill_depth_frontier(request, 0, 0, 4, loops) is False
    assert s._progress._advance_prefill_depth_frontier(request, D, 0, 4, loops) is False
    assert rights(s, "a") == [0] * D


# ---------------------------------------------------------------------- preemption
def two_prefilling_requests() -> Scheduler:
    """y (priority 0) holds 8 of 12 blocks for its 4-token prompt; x (priority -1) needs 8
    for its own."""
    config = SchedulerConfig(
        wavefront_chunked_prefill=True,
        prefill_chunk_size=4,
        max_num_batched_tokens=64,
        block_size=2,
        num_blocks=12,
    )
    s = Scheduler(config, LIMITS)
    s.add_request("y", [1, 2, 3, 4], SamplingParams(max_tokens=1, temperature=0.0))
    s.add_request("x", [5, 6, 7, 8], SamplingParams(max_tokens=1, temperature=0.0, priority=-1))
    for rid in ("x", "y"):
        request = s.requests[rid]
        s._state.waiting.remove((request.priority_key, request))
        request.reset_prefill(origin=0)
        request.state = RequestState.PREFILLING_RECURRENT
        request.num_preluded_tokens = 4
        insert_running(s._state, request)
    assert s.kv.ensure("y", 4)  # 2 blocks x 4 planes
    assert s.kv.num_free_blocks == 4
    return s


def test_a_request_selected_by_a_prefill_row_is_never_preempted_in_that_batch() -> None:
    s = two_prefilling_requests()
    sel = Selection(budget_left=64, max_seqs=2)
    y = s.requests["y"]
    assert s._selector._accept_task(task(y, RowKind.PREFILL, 0, 4), sel) is not None
    x = s.requests["x"]
    assert s._selector._accept_task(task(x, RowKind.PREFILL, 0, 4), sel) is None  # x waits
    assert s.stats.num_preemptions == 0
    assert y.state == RequestState.PREFILLING_RECURRENT and s.kv.num_held_blocks("y") == 8


def test_contrast_an_unselected_prefill_request_is_preempted() -> None:
    s = two_prefilling_requests()
    sel = Selection(budget_left=64, max_seqs=2)
    x = s.requests["x"]
    assert s._selector._accept_task(task(x, RowKind.PREFILL, 0, 4), sel) is not None
    assert s.stats.num_preemptions == 1
    assert s.requests["y"].state == RequestState.WAITING and s.kv.num_held_blocks("y") == 0
