"""Token-sparse prefill in the scheduler, with a fake worker: a window's sparse loop waits
for the whole window at the loop before, is charged (and cut into fragments) by its active
rows, moves the depth's frontier over the whole window with its last fragment, and prefix
hits stop at window boundaries under a hash that includes the retention."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from messages.batch import BatchResult, RowKind, RowResult
from messages.errors import RequestError
from messages.sampling import SamplingParams
from services.common.config import ModelLimits, SchedulerConfig
from services.common.sparse_prefill import FLASHLOOP_RETENTION, SparseSchedule
from services.scheduler.core.batch import ScheduledBatch
from services.scheduler.core.running import preempt
from services.scheduler.core.scheduler import Scheduler

pytestmark = pytest.mark.unit

D = 4
LIMITS = ModelLimits(
    total_ut_steps=D, vocab_size=100, max_position_embeddings=4096, eos_token_ids=(0,)
)
SPARSE = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, token_sparse_prefill=True)
SCHEDULE = SparseSchedule.of(8, FLASHLOOP_RETENTION)


def fake_result(batch: ScheduledBatch, token: int = 7) -> BatchResult:
    rows = []
    for i, task in enumerate(batch.tasks):
        if task.kind == RowKind.DECODE:
            rows.append(RowResult(row_index=i, exited=True, exit_loops=1, token_id=token))
        else:
            rows.append(RowResult(row_index=i, token_id=token if task.compute_logits else -1))
    return BatchResult(seq=batch.seq, rows=rows)


def config(**overrides: object) -> SchedulerConfig:
    base: dict[str, object] = dict(
        prefill_chunk_size=4,
        max_num_batched_tokens=64,
        block_size=4,
        num_blocks=512,
        sparse_window=8,
        async_scheduling=False,
    )
    base.update(overrides)
    return SchedulerConfig(**base)  # type: ignore[arg-type]


def run(s: Scheduler, check: object = None) -> list[ScheduledBatch]:
    """Runs to completion (sync); ``check(s, batch, rights_before)`` sees each batch."""
    batches = []
    for _ in range(10_000):
        if not s.has_unfinished_requests():
            return batches
        before = {rid: [r for _, r in req.prefill_depth_ranges] for rid, req in s.requests.items()}
        batch = s.schedule()
        if batch is None:
            continue
        if callable(check):
            check(s, batch, before)
        batches.append(batch)
        s.update_after_submission(batch)
        s.update_from_output(batch, fake_result(batch))
    raise AssertionError("the scheduler made no progress")


@pytest.mark.parametrize("wavefront", [True, False])
@pytest.mark.parametrize("budget", [64, 5, 1])
def test_sparse_loop_waits_for_its_whole_window_and_is_charged_its_active_rows(
    wavefront: bool, budget: int
) -> None:
    s = Scheduler(
        config(
            max_num_batched_tokens=budget,
            split_prefill=True,
            wavefront_chunked_prefill=wavefront,
        ),
        LIMITS,
    )
    prompt = list(range(1, 21))  # windows [0, 8), [8, 16), [16, 20)
    s.add_request("a", prompt, SPARSE)
    fragments: dict[tuple[int, int], list[tuple[int, int]]] = {}

    def check(s: Scheduler, batch: ScheduledBatch, before: dict[str, list[int]]) -> None:
        assert sum(t.budget_rows for t in batch.tasks) <= budget
        for t in batch.tasks:
            if t.kind is not RowKind.PREFILL:
                continue
            if t.depth < SCHEDULE.first_sparse_loop:
                assert not t.is_fragment
                continue
            # a whole window, ready as of the start of the step at the loop before
            start, end = SCHEDULE.window_bounds(t.token_start, len(prompt))
            assert (t.token_start, t.token_end) == (start, end)
            assert before["a"][t.depth - 1] >= end
            assert t.window_active == SCHEDULE.active_count(t.depth, end - start)
            assert t.num_loops == 1 and t.active_count >= 1
            assert t.compute_logits == (
                t.depth == D - 1
                and end == len(prompt)
                and t.active_start + t.active_count == t.window_active
            )
            fragments.setdefault((start, t.depth), []).append((t.active_start, t.active_count))

    batches = run(s, check)
    assert batches
    # every window's sparse loops ran as consecutive fragments covering its active rows
    for start in (0, 8, 16):
        length = min(start + 8, 20) - start
        for depth in (2, 3):
            parts = fragments[(start, depth)]
            at = 0
            for first, count in parts:
                assert first == at
                at += count
            assert at == SCHEDULE.active_count(depth, length)
            if budget == 1:
                assert len(parts) == at  # one row per fragment
    # rows computed: 2 dense loops of 20 tokens, then a quarter and a tenth per window
    counts = [SCHEDULE.active_counts(n) for n in (8, 8, 4)]
    assert s.stats.num_prefill_rows == sum(sum(c) for c in counts)
    assert s.stats.num_prefill_rows_saved == 20 * D - s.stats.num_prefill_rows


def test_frontier_moves_with_the_last_fragment_only() -> None:
    s = Scheduler(config(max_num_batched_tokens=1), LIMITS)
    s.add_request("a", list(range(1, 9)), SPARSE)  # one window of 8: loop 2 keeps 2 tokens
    seen = []

    def check(s: Scheduler, batch: ScheduledBatch, before: dict[str, list[int]]) -> None:
        for t in batch.tasks:
            if t.is_fragment and t.depth == 2:
                seen.append((t.active_start, before["a"][2]))

    run(s, check)
    assert seen == [(0, 0), (1, 0)]  # the second fragment still saw the frontier at 0


def test_a_window_preempted_between_its_fragments_starts_over_at_rank_0() -> None:
    """The worker's window state goes with the incarnation: after a preemption the window's
    loop is chosen again, so its first fragment must be at rank 0, not where the old
    incarnation stopped."""
    s = Scheduler(config(max_num_batched_tokens=1), LIMITS)
    s.add_request("a", list(range(1, 9)), SPARSE)  # loop 2 keeps 2 tokens: 2 fragments
    request = s.requests["a"]
    for _ in range(1000):
        if request.sparse_rows_done and request.sparse_rows_done[2]:
            break
        batch = s.schedule()
        assert batch is not None
        s.update_after_submission(batch)
        s.update_from_output(batch, fake_result(batch))
    assert request.sparse_rows_done[2] == 1  # mid-window
    preempt(s._state, request)
    after = []

    def check(s: Scheduler, batch: ScheduledBatch, before: dict[str, list[int]]) -> None:
        after.extend((t.depth, t.active_start) for t in batch.tasks if t.is_fragment)

    run(s, check)
    assert after[:2] == [(2, 0), (2, 1)]


def test_prefix_hits_stop_at_window_boundaries_and_never_cross_settings() -> None:
    s = Scheduler(config(enable_prefix_caching=True), LIMITS)
    shared = list(range(1, 21))
    s.add_request("writer", [*shared, 50, 51, 52, 53, 54], SPARSE)
    run(s)
    # the writer published the blocks before its last window ([24, 25)): positions 0-23.
    # A reader sharing 20 tokens matches 5 of them and claims 2 whole windows; a dense
    # reader, or one under another retention, claims nothing (other hashes)
    other = SamplingParams(max_tokens=2, prefill_retention=[1, 1, 0.5, 0.1])
    cached = {}
    for rid, params in (
        ("dense", SamplingParams(max_tokens=2)),
        ("other", other),
        ("reader", SPARSE),
    ):
        s.add_request(rid, [*shared, 60, 61, 62, 63, 64], params)
        assert s.schedule() is not None  # admits it and claims its prefix
        cached[rid] = s.requests[rid].num_cached_tokens
        s.abort_request(rid)
    assert cached == {"reader": 16, "dense": 0, "other": 0}


def test_a_prompts_last_window_is_never_published() -> None:
    """The last window's active tokens include the prompt's last token, which a longer
    prompt sharing it would not force: even a whole last window (the prompt ends on a window
    and block boundary) is not another prompt's to claim."""
    s = Scheduler(config(enable_prefix_caching=True), LIMITS)
    writer = list(range(1, 17))  # windows [0, 8) and [8, 16), the last one whole
    s.add_request("writer", writer, SPARSE)
    run(s)
    s.add_request("reader", [*writer, 30, 31, 32, 33, 34], SPARSE)
    assert s.schedule() is not None
    assert s.requests["reader"].num_cached_tokens == 8
    s.abort_request("reader")


