"""Split and wavefront chunked prefill (DESIGN.md §3, the seed review): depth-major selection,
budget truncation, row order, the one progress path, and preemption protection."""

from __future__ import annotations

import pytest

from messages.api import FinishedEvent
from messages.batch import BatchKind
from messages.sampling import SamplingParams
from services.common.config import KVAdmission, ModelLimits, SchedulerConfig
from services.scheduler.core.batch import ScheduledBatch
from services.scheduler.core.request import RequestState
from services.scheduler.core.scheduler import Scheduler, SchedulerInvariantError
from tests.helpers import fake_result

pytestmark = pytest.mark.unit

D = 4
LIMITS = ModelLimits(
    total_ut_steps=D, vocab_size=100, max_position_embeddings=4096, eos_token_ids=(0,)
)
ONE_TOKEN = SamplingParams(max_tokens=1, min_loops=1, max_loops=1, temperature=0.0)


def drive(scheduler: Scheduler, max_steps: int = 500) -> list[ScheduledBatch]:
    batches = []
    for _ in range(max_steps):
        batch = scheduler.schedule()
        if batch is None:
            assert not scheduler.has_unfinished_requests()
            return batches
        batches.append(batch)
        scheduler.update_after_submission(batch)
        scheduler.update_from_output(batch, fake_result(batch))
    raise AssertionError("no progress")


def two_prompt_scheduler(budget: int, chunk: int = 2, **kw) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=2,
        max_num_batched_tokens=budget,
        prefill_chunk_size=chunk,
        wavefront_chunked_prefill=True,
        **kw,
    )
    s = Scheduler(config, LIMITS)
    s.add_request("a", list(range(1, 11)), ONE_TOKEN)
    s.add_request("b", list(range(11, 21)), ONE_TOKEN)
    return s


def test_seed_regression_first_prelude_batch() -> None:
    prelude = two_prompt_scheduler(budget=5).schedule()
    assert prelude is not None
    assert prelude.kind == BatchKind.PREFILLING_PRELUDE
    # selected depth-major (a:0-2, b:0-2, then a:2-3 truncated by the budget of 5);
    # emitted grouped by request, in token order
    assert [t.key()[:3] for t in prelude.tasks] == [("a", 0, 2), ("a", 2, 1), ("b", 0, 2)]


