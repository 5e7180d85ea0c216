"""KV admission policies (reserve / incremental / watermark): who starts when KV is short,
what preemption and reservation waste, and that every policy still equals the oracle.

The three-request case: 8 KV blocks of 2 tokens, D=4 planes, three prompts [2, 3] with
max_tokens 3, so each request needs ceil(4/2) x 4 = 8 blocks, the whole cache, for its life.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from messages.batch import BatchKind, RowKind
from messages.sampling import SamplingParams
from services.common.config import KVAdmission, ModelLimits, SchedulerConfig
from services.common.flags import add_engine_flags, add_request_flags, scheduler_config_from_args
from services.engine.trace import run_schedule_trace
from services.scheduler.core.batch import ScheduledBatch
from services.scheduler.core.kv.kv_admission import Commitment, admits
from services.scheduler.core.request import RequestState
from services.scheduler.core.scheduler import Scheduler
from tests.engine_harness import Arrival, RunRecord, assert_matches_oracle, oracle_result
from tests.engine_harness import run_workload as run
from tests.helpers import fake_result

D = 4
THREE = [
    Arrival(name, [2, 3], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    for name in "abc"
]


def tight(policy: KVAdmission, **kw) -> SchedulerConfig:
    # the three-request case is stated for atomic prefill and sync scheduling
    kw = {"split_prefill": False, "async_scheduling": False, **kw}
    return SchedulerConfig(block_size=2, num_blocks=8, kv_admission=policy, **kw)


def prefill_steps(record: RunRecord, request_id: str) -> list[int]:
    """Batches that ran the request's prompt (from token 0, i.e. a first or a recomputed
    prefill)."""
    return [
        b.seq
        for b in record.batches
        for t in b.tasks
        if t.request.request_id == request_id and t.kind == RowKind.PREFILL and t.token_start == 0
    ]


def preemptions(record: RunRecord) -> list[tuple[str, int, str, int]]:
    return [
        (p.request_id, p.seq, p.for_request_id, p.prompt_tokens)
        for b in record.batches
        for p in b.preemptions
    ]


def assert_three_equal_oracle(record: RunRecord, oracle, config: SchedulerConfig) -> None:
    for a in THREE:
        expected = oracle_result(oracle, a.prompt, a.params.resolve(D, 512), config)
        assert_matches_oracle(record.finished[a.request_id], expected, a.request_id)


@pytest.mark.oracle
def test_incremental_admits_on_seats_and_recomputes_the_thrown_away_prefills(
    toy_model, oracle
) -> None:
    config = tight(KVAdmission.INCREMENTAL)
    record = run(toy_model, config, THREE)
    assert record.batches[0].rows() == [("a", 0, 2, 0), ("b", 0, 2, 0)]
    # a's first decode needs blocks: b goes; then b's decode needs them: c goes
    assert preemptions(record) == [("b", 1, "a", 2), ("c", 10, "b", 2)]
    assert prefill_steps(record, "b") == [0, 9]
    assert prefill_steps(record, "c") == [9, 18]
    stats = record.engine.scheduler.stats
    assert stats.num_preemptions == 2
    assert stats.num_recomputed_prompt_tokens == 4  # b's and c's 2-token prompts, once each
    assert stats.num_recomputed_prompt_token_loops == 4 * D
    assert stats.num_reserved_blocks == 0  # nothing is reserved
    assert_three_equal_oracle(record, oracle, config)


@pytest.mark.oracle
@pytest.mark.parametrize(
    "config",
    [
        tight(KVAdmission.RESERVE),
        tight(KVAdmission.WATERMARK, kv_watermark=0.5),
        # the default policy
        SchedulerConfig(block_size=2, num_blocks=8, split_prefill=False, async_scheduling=False),
    ],
    ids=["reserve", "watermark-0.5", "default"],
)
def test_reserving_policies_start_a_alone_and_never_recompute(toy_model, oracle, config) -> None:
    record = run(toy_model, config, THREE)
    assert record.batches[0].rows() == [("a", 0, 2, 0)]  # b waits for a's whole footprint
    assert preemptions(record) == []
    assert [prefill_steps(record, r) for r in "abc"] == [[0], [9], [18]]
    stats = record.engine.scheduler.stats
    assert stats.num_preemptions == stats.num_recomputed_prompt_tokens == 0
    if config.kv_admission is KVAdmission.RESERVE:
        # every request ran to max_tokens, so each wrote its whole reservation
        assert (stats.num_reserved_blocks, stats.num_reserved_unused_blocks) == (24, 0)
    assert_three_equal_oracle(record, oracle, config)


@pytest.mark.unit
def test_watermark_zero_only_asks_that_the_prompt_fits(toy_model) -> None:
    """b's prompt (4 blocks) fits beside a's, so at watermark 0 b starts and is thrown out
    again, like incremental; c's prompt no longer fits, so c waits for KV, not just seats."""
    record = run(toy_model, tight(KVAdmission.WATERMARK, kv_watermark=0.0), THREE)
    assert record.batches[0].rows() == [("a", 0, 2, 0), ("b", 0, 2, 0)]
    assert [p[0] for p in preemptions(record)] == ["b", "c"]