def test_options_refused_where_they_cannot_run() -> None:
    atomic = Scheduler(config(split_prefill=False, wavefront_chunked_prefill=False), LIMITS)
    with pytest.raises(RequestError, match="atomic prefill"):
        atomic.add_request("a", [1, 2, 3], SPARSE)
    with pytest.raises(ValueError, match="atomic prefill"):
        config(split_prefill=False, wavefront_chunked_prefill=False, token_sparse_prefill=True)
    with pytest.raises(ValueError, match="sparse_window must be >= 1"):
        config(sparse_window=0)
    with pytest.raises(ValueError, match="prefill_retention"):
        config(prefill_retention=(0.5, 1.0, 1.0, 1.0))
    s = Scheduler(config(), LIMITS)
    with pytest.raises(RequestError, match="4 loops"):
        s.add_request("b", [1, 2, 3], SamplingParams(prefill_retention=[1, 0.5]))
    assert not s.requests  # a refused request changes nothing


def test_server_default_applies_to_requests_that_do_not_choose() -> None:
    s = Scheduler(config(token_sparse_prefill=True, prefill_retention=(1, 0.5, 0.5, 0.5)), LIMITS)
    s.add_request("a", list(range(1, 9)), SamplingParams(max_tokens=1))
    s.add_request("b", list(range(1, 9)), SamplingParams(max_tokens=1, token_sparse_prefill=False))
    sparse = s.requests["a"].sparse
    assert sparse is not None and sparse.retention == (1.0, 0.5, 0.5, 0.5)
    assert s.requests["b"].sparse is None
    run(s)
    assert s.stats.num_prefill_rows == 8 + 4 + 4 + 4 + 8 * D
    assert math.isclose(s.stats.num_prefill_rows_saved, 12)


