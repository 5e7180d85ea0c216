"""Test helpers: drive the in-process engine with arrivals, check invariants every step,
and compare finished requests with the serial oracle."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from messages.api import FinishedEvent, StreamEvent, TokenEvent
from messages.batch import RowKind
from messages.sampling import SamplingParams
from services.common.config import KVLayout, SchedulerConfig
from services.common.sparse_prefill import resolve_sparse_prefill
from services.engine.engine import LLMEngine
from services.oracle import SerialOracle, SparseSetting
from services.oracle.near_tie import JITTER_SEEDS, compare_with_oracle
from services.oracle.results import OracleResult
from services.scheduler.core.batch import ScheduledBatch
from services.scheduler.core.kv.kv_admission import Commitment
from services.worker.model.ouro import OuroModel


@dataclass
class Arrival:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    step: int = 0


@dataclass
class RunRecord:
    finished: dict[str, FinishedEvent] = field(default_factory=dict)
    tokens: dict[str, list[TokenEvent]] = field(default_factory=dict)
    batches: list[ScheduledBatch] = field(default_factory=list)
    engine: LLMEngine | None = None


def check_batch_limits(batch: ScheduledBatch, config: SchedulerConfig) -> None:
    tokens = sum(t.budget_rows for t in batch.tasks)
    assert tokens <= config.max_num_batched_tokens, f"batch {batch.seq} over budget: {tokens}"
    seqs = {t.request.request_id for t in batch.tasks}
    assert len(seqs) <= config.max_num_seqs, f"batch {batch.seq} has {len(seqs)} requests"
    decode = [t.kind in (RowKind.DECODE, RowKind.FOLLOW_ON) for t in batch.tasks]
    # decode rows (follow-ons included) come first in a mixed batch
    first_other = next((i for i, is_decode in enumerate(decode) if not is_decode), len(decode))
    assert not any(decode[first_other:]), f"batch {batch.seq}: a decode row after prompt rows"


class FrontierWatch:
    """Checks frontier properties after every step: monotone per depth, right_d <= right_{d-1},
    retirement never ahead of the final depth."""

    def __init__(self) -> None:
        self.last: dict[tuple[str, int], list[int]] = {}

    def check(self, engine: LLMEngine) -> None:
        for request in engine.scheduler.running:
            if not request.prefill_depth_ranges:
                continue
            rights = [r for _, r in request.prefill_depth_ranges]
            key = (request.request_id, request.incarnation)
            previous = self.last.get(key)
            if previous is not None:
                assert all(a >= b for a, b in zip(rights, previous, strict=True)), (
                    f"{key}: frontier moved backwards {previous} -> {rights}"
                )
            upper = request.num_preluded_tokens
            for right in rights:
                assert right <= upper, f"{key}: frontiers not nested: {rights}"
                upper = right
            assert request.prefill_reclaimable_tokens <= rights[-1]
            self.last[key] = rights


def run_workload(
    model: OuroModel,
    config: SchedulerConfig,
    arrivals: list[Arrival],
    max_steps: int = 20_000,
    aborts: dict[str, int] | None = None,
) -> RunRecord:
    """Runs arrivals to completion; ``aborts`` maps request ids to the step that aborts
    them (if they are still live then)."""
    record = RunRecord()

    def on_batch(batch: ScheduledBatch) -> None:
        check_batch_limits(batch, config)
        # preemption never takes a request this batch selected: any row of a victim here
        # was selected after its readmission (a newer incarnation)
        restarted = {p.request_id: p.incarnation for p in batch.preemptions}
        for t in batch.tasks:
            rid = t.request.request_id
            assert t.incarnation >= restarted.get(rid, 0), (batch.seq, batch.preemptions)
        record.batches.append(batch)

    engine = LLMEngine(model, config, on_batch=on_batch)
    record.engine = engine
    watch = FrontierWatch()
    pending = sorted(arrivals, key=lambda a: a.step)
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            engine.add_request(a.request_id, a.prompt, a.params)
        events: list[StreamEvent] = engine.step()
        for request_id, at in (aborts or {}).items():
            if at == step and request_id in engine.scheduler.requests:
                events += engine.abort_request(request_id)
        for event in events:
            if isinstance(event, TokenEvent):
                record.tokens.setdefault(event.request_id, []).append(event)
            elif isinstance(event, FinishedEvent):
                assert event.request_id not in record.finished, "two terminal events"
                record.finished[event.request_id] = event
        watch.check(engine)
        step += 1
        assert step < max_steps, "engine made no progress"
    # KV fully reclaimed once everything ended
    engine.scheduler.kv.check_consistency()
    assert engine.scheduler.kv.num_free_blocks == config.num_blocks
    # admission's bound on running footprints went back to nothing with them
    assert engine.scheduler._running_footprints == Commitment()
    return record


def sparse_setting(
    params: SamplingParams, config: SchedulerConfig, total_ut_steps: int
) -> SparseSetting | None:
    """The token-sparse prefill a request runs under in this engine, for the oracle."""
    schedule = resolve_sparse_prefill(
        params, config.sparse_defaults(), total_ut_steps, split_prefill=bool(config.split_prefill)
    )
    if schedule is None:
        return None
    return SparseSetting(window=schedule.window, retention=schedule.retention)


@dataclass
class CodecExpectation(OracleResult):
    """The oracle's result under a KV codec, with the same run under K/V perturbed at
    float32's resolution (``replay(seed)``), for a comparison to fall back on."""

    replay: Callable[[int], OracleResult] | None = None