# ---------------------------------------------------------------------- reference model
def reference_schedule(
    lengths: dict[str, int], chunk: int, budget: int, seats: int, depths: int
) -> list[list[tuple[str, int, int, int]]]:
    """An independent model of the scheduling rules, written from DESIGN.md §3:
    batch kind choice, depth-major levels, budget truncation, (request, start) row order."""
    order = list(lengths)
    pre = dict.fromkeys(order, 0)
    right = {r: [0] * depths for r in order}
    steps: list[list[tuple[str, int, int, int]]] = []

    def chunk_end(r: str, s: int) -> int:
        return min((s // chunk + 1) * chunk, lengths[r])

    def prelude_batch() -> list[tuple[str, int, int, int]]:
        cursor = dict(pre)
        left, chosen, rows = budget, set(), []
        while True:
            advanced = False
            for r in order:
                if cursor[r] >= lengths[r] or (r not in chosen and len(chosen) >= seats):
                    continue
                n = min(chunk_end(r, cursor[r]) - cursor[r], left)
                rows.append((r, cursor[r], n, 0))
                cursor[r] += n
                left -= n
                chosen.add(r)
                advanced = True
                if left == 0:
                    return rows
            if not advanced:
                return rows

    def recurrent_batch() -> list[tuple[str, int, int, int]]:
        left, chosen, rows = budget, set(), []
        for d in range(depths):
            for r in order:
                s = right[r][d]
                limit = pre[r] if d == 0 else right[r][d - 1]
                e = min(chunk_end(r, s), limit) if s < lengths[r] else s
                if e <= s or (r not in chosen and len(chosen) >= seats):
                    continue
                n = min(e - s, left)
                rows.append((r, s, n, d))
                left -= n
                chosen.add(r)
                if left == 0:
                    return rows
        return rows

    while any(right[r][-1] < lengths[r] for r in order):
        starved = any(pre[r] < lengths[r] and right[r][0] >= pre[r] for r in order)
        makers = [prelude_batch, recurrent_batch] if starved else [recurrent_batch, prelude_batch]
        rows: list[tuple[str, int, int, int]] = []
        prelude = False
        for make in makers:
            rows = make()
            if rows:
                prelude = make is prelude_batch
                break
        assert rows, "reference model stalled"
        rows.sort(key=lambda t: (order.index(t[0]), t[1]))
        for r, s, n, d in rows:  # progress as of the end of the step
            if prelude:
                pre[r] = max(pre[r], s + n)
            else:
                right[r][d] = s + n
        steps.append(rows)
    return steps


@pytest.mark.parametrize("budget", [3, 5, 8])
def test_every_task_of_the_run_equals_the_reference_model(budget: int) -> None:
    batches = drive(two_prompt_scheduler(budget=budget))
    actual = [[t.key() for t in b.tasks] for b in batches]
    expected = reference_schedule({"a": 10, "b": 10}, chunk=2, budget=budget, seats=2, depths=D)
    assert actual == expected


# ---------------------------------------------------------------------- progress path
def test_split_prefill_advances_several_depths_in_one_update() -> None:
    """Depth-serial split prefill runs every level depth of a span in one task: one update
    moves all D frontiers, retires the chunk and (at the prompt end) reaches the coda."""
    config = SchedulerConfig(split_prefill=True, prefill_chunk_size=4, max_num_batched_tokens=64)
    s = Scheduler(config, LIMITS)
    s.add_request("a", list(range(1, 11)), SamplingParams(max_tokens=2, temperature=0.0))
    prelude = s.schedule()
    assert prelude is not None and prelude.kind == BatchKind.PREFILLING_PRELUDE
    s.update_after_submission(prelude)
    s.update_from_output(prelude, fake_result(prelude))
    request = s.requests["a"]
    assert request.num_preluded_tokens == 10
    assert request.state == RequestState.PREFILLING_RECURRENT

    first = s.schedule()
    assert first is not None
    (task,) = first.tasks
    assert (task.token_start, task.token_count, task.depth, task.num_loops) == (0, 4, 0, D)
    s.update_after_submission(first)
    assert s.update_from_output(first, fake_result(first)) == []
    assert [r for _, r in request.prefill_depth_ranges] == [4] * D
    assert request.prefill_reclaimable_tokens == 4

    events = []
    for _ in range(2):
        batch = s.schedule()
        assert batch is not None
        s.update_after_submission(batch)
        events += s.update_from_output(batch, fake_result(batch, token=9))
    assert [r for _, r in request.prefill_depth_ranges] == [10] * D
    assert request.prefill_reclaimable_tokens == 10
    # the coda's token is forwarded to the client stream exactly once
    assert [(e.index, e.token_id, e.exit_depth) for e in events] == [(0, 9, D)]
    assert request.state == RequestState.RECURRENT


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_submission_and_output_paths_give_the_same_events_and_state(async_scheduling) -> None:
    s = two_prompt_scheduler(budget=5, async_scheduling=async_scheduling)
    events, frontiers = [], []
    for batch in iter(s.schedule, None):
        s.update_after_submission(batch)
        events += s.update_from_output(batch, fake_result(batch))
        frontiers.append({r.request_id: [x for _, x in r.prefill_depth_ranges] for r in s.running})
    # both paths finish both requests with one token each, same order
    finished = [e for e in events if isinstance(e, FinishedEvent)]
    assert [(e.request_id, e.token_ids) for e in finished] == [("a", [7]), ("b", [7])]
    reference = two_prompt_scheduler(budget=5, async_scheduling=not async_scheduling)
    other, other_frontiers = [], []
    for batch in iter(reference.schedule, None):
        reference.update_after_submission(batch)
        other += reference.update_from_output(batch, fake_result(batch))
        other_frontiers.append(
            {r.request_id: [x for _, x in r.prefill_depth_ranges] for r in reference.running}
        )
    assert other == events
    assert other_frontiers == frontiers


def test_async_progress_lets_the_next_batch_build_on_the_one_in_flight() -> None:
    s = two_prompt_scheduler(budget=5, async_scheduling=True)
    first = s.schedule()
    assert first is not None
    s.update_after_submission(first)  # no output yet
    second = s.schedule()
    assert second is not None and second.kind == BatchKind.RECURRENT
    assert [t.key() for t in second.tasks] == [("a", 0, 2, 0), ("b", 0, 2, 0)]


def test_out_of_order_retirement_and_gapped_spans_raise() -> None:
    s = two_prompt_scheduler(budget=8)
    request = s.requests["a"]
    request.reset_prefill(origin=0)
    request.num_preluded_tokens = 10
    with pytest.raises(SchedulerInvariantError, match="frontier"):
        s._progress._advance_prefill_depth_frontier(request, 0, 2, 4, 1)  # starts past right_0
    request.prefill_depth_ranges = [(0, 10), (0, 10), (0, 10), (0, 2)]
    with pytest.raises(SchedulerInvariantError, match="out of prompt order"):
        s._progress._retire_prefill_chunk(request, 2, 4, batch_seq=0)  # chunk [0, 2) never retired


def decoding_low_priority_request(wavefront: bool) -> Scheduler:
    """y (priority 0) has finished its prefill and decodes; its KV fills 8 of 16 blocks.
    Incremental admission: x starts at once and its capacity check at selection is what
    may preempt (reserve / watermark would preempt y for x at admission instead)."""
    config = SchedulerConfig(
        kv_admission=KVAdmission.INCREMENTAL,
        wavefront_chunked_prefill=wavefront,
        prefill_chunk_size=4,
        max_num_batched_tokens=64,
        block_size=2,
        num_blocks=16,
    )
    s = Scheduler(config, LIMITS)
    s.add_request("y", [1, 2, 3, 4], SamplingParams(max_tokens=3, temperature=0.0))
    while s.requests["y"].state != RequestState.RECURRENT or s.requests["y"].awaiting_output:
        batch = s.schedule()
        assert batch is not None
        s.update_after_submission(batch)
        s.update_from_output(batch, fake_result(batch))
    assert s.kv.num_held_blocks("y") == 8  # 4 positions: 2 blocks in each of 4 planes
    # x outranks y and needs 8 blocks for its first chunk
    s.add_request(
        "x", [5, 6, 7, 8, 9, 10, 11, 12], SamplingParams(max_tokens=1, temperature=0.0, priority=-1)
    )
    return s


def test_a_request_selected_earlier_is_never_preempted_by_a_later_candidate() -> None:
    """In a RECURRENT batch y's decode row is selected first (taking 4 more blocks), so x's
    capacity check must not preempt y even though x has the higher priority: x waits."""
    s = decoding_low_priority_request(wavefront=True)
    prelude = s.schedule()  # x's prelude needs no KV
    assert prelude is not None and prelude.kind == BatchKind.PREFILLING_PRELUDE
    s.update_after_submission(prelude)
    s.update_from_output(prelude, fake_result(prelude))

    batch = s.schedule()
    assert batch is not None and batch.kind == BatchKind.RECURRENT
    assert [t.key()[0] for t in batch.tasks] == ["y"]
    assert s.stats.num_preemptions == 0
    assert s.requests["y"].state == RequestState.RECURRENT


def test_contrast_a_batch_without_the_victim_does_preempt_it() -> None:
    """An atomic PREFILL batch does not select y's decode row, so x may preempt y."""
    s = decoding_low_priority_request(wavefront=False)
    decode = s.schedule()  # atomic prefill and decode alternate: y decodes first
    assert decode is not None and [t.key()[0] for t in decode.tasks] == ["y"]
    s.update_after_submission(decode)
    s.update_from_output(decode, fake_result(decode))
    assert s.kv.num_held_blocks("y") == 12
    batch = s.schedule()
    assert batch is not None and batch.kind == BatchKind.PREFILL
    assert [t.key()[0] for t in batch.tasks] == ["x"]
    assert s.stats.num_preemptions == 1
    assert s.requests["y"].state == RequestState.WAITING
    assert s.kv.num_held_blocks("y") == 0