def test_schedule_trace_shows_fragments_with_their_active_rows(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from services.cli import main
    from services.worker.model.toy import write_toy_checkpoint

    ckpt = write_toy_checkpoint(tmp_path / "ckpt", seed=0, size="toy")
    common = [
        "schedule-trace", "--checkpoint", str(ckpt), "--prompt-ids",
        ",".join(str(i) for i in range(1, 21)), "--token-sparse-prefill", "--sparse-window", "8",
        "--prefill-chunk-size", "4", "--block-size", "4", "--max-tokens", "2",
        "--max-num-batched-tokens", "1",
    ]  # fmt: skip
    assert main(common) == 0
    text = capsys.readouterr().out
    # window [0, 8) keeps 2 tokens at depth 2, cut into fragments of one row by the budget
    assert "(a,0,8,2,active[0..1)/2)" in text and "(a,0,8,2,active[1..2)/2)" in text
    assert "prefill_rows=48 prefill_rows_saved=32" in text
    assert main([*common, "--json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    fragments = [
        (row, active)
        for r in records
        for row, active in zip(r["rows"], r["active"], strict=True)
        if active is not None
    ]
    assert (["a", 0, 8, 2], [1, 1, 2]) in fragments
    prompt_rows = [
        c
        for r in records
        for c, kind in zip(r["core_rows"], r["kinds"], strict=True)
        if kind == "prefill"
    ]
    assert sum(prompt_rows) == 48


def test_prompt_rows_are_metrics() -> None:
    from prometheus_client import generate_latest

    from services.scheduler.driver.telemetry import SchedulerTelemetry

    s = Scheduler(config(), LIMITS)
    s.add_request("a", list(range(1, 21)), SPARSE)
    s.add_request("b", list(range(1, 11)), SamplingParams(max_tokens=1))
    telemetry = SchedulerTelemetry(lambda: s, total_ut_steps=D, prefix_caching=False)
    run(s)
    text = generate_latest(telemetry.registry).decode()
    values = {
        line.split()[0]: float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("rlt:prefill_rows")
    }
    assert values == {"rlt:prefill_rows_total": 48 + 40, "rlt:prefill_rows_saved_total": 32}
