"""Bounded admission bypass (``max_admission_bypasses``): a waiting request that fits may start
ahead of a head whose KV does not, at most N times per head; then the head is protected.

The upstream looped-model engine's case: 24 KV blocks of 2 tokens, D=4 planes, 3 seats,
max_tokens 1 (so a footprint is its prompt): a running 4-token prompt holds 8 blocks, a
9-token prompt needs 20 of the 16 left, and two 1-token prompts need 4 each.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from messages.api import FinishedEvent
from messages.sampling import SamplingParams
from services.bench.comparisons.admission_bypass import bypass_arm_name
from services.bench.runner import run_bench
from services.cli import build_parser
from services.common.config import KVAdmission, ModelLimits, SchedulerConfig
from services.common.flags import add_engine_flags, engine_args, scheduler_config_from_args
from services.scheduler.core.kv.kv_admission import admits
from services.scheduler.core.kv.reservation import reserved_start, steps_left
from services.scheduler.core.request import Request, RequestState
from services.scheduler.core.running import committed, unallocated
from services.scheduler.core.scheduler import Scheduler
from services.scheduler.driver.telemetry import SchedulerTelemetry
from tests.engine_harness import Arrival, RunRecord, assert_matches_oracle, oracle_result
from tests.engine_harness import run_workload as run
from tests.helpers import fake_result

D = 4
LIMITS = ModelLimits(
    total_ut_steps=D, vocab_size=100, max_position_embeddings=4096, eos_token_ids=(0,)
)
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
UPSTREAM = [  # in arrival (and queue) order
    Arrival("running", [1, 2, 3, 4], ONE_TOKEN),  # 8 blocks
    Arrival("long", [1] * 9, ONE_TOKEN),  # 20 blocks: not beside running's 8
    Arrival("short", [2], ONE_TOKEN),  # 4 blocks
    Arrival("later", [3], ONE_TOKEN),  # 4 blocks
]


def upstream_config(bypasses: int, policy: KVAdmission = KVAdmission.WATERMARK) -> SchedulerConfig:
    return SchedulerConfig(
        max_num_seqs=3,
        block_size=2,
        num_blocks=24,
        kv_admission=policy,
        max_admission_bypasses=bypasses,
    )


def step(s: Scheduler) -> None:
    batch = s.schedule()
    assert batch is not None
    s.update_after_submission(batch)
    s.update_from_output(batch, fake_result(batch))


def state(s: Scheduler, request_id: str) -> RequestState:
    return s.requests[request_id].state


@pytest.mark.unit
@pytest.mark.parametrize("policy", [KVAdmission.WATERMARK, KVAdmission.RESERVE])
def test_short_requests_bypass_then_protected_long_request_gets_memory(policy) -> None:
    s = Scheduler(upstream_config(bypasses=1, policy=policy), LIMITS)
    s.add_request("running", [1, 2, 3, 4], ONE_TOKEN)
    s._admission.admit_waiting()
    for a in UPSTREAM[1:]:
        s.add_request(a.request_id, a.prompt, a.params)
    s._admission.admit_waiting()
    assert state(s, "short") != RequestState.WAITING  # passed the long one (its one bypass)
    assert state(s, "long") == state(s, "later") == RequestState.WAITING
    assert s.stats.num_admission_bypasses == 1
    s.abort_request("short")
    s._admission.admit_waiting()
    # 16 blocks are free and later needs 4, but long has been passed once: it is protected
    assert state(s, "later") == RequestState.WAITING
    s.abort_request("running")
    s._admission.admit_waiting()
    assert state(s, "long") != RequestState.WAITING  # its 20 blocks fit now
    assert state(s, "later") != RequestState.WAITING  # and the last 4 are later's
    while s.has_unfinished_requests():
        step(s)
    s.kv.check_consistency()
    assert s.kv.num_free_blocks == 24


def backfill_case(with_quick: bool) -> Scheduler:
    """Reserve admission, N = 1: ``running`` holds 24 of 128 blocks for an estimated 37
    steps (one prompt chunk, 4 loops, 8 tokens x 4 loops); ``long`` needs 120 blocks, so
    its reservation is 37 steps away. ``slow-*`` (45 steps) end after that, ``quick-*`` (13
    steps) before."""
    config = SchedulerConfig(
        max_num_seqs=8, block_size=2, num_blocks=128, kv_admission=KVAdmission.RESERVE,
        max_admission_bypasses=1,
    )  # fmt: skip
    s = Scheduler(config, LIMITS)

    def params(max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    s.add_request("running", [1, 2, 3, 4], params(8))
    s._admission.admit_waiting()
    s.add_request("long", prompt(1, 60), params(1))
    s.add_request("slow-1", [2], params(10))
    if with_quick:
        s.add_request("quick-1", [3], params(2))
    s.add_request("slow-2", [4], params(10))
    if with_quick:
        s.add_request("quick-2", [5], params(2))
    return s


@pytest.mark.unit
def test_requests_that_end_before_the_heads_reservation_backfill_uncounted() -> None:
    s = backfill_case(with_quick=True)
    s._admission.admit_waiting()
    # slow-1 is the one counted pass (its 45 steps outlast long's reservation, which then
    # moves to 45); both quick ones end before it, slow-2 does not: it waits for long
    assert s.stats.num_admission_bypasses == 1
    assert s.stats.num_admission_backfills == 2
    waiting = {rid for rid, r in s.requests.items() if r.state == RequestState.WAITING}
    assert waiting == {"long", "slow-2"}


@pytest.mark.unit
def test_backfills_end_before_the_head_starts_and_do_not_delay_it() -> None:
    """The same queue with and without the quick requests: long starts at the same step,
    both quick ones have started and ended by then, and slow-2 starts after it."""
    long_start = []
    for with_quick in (False, True):
        s = backfill_case(with_quick)
        started: dict[str, int] = {}
        ended: dict[str, int] = {}
        for n in range(500):
            if not s.has_unfinished_requests():
                break
            for rid, r in list(s.requests.items()):
                if r.state != RequestState.WAITING:
                    started.setdefault(rid, n)
            step(s)
            for rid in started:
                if rid not in s.requests:
                    ended.setdefault(rid, n)
        s.kv.check_consistency()
        long_start.append(started["long"])
        assert started["slow-2"] > started["long"]
        if with_quick:
            assert all(ended[q] <= started["long"] for q in ("quick-1", "quick-2"))
    assert long_start[0] == long_start[1] > 0


def admission_order(record: RunRecord) -> list[tuple[int, str]]:
    """(batch seq, request id) in the order the scheduler admitted them (the worker learns
    of new requests in that order)."""
    return [(b.seq, new.request_id) for b in record.batches for new in b.wire.new_requests]


@pytest.mark.oracle
@pytest.mark.parametrize(
    ("bypasses", "order"),
    [
        (0, ["running", "long", "short", "later"]),  # strict: everyone waits for long
        (1, ["running", "short", "long", "later"]),  # short passes; later waits for long
        (2, ["running", "short", "later", "long"]),  # both pass
    ],
)
def test_admission_order_in_the_engine(toy_model, oracle, bypasses, order) -> None:
    config = upstream_config(bypasses)
    record = run(toy_model, config, UPSTREAM)
    admitted = admission_order(record)
    assert [rid for _, rid in admitted] == order
    at = dict((rid, seq) for seq, rid in admitted)
    assert at["running"] == 0 and at["long"] > 0  # long never fits beside running
    if bypasses == 1:
        assert at["short"] == 0 and at["later"] == at["long"]  # later only with long's KV
    stats = record.engine.scheduler.stats
    assert stats.num_admission_bypasses == min(bypasses, 2)
    assert stats.num_preemptions == 0
    for a in UPSTREAM:
        expected = oracle_result(oracle, a.prompt, a.params.resolve(D, 512), config)
        assert_matches_oracle(record.finished[a.request_id], expected, a.request_id)


@pytest.mark.unit
def test_a_less_urgent_request_never_passes_a_refused_one() -> None:
    s = Scheduler(upstream_config(bypasses=4), LIMITS)
    s.add_request("running", [1, 2, 3, 4], ONE_TOKEN)
    s._admission.admit_waiting()
    s.add_request("long", [1] * 9, ONE_TOKEN)
    low = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, priority=1)
    s.add_request("low", [2], low)
    s._admission.admit_waiting()
    assert state(s, "low") == RequestState.WAITING  # it fits, but long is more urgent
    assert s.stats.num_admission_bypasses == 0


@pytest.mark.unit
def test_the_flag_reaches_the_config_and_the_children() -> None:
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    config = scheduler_config_from_args(parser.parse_args(["--max-admission-bypasses", "0"]))
    assert config.max_admission_bypasses == 0
    assert "--max-admission-bypasses=0" in engine_args(config)
    with pytest.raises(ValueError, match="max_admission_bypasses must be >= 0"):
        SchedulerConfig(max_admission_bypasses=-1)


# ---------------------------------------------------------------------- no request waits forever
@dataclass
class PassWatch:
    """Checks every start against the rule, from the outside: a request that starts while
    one ahead of it in queue order waits passes the first such one (the head). A pass is a
    backfill when the passer's estimated steps end before the head's reserved start
    (``reservation.py``, recomputed here from the KV state at that moment); any other pass
    counts, and a head's wait (from entering the queue to starting) allows N of them."""

    limit: int
    counted: dict[str, int] = field(default_factory=dict)  # per head, in its current wait
    most: int = 0
    backfills: int = 0

    def watch(self, s: Scheduler) -> None:
        admission = s._admission
        start = admission._start
        config = s.config

        def reservation(head: Request) -> int | None:
            kv, running = s.kv, s._admission._state.running
            commitment = committed(s._admission._state)
            return reserved_start(
                running,
                config.prefill_chunk_size,
                release=lambda r: (kv.num_held_blocks(r.request_id), unallocated(kv, r)),
                fits=lambda freed, released: admits(
                    config.kv_admission,
                    config.kv_watermark,
                    free_blocks=kv.num_free_blocks + freed,
                    committed=commitment - released,
                    candidate=unallocated(kv, head),
                ),
            )

        def start_and_check(request: Request) -> None:
            self.counted.pop(request.request_id, None)  # its wait is over
            ahead = [
                r
                for r in s.requests.values()
                if r.state == RequestState.WAITING
                and r is not request
                and r.priority_key < request.priority_key
            ]
            if ahead:
                head = min(ahead, key=lambda r: r.priority_key)
                # a bypass stays inside one priority: a less urgent request never passes
                assert head.params.priority == request.params.priority
                reserved = reservation(head)
                steps = steps_left(request, config.prefill_chunk_size)
                if reserved is not None and steps < reserved:
                    self.backfills += 1
                else:
                    n = self.counted[head.request_id] = self.counted.get(head.request_id, 0) + 1
                    assert n <= self.limit, f"head {head.request_id} passed {n} times"
                    self.most = max(self.most, n)
            start(request)

        admission._start = start_and_check  # type: ignore[method-assign]


