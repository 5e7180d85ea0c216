"""Token-sparse prefill in the engine equals the serial oracle's, token for token and exit
depth for exit depth, across windows, retentions, chunk sizes, budgets (fragments), split
and wavefront prefill, prefix caching, KV pressure (preemption) and async scheduling."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from messages.api import FinishedEvent
from messages.sampling import SamplingParams, StructuredOutput
from services.common.config import KVAdmission, SchedulerConfig
from services.common.sparse_prefill import FLASHLOOP_RETENTION
from services.engine.engine import LLMEngine
from services.engine.executor import InProcessExecutor
from services.oracle.near_tie import compare_with_oracle
from services.worker.runner import ModelRunner
from tests.engine_harness import (
    Arrival,
    assert_matches_oracle,
    oracle_result,
    run_workload,
    sparse_setting,
)
from tests.engine_strategies import VOCAB_TRAINED, D, max_kv_blocks

pytestmark = pytest.mark.oracle

RETENTIONS = [
    FLASHLOOP_RETENTION,
    (1.0, 0.5, 0.5, 0.25),
    (1.0, 1.0, 1.0, 0.3),
    (1.0, 1.0, 0.6, 0.6),
]


@st.composite
def sparse_workloads(draw: st.DrawFn) -> list[Arrival]:
    """Prompts of up to 40 tokens, often sharing a prefix; most sparse, some dense."""
    shared = draw(st.lists(st.integers(1, VOCAB_TRAINED), min_size=4, max_size=24))
    arrivals = []
    for i in range(draw(st.integers(1, 4))):
        retention = draw(st.sampled_from([None, *RETENTIONS]))
        params = SamplingParams(
            max_tokens=draw(st.integers(1, 6)),
            temperature=0.0,
            min_loops=draw(st.integers(1, 2)),
            exit_threshold=draw(st.sampled_from([1.0, 0.7])),
            ignore_eos=True,
            token_sparse_prefill=draw(st.sampled_from([True, True, False])),
            prefill_retention=None if retention is None else list(retention),
        )
        if params.token_sparse_prefill is False:
            params.prefill_retention = None
        tail = draw(st.lists(st.integers(1, VOCAB_TRAINED), min_size=1, max_size=16))
        prompt = (shared if draw(st.booleans()) else []) + tail
        arrivals.append(Arrival(f"r{i}", prompt, params, step=draw(st.sampled_from([0, 0, 2, 9]))))
    return arrivals


@st.composite
def sparse_configs(draw: st.DrawFn, arrivals: list[Arrival]) -> SchedulerConfig:
    block_size = draw(st.sampled_from([1, 2, 4]))
    # windows need not align with blocks: prefix hits end where both do
    window = draw(st.sampled_from([1, 2, 3, 5, 6, 8, 12, 16, 64]))
    chunk = draw(st.integers(1, 12))
    seqs = draw(st.integers(1, 4))
    need = max_kv_blocks(arrivals, block_size)
    tight = draw(st.booleans())
    return SchedulerConfig(
        max_num_seqs=seqs,
        max_num_batched_tokens=draw(st.integers(1, 24)),
        prefill_chunk_size=chunk,
        split_prefill=True,
        wavefront_chunked_prefill=draw(st.booleans()),
        block_size=block_size,
        num_blocks=need + draw(st.integers(0, need)) if tight else need * len(arrivals) + 8,
        enable_prefix_caching=draw(st.booleans()),
        async_scheduling=draw(st.booleans()),
        max_inflight_batches=draw(st.integers(2, 3)),
        kv_admission=draw(st.sampled_from(list(KVAdmission))),
        sparse_window=window,
    )


def check(
    toy_model,
    oracle,
    arrivals: list[Arrival],
    config: SchedulerConfig,
    aborts: dict[str, int] | None = None,
) -> int:
    """Runs the workload (``aborts``: request id -> the step that aborts it) and compares
    every request that was not aborted with the oracle; the harness checks the KV is back."""
    record = run_workload(toy_model, config, arrivals, aborts=aborts)
    compared = 0
    for a in arrivals:
        finished = record.finished[a.request_id]
        if finished.finish_reason == "abort":
            continue
        streamed = record.tokens.get(a.request_id, [])
        assert [t.token_id for t in streamed] == finished.token_ids
        expected = oracle_result(oracle, a.prompt, a.params.resolve(D, 512), config)
        compared += assert_matches_oracle(finished, expected, f"{a.request_id} {config}")
    return compared


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_sparse_engine_equals_oracle(toy_model, oracle, data) -> None:
    arrivals = data.draw(sparse_workloads())
    config = data.draw(sparse_configs(arrivals))
    # sometimes one request is aborted mid-run (often mid-window): the others are unchanged
    victim = data.draw(st.sampled_from([None, *arrivals]))
    aborts = None if victim is None else {victim.request_id: data.draw(st.integers(1, 12))}
    check(toy_model, oracle, arrivals, config, aborts)


LONG = [
    [(11 * i + 7 * k + 3) % VOCAB_TRAINED + 1 for i in range(n)] for k, n in enumerate((45, 33, 60))
]


def test_preemption_mid_window_recomputes_the_same_active_sets(toy_model, oracle) -> None:
    """Tight KV under incremental admission preempts requests in the middle of their sparse
    windows; recomputed, they choose the same active tokens (the tokens equal the oracle's)."""
    params = SamplingParams(
        max_tokens=8, temperature=0.0, min_loops=1, exit_threshold=0.7, ignore_eos=True,
        token_sparse_prefill=True,
    )  # fmt: skip
    arrivals = [Arrival(f"p{i}", prompt, params, step=i) for i, prompt in enumerate(LONG)]
    config = SchedulerConfig(
        block_size=4,
        num_blocks=70,
        max_num_seqs=3,
        prefill_chunk_size=8,
        max_num_batched_tokens=10,
        kv_admission=KVAdmission.INCREMENTAL,
        sparse_window=16,
    )
    record = run_workload(toy_model, config, arrivals)
    assert record.engine is not None
    stats = record.engine.scheduler.stats
    assert stats.num_preemptions > 0 and stats.num_recomputed_prompt_token_loops > 0
    for a in arrivals:
        expected = oracle_result(oracle, a.prompt, a.params.resolve(D, 512), config)
        assert assert_matches_oracle(record.finished[a.request_id], expected) == 8


@pytest.mark.parametrize("crash_step", [2, 6, 14])
def test_worker_loss_mid_window_recomputes_the_same_active_sets(toy_model, crash_step) -> None:
    config = SchedulerConfig(
        block_size=4, num_blocks=256, max_num_batched_tokens=9, prefill_chunk_size=8,
        sparse_window=16, token_sparse_prefill=True,
    )  # fmt: skip
    params = SamplingParams(max_tokens=6, temperature=0.0, exit_threshold=0.7, ignore_eos=True)

    def fresh() -> LLMEngine:
        engine = LLMEngine(toy_model, config)
        for i, prompt in enumerate(LONG):
            engine.add_request(f"p{i}", prompt, params)
        return engine

    def finished(events) -> dict[str, tuple[list[int], list[int]]]:
        return {
            e.request_id: (e.token_ids, e.exit_depths)
            for e in events
            if isinstance(e, FinishedEvent)
        }

    expected = finished(fresh().run_until_done())
    engine = fresh()
    events = []
    for _ in range(crash_step):
        events += engine.step()
    engine.core.reset_after_executor_loss()
    engine.runner = ModelRunner(toy_model, config.num_blocks, config.block_size, config.kv_layout)
    engine.core.executor = InProcessExecutor(engine.runner)
    events += engine.run_until_done()
    assert finished(events) == expected


def test_a_window_whose_state_a_failed_batch_lost_fails_its_row_not_the_batch(
    toy_model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With async scheduling a window's next loop may already be in flight when the batch
    that should have chosen its active tokens fails: the worker then has no active set for
    it. Only that request's row fails (the scheduler has ended the request already); the
    other requests of the batch run as usual."""
    config = SchedulerConfig(
        block_size=4, num_blocks=256, max_num_batched_tokens=64, prefill_chunk_size=8,
        sparse_window=8, async_scheduling=False,
    )  # fmt: skip
    sparse = SamplingParams(
        max_tokens=2, temperature=0.0, ignore_eos=True, token_sparse_prefill=True
    )
    dense = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    wires = []
    engine = LLMEngine(toy_model, config, on_batch=lambda b: wires.append(b.wire))
    engine.add_request("a", LONG[0][:24], sparse)
    engine.add_request("b", LONG[1], dense)
    engine.run_until_done()

    def fragment_of_a(wire, depth: int) -> bool:
        return any(
            r.request_id == "a" and r.fragment is not None and r.depth == depth
            and r.token_start == 0 and r.fragment.active_start == 0
            for r in wire.rows
        )  # fmt: skip

    # replay the batches on a new worker; the one that opens window 0's loop 2 fails
    runner = ModelRunner(toy_model, config.num_blocks, config.block_size, config.kv_layout)
    opened = runner.sparse._open_windows

    def fail_once(opening, requests):  # type: ignore[no-untyped-def]
        if any(live.row.request_id == "a" and live.row.depth == 2 for live in opening):
            raise RuntimeError("the device failed")
        return opened(opening, requests)

    monkeypatch.setattr(runner.sparse, "_open_windows", fail_once)
    failed = after = None
    for wire in wires:
        if fragment_of_a(wire, 2):
            with pytest.raises(RuntimeError):
                runner.execute(wire)
            failed = wire.seq
            monkeypatch.setattr(runner.sparse, "_open_windows", opened)
            continue
        result = runner.execute(wire)
        if failed is not None and fragment_of_a(wire, 3):
            after = result
            for row, res in zip(wire.rows, result.rows, strict=True):
                lost = row.request_id == "a" and row.depth == 3 and row.token_start == 0
                if lost:
                    assert res.error is not None and "no active tokens of loop 2" in res.error
                else:
                    assert res.error is None and not res.skipped
            assert any(row.request_id == "b" for row in wire.rows)
            break
    assert failed is not None and after is not None


def test_structured_outputs_under_sparse_prefill_equal_the_oracle(toy_model, oracle, codec) -> None:
    """The prompt's first token is sampled at its last window's last active row, under the
    format's mask, as any coda row: every format's output equals the oracle's (the same
    mask, the same sparse prefill) beside a dense request with a format."""
    from services.worker.sampling.grammar import GrammarBook
    from tests.helpers import FORMATS, MaskedSampler

    config = SchedulerConfig(
        block_size=4, num_blocks=512, prefill_chunk_size=8, max_num_batched_tokens=12,
        sparse_window=8,
    )  # fmt: skip
    book = GrammarBook(codec, toy_model.cfg.vocab_size, toy_model.cfg.stop_token_ids)
    engine = LLMEngine(toy_model, config, codec=codec)
    requests = {}
    for i, (kind, spec) in enumerate(FORMATS.values()):
        params = SamplingParams(
            max_tokens=48, temperature=0.0, exit_threshold=0.7,
            structured_output=StructuredOutput(kind=kind, spec=spec),
            token_sparse_prefill=i != 3,
        )  # fmt: skip
        prompt = LONG[i % 3][: 20 + 7 * i]
        requests[f"s{i}"] = (prompt, params)
        engine.add_request(f"s{i}", prompt, params)
    finished = {e.request_id: e for e in engine.run_until_done() if isinstance(e, FinishedEvent)}
    for rid, (prompt, params) in requests.items():
        assert params.structured_output is not None
        sampler = MaskedSampler(book.compile(params.structured_output).result(), 512, params)
        want = oracle.generate(
            prompt, max_tokens=48, exit_threshold=0.7, sampler=sampler,
            sparse_prefill=sparse_setting(params, config, oracle.total_ut_steps),
        )  # fmt: skip
        comparison = compare_with_oracle(finished[rid], want, sampler.gaps)
        assert comparison.mismatch is None and comparison.compared > 0, (rid, comparison)
        sparse = params.token_sparse_prefill
        assert (finished[rid].prefill_rows < 4 * len(prompt)) == sparse, rid