@pytest.mark.oracle
def test_reserve_counts_the_blocks_an_early_stop_never_writes(toy_model, oracle) -> None:
    prompt = [5, 6, 7]
    params = SamplingParams(max_tokens=6, temperature=0.0, min_loops=1, max_loops=D)
    config = SchedulerConfig(block_size=2, num_blocks=64, kv_admission=KVAdmission.RESERVE)
    first = oracle_result(oracle, prompt, params.resolve(D, 512), config).token_ids[0]
    stop = SamplingParams(
        max_tokens=6, temperature=0.0, min_loops=1, max_loops=D, stop_token_ids=[first]
    )
    record = run(toy_model, config, [Arrival("s", prompt, stop)])
    assert record.finished["s"].finish_reason == "stop"
    assert record.finished["s"].token_ids == [first]
    stats = record.engine.scheduler.stats
    # footprint: 3 + 6 - 1 = 8 positions = 4 blocks x 4 planes; the prompt wrote 2 x 4
    assert (stats.num_reserved_blocks, stats.num_reserved_unused_blocks) == (16, 8)


@pytest.mark.oracle
@pytest.mark.parametrize("policy", list(KVAdmission))
def test_pressure_with_early_exits_equals_oracle_under_every_policy(
    toy_model, oracle, policy
) -> None:
    params = SamplingParams(
        max_tokens=12, temperature=0.0, min_loops=1, exit_threshold=0.7, ignore_eos=True
    )
    arrivals = [
        Arrival(f"p{i}", [10 + i, 20, 30 + i, 40, 50, 60 + i], params, step=i) for i in range(4)
    ]
    config = SchedulerConfig(
        block_size=2,
        num_blocks=40,
        max_num_seqs=4,
        prefill_chunk_size=4,
        max_num_batched_tokens=16,
        kv_admission=policy,
    )
    record = run(toy_model, config, arrivals)
    stats = record.engine.scheduler.stats
    if policy is KVAdmission.RESERVE:
        assert stats.num_preemptions == 0
    if policy is KVAdmission.INCREMENTAL:
        assert stats.num_preemptions > 0 and stats.num_recomputed_prompt_tokens > 0
    for a in arrivals:
        expected = oracle_result(oracle, a.prompt, a.params.resolve(D, 512), config)
        assert assert_matches_oracle(record.finished[a.request_id], expected) >= 6


# ---------------------------------------------------------------------- priority at admission
LIMITS = ModelLimits(
    total_ut_steps=D, vocab_size=100, max_position_embeddings=4096, eos_token_ids=(0,)
)


def step(s: Scheduler) -> ScheduledBatch:
    batch = s.schedule()
    assert batch is not None
    s.update_after_submission(batch)
    s.update_from_output(batch, fake_result(batch))
    return batch


def decoding(policy: KVAdmission, newcomer_priority: int) -> Scheduler:
    """y decodes holding 8 of 16 blocks (footprint 12); x arrives needing 12 more."""
    config = SchedulerConfig(
        block_size=2,
        num_blocks=16,
        kv_admission=policy,
        split_prefill=False,
        async_scheduling=False,
    )
    s = Scheduler(config, LIMITS)
    s.add_request("y", [1, 2, 3, 4], SamplingParams(max_tokens=3, temperature=0.0))
    while s.requests["y"].state != RequestState.RECURRENT:
        step(s)
    params = SamplingParams(max_tokens=3, temperature=0.0, priority=newcomer_priority)
    s.add_request("x", [5, 6, 7, 8], params)
    return s


@pytest.mark.unit
@pytest.mark.parametrize("policy", [KVAdmission.RESERVE, KVAdmission.WATERMARK])
def test_a_higher_priority_newcomer_preempts_at_admission(policy) -> None:
    s = decoding(policy, newcomer_priority=-1)
    batch = step(s)
    assert [(p.request_id, p.for_request_id) for p in batch.preemptions] == [("y", "x")]
    assert batch.kind == BatchKind.PREFILL and {t.request.request_id for t in batch.tasks} == {"x"}
    assert s.requests["y"].state == RequestState.WAITING


@pytest.mark.unit
@pytest.mark.parametrize("policy", [KVAdmission.RESERVE, KVAdmission.WATERMARK])
def test_an_equal_priority_newcomer_waits_for_kv(policy) -> None:
    s = decoding(policy, newcomer_priority=0)
    while "y" in s.requests:
        assert s.requests["x"].state == RequestState.WAITING
        batch = step(s)
        assert batch.preemptions == [] and all(t.request.request_id == "y" for t in batch.tasks)
    assert s.stats.num_preemptions == 0
    assert step(s).rows()[0][0] == "x"  # y's KV came back: x starts


@pytest.mark.unit
def test_a_victim_with_work_in_flight_is_not_preempted_at_admission() -> None:
    s = decoding(KVAdmission.RESERVE, newcomer_priority=-1)
    s.requests["y"].inflight_batches = 1  # as if its decode row were still on the worker
    s._admission.admit_waiting()
    assert s.requests["y"].state == RequestState.RECURRENT
    assert s.requests["x"].state == RequestState.WAITING
    assert s.stats.num_preemptions == 0