def prompt(i: int, n: int) -> list[int]:
    return [1 + (7 * i + j) % 90 for j in range(n)]  # distinct per request, inside LIMITS


@st.composite
def pressure(draw: st.DrawFn) -> tuple[SchedulerConfig, list[Arrival]]:
    block_size = draw(st.sampled_from([1, 2, 4]))
    arrivals = [
        Arrival(
            f"r{i}",
            prompt(i, draw(st.sampled_from([1, 2, 3, 8, 16, 24]))),
            SamplingParams(
                max_tokens=draw(st.integers(1, 6)),
                temperature=0.0,
                ignore_eos=True,
                priority=draw(st.sampled_from([0, 0, 0, 1])),
            ),
            step=draw(st.sampled_from([0, 0, 0, 1, 2, 5, 10, 20])),  # bunched: a queue forms
        )
        for i in range(draw(st.integers(2, 12)))
    ]
    longest = max(len(a.prompt) + a.params.max_tokens - 1 for a in arrivals)
    need = -(-longest // block_size) * D  # every request fits the pool alone
    config = SchedulerConfig(
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.integers(4, 32)),
        prefill_chunk_size=draw(st.integers(1, 16)),
        block_size=block_size,
        num_blocks=need + draw(st.integers(0, need)),
        split_prefill=draw(st.booleans()),
        async_scheduling=draw(st.booleans()),
        kv_admission=draw(st.sampled_from([KVAdmission.RESERVE, KVAdmission.WATERMARK])),
        kv_watermark=draw(st.sampled_from([0.0, 0.25, 0.5, 1.0])),
        max_admission_bypasses=draw(st.integers(0, 3)),
    )
    return config, arrivals