def oracle_result(
    oracle: SerialOracle, prompt: list[int], params: SamplingParams, config: SchedulerConfig
) -> OracleResult:
    shared = config.kv_layout == KVLayout.SHARED

    def run(seed: int | None) -> OracleResult:
        return oracle.generate(
            prompt,
            max_tokens=params.max_tokens,
            min_loops=params.min_loops,
            max_loops=params.max_loops,
            exit_threshold=params.exit_threshold,
            stop_token_ids=params.stop_token_ids,
            ignore_eos=params.ignore_eos,
            kv_layout=config.kv_layout.value,
            prefill_chunk_size=config.prefill_chunk_size if shared else None,
            sparse_prefill=sparse_setting(params, config, oracle.total_ut_steps),
            kv_cache_dtype=config.kv_cache_dtype,
            kv_block_size=config.block_size,
            kv_int4_anchor_every=config.kv_int4_anchor_every,
            kv_jitter_seed=seed,
        )

    result = run(None)
    if config.kv_cache_dtype == "auto":
        return result
    fields = {name: getattr(result, name) for name in OracleResult.__dataclass_fields__}
    return CodecExpectation(**fields, replay=run)


def assert_matches_oracle(finished: FinishedEvent, expected, label: str = "") -> int:
    """Tokens and exit depths must equal the oracle's; the comparison may stop early only at
    the oracle's own near-ties (``services/oracle/near_tie.py``). Under a KV codec a
    mismatch may come from a code one float32 rounding from its boundary: one of
    ``JITTER_SEEDS`` oracle runs under K/V perturbed at float32's resolution must then give
    the engine's tokens, every one of them (a real difference, such as a wrong code or
    chain, is far beyond such noise; docs/kv_codecs.md, "What is exact"). Returns how many
    tokens were compared."""
    comparison = compare_with_oracle(finished, expected)
    replay = getattr(expected, "replay", None)
    if comparison.mismatch is not None and replay is not None:
        for seed in range(JITTER_SEEDS):
            again = compare_with_oracle(finished, replay(seed))
            if again.mismatch is None:
                return again.compared
    assert comparison.mismatch is None, (
        f"{label}: {comparison.mismatch}: engine {finished.token_ids} / {finished.exit_depths}"
        f" oracle {expected.token_ids} / {expected.exit_depths}"
    )
    return comparison.compared