@pytest.mark.unit
def test_no_preemption_that_could_not_make_room() -> None:
    """h (24 blocks) outranks a, but a's 8 blocks beside g's 12 can never make room: a keeps
    running instead of being thrown out for nothing."""
    config = SchedulerConfig(block_size=2, num_blocks=28, kv_admission=KVAdmission.INCREMENTAL)
    s = Scheduler(config, LIMITS)
    s.add_request("g", [1, 2, 3, 4], SamplingParams(max_tokens=3, temperature=0.0, priority=-2))
    s.add_request("a", [5, 6], SamplingParams(max_tokens=3, temperature=0.0))
    while any(r.state != RequestState.RECURRENT for r in s.running):
        step(s)
    high = SamplingParams(max_tokens=1, temperature=0.0, priority=-1)
    s.add_request("h", list(range(1, 13)), high)
    while "g" in s.requests:
        assert step(s).preemptions == []
    assert s.stats.num_preemptions == 0
    # g's KV is back: h runs (a's blocks now make room, or a finished first)
    while s.has_unfinished_requests():
        step(s)
    s.kv.check_consistency()
    assert s.kv.num_free_blocks == config.num_blocks


# ---------------------------------------------------------------------- config and surfaces
@pytest.mark.unit
def test_admission_arithmetic_at_the_edges() -> None:
    running = Commitment(prompt=0, decode=4)  # a decoding request may still write 4 blocks

    def ok(policy: KVAdmission, watermark: float, candidate: Commitment) -> bool:
        return admits(policy, watermark, free_blocks=8, committed=running, candidate=candidate)

    fresh = Commitment(prompt=4, decode=4)
    assert ok(KVAdmission.INCREMENTAL, 0.5, Commitment(prompt=99, decode=99))
    assert not ok(KVAdmission.RESERVE, 0.5, fresh)  # 4 + 4 + 4 > 8
    assert ok(KVAdmission.RESERVE, 0.5, Commitment(prompt=0, decode=4))  # its prompt is a hit
    # watermark 1 is reserve; watermark 0 asks only that every prompt fits
    assert not ok(KVAdmission.WATERMARK, 1.0, fresh)
    assert ok(KVAdmission.WATERMARK, 0.0, fresh)
    assert ok(KVAdmission.WATERMARK, 0.5, fresh)  # 8 - 4 >= 0.5 * (4 + 4)
    assert not ok(KVAdmission.WATERMARK, 0.6, fresh)
    # prompts of running requests that have not allocated yet count in full
    busy = Commitment(prompt=4, decode=0)
    assert not admits(
        KVAdmission.WATERMARK, 0.0, free_blocks=8, committed=busy + busy, candidate=fresh
    )


@pytest.mark.unit
def test_config_rejects_unknown_policies_and_fractions() -> None:
    with pytest.raises(ValueError, match="kv_admission must be one of reserve, incremental"):
        SchedulerConfig(kv_admission="greedy")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kv_watermark"):
        SchedulerConfig(kv_watermark=1.5)
    assert SchedulerConfig(kv_admission="reserve").kv_admission is KVAdmission.RESERVE  # type: ignore[arg-type]


def trace_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--json", action="store_true")
    p.add_argument("--diagram", action="store_true")
    add_request_flags(p)
    add_engine_flags(p)
    return p.parse_args(list(argv))


@pytest.mark.unit
def test_schedule_trace_shows_preemptions(toy_checkpoint: Path, capsys) -> None:
    argv = ["--checkpoint", str(toy_checkpoint), "--prompt-ids", "2,3", "--prompt-ids", "2,3"]
    argv += ["--prompt-ids", "2,3", "--max-tokens", "3", "--ignore-eos"]
    argv += ["--block-size", "2", "--num-blocks", "8", "--kv-admission", "incremental"]
    argv += ["--prefill", "atomic", "--no-async-scheduling"]
    args = trace_args(*argv)
    assert scheduler_config_from_args(args).kv_admission is KVAdmission.INCREMENTAL
    assert run_schedule_trace(args) == 0
    out = capsys.readouterr().out.splitlines()
    at = out.index(next(line for line in out if line.startswith("seq=1 ")))
    assert "preempt b (for a): 2 prompt + 0 generated tokens to recompute" in out[at + 1]
    assert out[-1].startswith("kv_admission=incremental preemptions=2 recomputed_prompt_tokens=4")

    assert run_schedule_trace(trace_args(*argv, "--json")) == 0
    out = capsys.readouterr().out.splitlines()
    records = [json.loads(line) for line in out if line.startswith("{")]
    assert records[1]["preemptions"] == [
        {
            "seq": 1,
            "request_id": "b",
            "for_request_id": "a",
            "prompt_tokens": 2,
            "output_tokens": 0,
            "blocks": 4,
            "incarnation": 1,
        }
    ]