@pytest.mark.unit
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=pressure())
def test_every_request_finishes_and_no_head_is_passed_more_than_n_times(case) -> None:
    config, arrivals = case
    s = Scheduler(config, LIMITS)
    watch = PassWatch(config.max_admission_bypasses)
    watch.watch(s)
    pending = sorted(arrivals, key=lambda a: a.step)
    finished: set[str] = set()
    for n in range(5_000):
        while pending and pending[0].step <= n:
            a = pending.pop(0)
            s.add_request(a.request_id, a.prompt, a.params)
        batch = s.schedule()
        if batch is not None:
            s.update_after_submission(batch)
            events = s.update_from_output(batch, fake_result(batch))
            finished |= {e.request_id for e in events if isinstance(e, FinishedEvent)}
        elif not pending:
            assert not s.has_unfinished_requests(), "live requests, and nothing to run"
        if not pending and not s.has_unfinished_requests():
            break
    else:
        pytest.fail(f"still running after 5000 steps: {sorted(s.requests)}")
    assert finished == {a.request_id for a in arrivals}
    assert watch.backfills == s.stats.num_admission_backfills
    if config.max_admission_bypasses == 0:
        assert watch.most == watch.backfills == s.stats.num_admission_bypasses == 0
    s.kv.check_consistency()
    assert s.kv.num_free_blocks == config.num_blocks


# ---------------------------------------------------------------------- tokens unchanged
LONG = SamplingParams(max_tokens=6, temperature=0.0, min_loops=1, exit_threshold=0.7)
SHORT = SamplingParams(max_tokens=2, temperature=0.0, min_loops=1, exit_threshold=0.7)
MIX = [
    Arrival("L0", list(range(10, 34)), LONG),
    Arrival("L1", list(range(40, 62)), LONG),
    Arrival("s0", [5, 6], SHORT, step=1),
    Arrival("L2", list(range(70, 90)), LONG, step=1),
    Arrival("s1", [7], SHORT, step=2),
    Arrival("s2", [8, 9, 11], SHORT, step=2),
    Arrival("s3", [12], SHORT, step=6),
]


@pytest.mark.oracle
@pytest.mark.parametrize("policy", [KVAdmission.WATERMARK, KVAdmission.RESERVE])
@pytest.mark.parametrize("prefill", ["wcpb", "atomic"])
def test_bypassing_requests_equal_the_oracle(toy_model, oracle, policy, prefill) -> None:
    """Tight KV (one long request's footprint and a bit): short ones start ahead of the
    long ones (backfills or counted passes), and every token and exit depth still equals
    the serial oracle."""
    config = SchedulerConfig(
        max_num_seqs=4,
        block_size=2,
        num_blocks=64,  # a long footprint is 15 blocks x 4 planes
        prefill_chunk_size=8,
        max_num_batched_tokens=16,
        split_prefill=prefill == "wcpb",
        wavefront_chunked_prefill=prefill == "wcpb",
        kv_admission=policy,
        max_admission_bypasses=2,
    )
    record = run(toy_model, config, MIX)
    stats = record.engine.scheduler.stats
    assert stats.num_admission_bypasses + stats.num_admission_backfills > 0
    telemetry = SchedulerTelemetry(
        lambda: record.engine.scheduler, total_ut_steps=D, prefix_caching=False
    )
    text = generate_latest(telemetry.registry).decode()
    for name, value in (
        ("rlt:admission_bypasses_total", stats.num_admission_bypasses),
        ("rlt:admission_backfills_total", stats.num_admission_backfills),
    ):
        assert f"{name} {float(value)}" in text.splitlines()
    for a in MIX:
        expected = oracle_result(oracle, a.prompt, a.params.resolve(D, 512), config)
        assert_matches_oracle(record.finished[a.request_id], expected, a.request_id)


SETTINGS = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.mark.oracle
@SETTINGS
@given(data=st.data())
def test_random_pressure_with_bypasses_equals_the_oracle(toy_model, oracle, data) -> None:
    config, arrivals = data.draw(pressure())
    record = run(toy_model, config, arrivals)
    for a in arrivals:
        expected = oracle_result(oracle, a.prompt, a.params.resolve(D, 512), config)
        assert_matches_oracle(record.finished[a.request_id], expected, a.request_id)


# ---------------------------------------------------------------------- rlt bench
@pytest.mark.unit
def test_quick_bench_compares_strict_order_with_the_default(
    toy_checkpoint: Path, tmp_path: Path
) -> None:
    default = bypass_arm_name(SchedulerConfig().max_admission_bypasses)
    argv = ["bench", "--quick", "--checkpoint", str(toy_checkpoint), "--concurrency", "4"]
    argv += ["--repeats", "1", "--only", "admission_bypass", "--arms", f"strict,{default}"]
    argv += ["--no-progress", "--no-plots", "--out", str(tmp_path)]
    results = run_bench(build_parser().parse_args(argv))
    (comp,) = results["comparisons"]
    runs = {r["arm"]: r["metrics"] for r in comp["runs"]}
    assert set(runs) == {"strict", default}
    assert len({m["output_tokens"] for m in runs.values()}) == 1  # the same greedy tokens
    assert runs["strict"]["admission_bypasses"] == runs["strict"]["admission_backfills"] == 0
    assert runs[default]["admission_bypasses"] + runs[default]["admission_backfills"] > 0
    for m in runs.values():
        assert m["ttft_ms_p99_short"] > 0 and m["latency_ms_mean_long"] > 0
    targets = {r["metric"]: r for r in comp["ratios"] if r["target"]}
    assert set(targets) == {
        "ttft_ms_p99_short",
        "latency_ms_mean_long",
        "ttft_steps_p99_short",
        "latency_steps_mean_long",
    }
    for metric, ratio in targets.items():
        assert ratio["per_repeat"] == [runs[default][metric] / runs["strict"][metric]]


@pytest.mark.unit
def test_what_a_head_preempted_for_is_not_taken_by_a_request_behind_it() -> None:
    """Victims that share prefix-cache blocks free fewer blocks than their holdings add up
    to: a head may preempt them all and still not fit. What they freed then waits for the
    head; a request behind it does not start on it (and nothing counts as a bypass)."""

    def params(priority: int) -> SamplingParams:
        return SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, priority=priority)

    config = SchedulerConfig(
        max_num_seqs=8, block_size=2, num_blocks=64, kv_admission=KVAdmission.WATERMARK,
        kv_watermark=0.0, max_admission_bypasses=4, enable_prefix_caching=True,
    )  # fmt: skip
    s = Scheduler(config, LIMITS)
    s.add_request("running", [5] * 8, params(0))
    s.add_request("low-1", [7] * 8 + [1], params(1))
    s._admission.admit_waiting()
    for _ in range(3):
        step(s)
    s.add_request("low-2", [7] * 8 + [2], params(1))  # shares low-1's cached prefix
    s._admission.admit_waiting()
    for _ in range(3):
        step(s)
    kv = s._admission._state.kv
    held = kv.num_held_blocks("low-1") + kv.num_held_blocks("low-2")
    assert held > kv.num_held_blocks("low-1") + 4  # low-2's prefix blocks are low-1's
    s.add_request("head", [9] * 26, params(0))
    s.add_request("small", [3], params(0))
    s._admission.admit_waiting()
    assert state(s, "low-1") == state(s, "low-2") == RequestState.WAITING  # preempted
    assert state(s, "head") == RequestState.WAITING  # still does not fit
    assert state(s, "small") == RequestState.WAITING
    assert s.stats.num_admission_bypasses == 0
    started: list[str] = []
    for _ in range(500):
        if not s.has_unfinished_requests():
            break
        started += [r for r in ("head", "small") if r not in started
                    and state(s, r) != RequestState.WAITING]  # fmt: skip
        step(s)
    assert not s.has_unfinished_requests()
    assert started[0] == "head", started
