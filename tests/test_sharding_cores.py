"""The pure pieces of sharding, without NATS: the per-producer prefix lookup, the router's
cost and policies, the shard table (announcements, refused reports, loss), the relay's
fencing of moved requests, resuming a request from known outputs (tokens, exit depths and
text equal an uninterrupted run), and the simulated device."""

from __future__ import annotations

from pathlib import Path

import pytest
import structlog

from messages.api import ErrorEvent, FinishedEvent, TokenEvent
from messages.batch import WorkerSampling
from messages.internal import AdmittedRequest, RelayedEvent, SchedulerLoad, ShardAnnounce
from messages.prefix import BlockStored, PrefixEventBatch
from messages.sampling import SamplingParams
from services.admission.core import OpenRequests, seed_from_request_id
from services.admission.router import IndexGate, RecentRoutes, RoutePolicy, Router
from services.admission.shards import Refusal, ShardLoad, ShardTable, ShardTableConfig
from services.common.config import KVAdmission, ModelLimits, SchedulerConfig
from services.common.tokenizer import TextCodec
from services.engine.executor import InProcessExecutor
from services.prefix_cache.core import PrefixIndex
from services.prefix_cache.liveness import ProducerLiveness
from services.scheduler.core.intake import KnownOutputs
from services.scheduler.engine_core import EngineCore
from services.worker.model.ouro import OuroModel
from services.worker.model.toy import toy_config
from services.worker.runner import ModelRunner
from services.worker.sim import SimCostModel, SimRunner
from tests.helpers import run_on

pytestmark = pytest.mark.unit


# ---------------------------------------------------------------------- prefix index
def _stored(pid: str, seq: int, hashes: list[int]) -> PrefixEventBatch:
    return PrefixEventBatch(
        producer_id=pid, epoch="e1", event_seq=seq, events=[BlockStored(block_hashes=hashes)]
    )


def test_index_answers_every_producers_leading_run() -> None:
    index = PrefixIndex()
    index.apply(_stored("a", 1, [1, 2, 3]))
    index.apply(_stored("b", 1, [1, 2]))
    index.apply(_stored("c", 1, [2, 3]))  # no block 1: never a leading run
    assert index.overlaps([1, 2, 3, 4]) == {"a": 3, "b": 2}
    assert index.overlaps([9]) == {}
    reply = index.lookup([1, 2, 3], per_producer=True)
    assert (reply.producer_id, reply.num_blocks, reply.overlaps) == ("a", 3, {"a": 3, "b": 2})
    assert index.lookup([1, 2, 3]).overlaps == {}  # only when asked


def test_silent_producers_are_reported_once() -> None:
    live = ProducerLiveness(lost_s=2.0)
    live.heard("a", 0.0)
    live.heard("b", 1.0)
    assert live.gone(2.5, connected_since=0.0) == ["a"]
    assert live.gone(2.6, connected_since=0.0) == []  # once
    assert live.gone(5.0, connected_since=4.0) == []  # our own outage does not count
    assert live.gone(6.5, connected_since=4.0) == ["b"]
    # producers the index holds (a snapshot, a replay) that never reported here must start
    # reporting; watching again does not reset the clock of one already watched or heard
    live.watch(["c", "d"], 10.0)
    live.heard("d", 11.0)
    live.watch(["c", "d"], 11.5)
    assert live.gone(12.5, connected_since=0.0) == ["c"]
    assert live.gone(13.5, connected_since=0.0) == ["d"]


# ---------------------------------------------------------------------- router
def _load(sid: str, *, active: int = 0, waiting: int = 0, running: int = 0) -> ShardLoad:
    return ShardLoad(sid, f"scheduler-{sid}", running, 0, waiting, waiting, active, 100, 0.0)


def test_prefix_router_weighs_overlap_against_load() -> None:
    router = Router(RoutePolicy.PREFIX, block_size=16)
    shards = [_load("0"), _load("1"), _load("2")]
    # 10 prompt blocks; shard 1 caches 8 of them: it saves 8 blocks of prefill
    assert router.choose(shards, 160, {"1": 8}).shard_id == "1"
    # the prefix in use there by a running request (its 8 blocks + 2 of its own) is no
    # reason to go elsewhere: a new request would share those blocks
    warm = [_load("0"), _load("1", active=10, running=1), _load("2")]
    assert router.choose(warm, 160, {"1": 8}).shard_id == "1"
    # 8 blocks saved three times (prefill at weight 2, and memory): 23 more active blocks
    # do not outweigh them, 25 do
    busy = [_load("0"), _load("1", active=23), _load("2")]
    assert router.choose(busy, 160, {"1": 8}).shard_id == "1"
    busier = [_load("0"), _load("1", active=25), _load("2")]
    assert router.choose(busier, 160, {"1": 8}).shard_id != "1"
    # queued prompts count as prefill to come
    queued = [_load("0", waiting=16 * 20), _load("1"), _load("2")]
    assert router.choose(queued, 160, None).shard_id != "0"
    # least-loaded ignores the overlap
    least = Router(RoutePolicy.LEAST_LOADED, block_size=16)
    assert least.choose([_load("0"), _load("1", active=1)], 160, {"1": 8}).shard_id == "0"


def test_ties_spread_and_round_robin_cycles() -> None:
    router = Router(RoutePolicy.PREFIX, block_size=16)
    picks = {router.choose([_load("0"), _load("1"), _load("2")], 32).shard_id for _ in range(3)}
    assert picks == {"0", "1", "2"}  # equal costs: not all to the lowest id
    rr = Router(RoutePolicy.ROUND_ROBIN, block_size=16)
    shards = [_load("1", active=99), _load("0")]
    assert [rr.choose(shards, 32, {"0": 2}).shard_id for _ in range(4)] == ["0", "1", "0", "1"]


def test_recent_routes_and_the_index_gate() -> None:
    recent = RecentRoutes(ttl_s=10.0)
    recent.record([1, 2, 3], "a", now=0.0)
    recent.record([1, 2, 7], "b", now=1.0)  # the same prefix later went to b
    assert recent.overlaps([1, 2, 3, 4], now=2.0) == {"b": 2}
    assert recent.overlaps([1, 2], now=20.0) == {}  # expired
    recent.record([5, 6], "c", now=30.0)
    recent.forget_shard("c")
    assert recent.overlaps([5, 6], now=30.0) == {}

    gate = IndexGate(retry_s=1.0)
    assert gate.should_ask(0.0)
    assert gate.failed(0.0)  # went down: log it
    assert not gate.failed(0.1)  # still down: no second log line
    assert not gate.should_ask(0.5) and gate.should_ask(1.2)
    assert gate.succeeded() and not gate.succeeded()


# ---------------------------------------------------------------------- shard table
def _announce(sid: str, inst: str, block_size: int = 16) -> ShardAnnounce:
    return ShardAnnounce(
        shard_id=sid, scheduler_id=inst, producer_id=f"p{sid}", block_size=block_size
    )


def _report(sid: str, inst: str, seq: int, **kw: object) -> SchedulerLoad:
    return SchedulerLoad(scheduler_id=inst, shard_id=sid, report_seq=seq, time=1000.0, **kw)  # type: ignore[arg-type]


def test_shard_table_applies_only_good_reports() -> None:
    table = ShardTable("adm", block_size=16, config=ShardTableConfig(lost_s=2.0, fresh_s=1.0))
    assert table.apply(_report("0", "s0", 1), 0.0, 1000.0) is Refusal.UNKNOWN
    assert table.announce(_announce("0", "s0"), 0.0) == (None, None)
    assert table.apply(_report("0", "s0", 1, num_running=2), 0.0, 1000.0) is None
    assert table.apply(_report("0", "s0", 1), 0.1, 1000.0) is Refusal.STALE  # not newer
    assert table.apply(_report("0", "s0", 2), 0.1, 2000.0) is Refusal.STALE  # too old
    assert table.apply(_report("", "s0", 3), 0.1, 1000.0) is Refusal.MALFORMED
    assert table.apply(_report("bad id!", "s0", 3), 0.1, 1000.0) is Refusal.MALFORMED
    assert table.apply(_report("0", "other", 3), 0.1, 1000.0) is Refusal.UNKNOWN
    # a shard whose block size differs from ours is refused: hashes would never match
    why, _ = table.announce(_announce("1", "s1", block_size=4), 0.0)
    assert why is not None and "block size" in why and "1" not in table.shards
    assert [s.shard_id for s in table.routable(0.5)] == ["0"]
    # a new scheduler instance for the shard: the old one is gone
    assert table.announce(_announce("0", "s0b"), 1.0) == (None, "s0")
    # the sends since the last report count as waiting until a report acknowledges them
    table.apply(_report("0", "s0b", 1), 1.0, 1000.0)
    table.sent("0", 5, 100, 1.0, prefill=36)  # 64 of its 100 tokens expected cached there
    load = table.load(table.shards["0"], 1.0)
    assert (load.waiting_tokens, load.waiting_prefill_tokens) == (100, 36)
    table.apply(_report("0", "s0b", 2, last_admission_seq={"adm": 5}), 1.1, 1000.0)
    assert table.load(table.shards["0"], 1.1).waiting_tokens == 0
    assert table.silent(3.0, connected_since=0.0) == []
    assert [s.shard_id for s in table.silent(3.2, connected_since=0.0)] == ["0"]


def test_routable_prefers_shards_with_a_worker() -> None:
    table = ShardTable("adm", block_size=16)
    for sid in ("0", "1"):
        table.announce(_announce(sid, f"s{sid}"), 0.0)
    table.apply(_report("0", "s0", 1, has_worker=False), 0.0, 1000.0)
    table.apply(_report("1", "s1", 1), 0.0, 1000.0)
    assert [s.shard_id for s in table.routable(0.1)] == ["1"]
    assert [s.shard_id for s in table.without_worker(0.6, grace_s=0.5)] == ["0"]
    table.apply(_report("1", "s1", 2, has_worker=False), 0.2, 1000.0)
    assert {s.shard_id for s in table.routable(0.3)} == {"0", "1"}  # none healthy: any


# ---------------------------------------------------------------------- relay
def _tok(i: int, token: int = 7) -> RelayedEvent:
    return RelayedEvent(
        seq=1, event=TokenEvent(request_id="r", index=i, token_id=token, exit_depth=2, text="")
    )


def test_relay_passes_each_index_once_and_fences_moved_requests() -> None:
    table = OpenRequests(scheduler_lost_s=5.0)
    admitted = AdmittedRequest(
        request_id="r", prompt_token_ids=[1], params=SamplingParams(), reply_subject="_INBOX.r"
    )
    entry = table.opened(1, "r", "_INBOX.r", "", 0.0, shard="0", admitted=admitted)
    assert table.relayed("0", _tok(0))[1] is not None
    assert table.relayed("0", _tok(0))[1] is None  # a duplicate index never reaches the client
    assert table.relayed("1", _tok(1))[1] is None  # from a shard it is not on
    assert table.relayed("0", _tok(1, token=9))[1] is not None
    assert (entry.token_ids, entry.exit_depths) == ([7, 9], [2, 2])
    table.moved(entry, 2, "1", 1.0)
    # the old copy's events (old seq) are dropped; the new shard's continue the stream
    assert table.relayed("0", _tok(2)) == (None, None)
    new = RelayedEvent(
        seq=2, event=TokenEvent(request_id="r", index=2, token_id=5, exit_depth=1, text="")
    )
    assert table.relayed("1", new)[1] is not None
    # "unavailable" leaves the entry open (the caller may move it); a finished event closes it
    unavailable = ErrorEvent(request_id="r", code="unavailable", message="x")
    assert table.relayed("1", RelayedEvent(seq=2, event=unavailable))[1] is unavailable
    assert len(table) == 1
    done = FinishedEvent(
        request_id="r",
        finish_reason="length",
        token_ids=[7, 9, 5],
        exit_depths=[2, 2, 1],
        num_prompt_tokens=1,
    )
    assert table.relayed("1", RelayedEvent(seq=2, event=done))[1] is done
    assert len(table) == 0
    assert seed_from_request_id("r") == seed_from_request_id("r") != seed_from_request_id("s")


def test_admission_keeps_each_tokens_shed_budget_for_a_move() -> None:
    table = OpenRequests(scheduler_lost_s=5.0)
    admitted = AdmittedRequest(
        request_id="r", prompt_token_ids=[1], params=SamplingParams(), reply_subject="_INBOX.r"
    )
    entry = table.opened(1, "r", "_INBOX.r", "", 0.0, shard="0", admitted=admitted)
    for i, budget in enumerate([None, 2, None]):
        event = TokenEvent(
            request_id="r", index=i, token_id=7, exit_depth=2, text="", depth_budget=budget
        )
        table.relayed("0", RelayedEvent(seq=1, event=event))
    moved = entry.resumed(admitted, 2, "1")
    assert (moved.admission_seq, moved.shard_id) == (2, "1")
    assert (moved.resume_token_ids, moved.resume_exit_depths) == ([7, 7, 7], [2, 2, 2])
    assert moved.resume_depth_budgets == [None, 2, None]
    # a resync (a retry re-attached the stream) brings the scheduler's view
    table.relayed("0", RelayedEvent(seq=1, known_token_ids=[7], known_exit_depths=[4]))
    assert entry.resumed(admitted, 3, "1").resume_depth_budgets == []  # nothing was shed
    table.relayed(
        "0",
        RelayedEvent(
            seq=1, known_token_ids=[7, 8], known_exit_depths=[4, 2], known_depth_budgets=[None, 2]
        ),
    )
    assert entry.resumed(admitted, 4, "1").resume_depth_budgets == [None, 2]


# ---------------------------------------------------------------------- resume
def _engine(
    model: OuroModel,
    codec: TextCodec | None = None,
    blocks: int = 256,
    config: dict[str, object] | None = None,
) -> EngineCore:
    config = SchedulerConfig(
        **(config or {}),  # type: ignore[arg-type]
        block_size=4,
        num_blocks=blocks,
        prefill_chunk_size=4,
        max_num_batched_tokens=16,
        async_scheduling=True,
        wavefront_chunked_prefill=True,
    )
    runner = ModelRunner(model, config.num_blocks, config.block_size, config.kv_layout)
    return EngineCore(
        config, ModelLimits.from_model_config(model.cfg), InProcessExecutor(runner), codec=codec
    )


def _run(core: EngineCore) -> list:  # type: ignore[type-arg]
    events = []
    while core.has_unfinished_requests():
        events += core.step()
    return events


@pytest.mark.parametrize("known", [1, 4, 11])
def test_resumed_request_equals_an_uninterrupted_run(
    toy_model: OuroModel, toy_checkpoint: Path, known: int
) -> None:
    codec = TextCodec.from_checkpoint(toy_checkpoint)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, min_loops=1,
                            exit_threshold=0.6)  # fmt: skip
    prompt = [5, 9, 13, 2, 8, 21, 4]
    whole = _engine(toy_model, codec)
    whole.add_request("r", prompt, params)
    events = _run(whole)
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    (final,) = [e for e in events if isinstance(e, FinishedEvent)]
    assert len(set(final.exit_depths)) > 1  # the replay must reproduce early exits

    resumed = _engine(toy_model, codec)
    done = resumed.add_request(
        "r",
        prompt,
        params,
        known_outputs=KnownOutputs(final.token_ids[:known], final.exit_depths[:known]),
    )
    assert done == []
    events = _run(resumed)
    rest = [e for e in events if isinstance(e, TokenEvent)]
    (end,) = [e for e in events if isinstance(e, FinishedEvent)]
    # it streams from the next index only, and ends exactly as the uninterrupted run
    assert [e.index for e in rest] == list(range(known, 12))
    assert (end.token_ids, end.exit_depths, end.text) == (
        final.token_ids,
        final.exit_depths,
        final.text,
    )
    # what the first shard streamed plus what the second streamed is the whole text
    assert "".join(e.text for e in tokens[:known] + rest) == final.text
    assert resumed.scheduler.kv.num_free_blocks == resumed.scheduler.kv.num_blocks


def test_a_resumed_request_keeps_the_depth_budgets_its_first_shard_shed(
    toy_model: OuroModel,
) -> None:
    """Both shards shed (budget 2 of 4): the resumed request reports every shed token,
    those its first shard ran included, and ends as the uninterrupted run."""
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, min_loops=1)
    prompt = [5, 9, 13, 2, 8]

    def shedding() -> EngineCore:
        core = _engine(toy_model, config={"overload_policy": "shed-depth"})
        core.scheduler._state.depth_budget = 2  # as an overload left it
        return core

    whole = shedding()
    whole.add_request("r", prompt, params)
    events = _run(whole)
    budgets = [e.depth_budget for e in events if isinstance(e, TokenEvent)]
    (final,) = [e for e in events if isinstance(e, FinishedEvent)]
    assert budgets[0] is None and set(budgets[1:]) == {2} and final.shed_tokens == 9
    known = 6
    resumed = shedding()
    resumed.add_request(
        "r",
        prompt,
        params,
        known_outputs=KnownOutputs(
            final.token_ids[:known], final.exit_depths[:known], budgets[:known]
        ),
    )
    # what a resync would tell a retry's admission
    assert resumed.scheduler.requests["r"].shed_depth_budgets() == budgets[:known]
    (end,) = [e for e in _run(resumed) if isinstance(e, FinishedEvent)]
    assert (end.token_ids, end.exit_depths) == (final.token_ids, final.exit_depths)
    assert (end.shed_tokens, end.depth_budgets) == (9, final.depth_budgets)


def test_resumed_request_that_already_ended_finishes_at_once(toy_model: OuroModel) -> None:
    core = _engine(toy_model)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    done = core.add_request("r", [1, 2, 3], params, known_outputs=KnownOutputs([4, 5], [4, 4]))
    assert [type(e) for e in done] == [FinishedEvent]
    assert done[0].finish_reason == "length" and not core.has_unfinished_requests()
    with pytest.raises(ValueError, match="exit depth"):
        core.add_request("s", [1, 2, 3], params, known_outputs=KnownOutputs([4], [9]))
    for budgets, match in (([2, 2], "depth budgets"), ([4], "depth budget"), ([0], "depth budget")):
        with pytest.raises(ValueError, match=match):
            core.add_request("t", [1, 2, 3], params, known_outputs=KnownOutputs([4], [4], budgets))


# ---------------------------------------------------------------------- the sim device
def test_sim_cost_model_is_calibrated_on_ouro_1_4b_on_an_h200() -> None:
    cost = SimCostModel.for_model(toy_config("1.4b"))
    assert cost.core_weight_bytes == pytest.approx(2.466e9, rel=0.01)
    assert cost.kv_bytes_per_token == 196_608
    assert cost.core_pass_s(1, 0, 0) == pytest.approx(2.466e9 / 4.8e12, rel=0.01)  # ~0.51 ms
    # 64 decode rows over 1024-token contexts: the KV read is bigger than the weights
    assert cost.core_pass_s(64, 64 * 1024, 64 * 1024) > 2 * cost.core_pass_s(1, 0, 0)
    # a 2048-token prefill chunk is compute-bound
    assert cost.core_pass_s(2048, 2048, 2048 * 1024) > 2048 * 2 * cost.core_params / 989e12 * 0.99


def _sim_engine(limits: ModelLimits, blocks: int) -> tuple[EngineCore, SimRunner]:
    config = SchedulerConfig(
        block_size=4,
        num_blocks=blocks,
        prefill_chunk_size=4,
        max_num_batched_tokens=16,
        max_num_seqs=8,
        async_scheduling=True,
        kv_admission=KVAdmission.INCREMENTAL,
    )
    cfg = toy_config("toy")
    runner = SimRunner(cfg, SimCostModel.for_model(toy_config("1.4b")), sleep=False)
    return EngineCore(config, limits, InProcessExecutor(runner)), runner  # type: ignore[arg-type]


def test_sim_outputs_are_a_function_of_seed_and_position_even_under_preemption() -> None:
    limits = ModelLimits.from_model_config(toy_config("toy"))
    results = []
    for blocks in (4096, 40):  # plenty of KV; then so little that requests are preempted
        core, runner = _sim_engine(limits, blocks)
        for i in range(6):
            params = SamplingParams(max_tokens=10, seed=100 + i, min_loops=1, exit_threshold=0.5)
            core.add_request(f"r{i}", list(range(1, 6 + i)), params)
        finished = {e.request_id: e for e in _run(core) if isinstance(e, FinishedEvent)}
        results.append((finished, core.scheduler.stats.num_preemptions, runner))
    (calm, none, runner), (tight, preempted, _) = results
    assert none == 0 and preempted > 0
    for rid, event in calm.items():
        assert (event.token_ids, event.exit_depths) == (
            tight[rid].token_ids,
            tight[rid].exit_depths,
        )
        i = int(rid[1:])
        sampling = WorkerSampling(temperature=0.0, top_p=1.0, top_k=0, seed=100 + i, min_loops=1,
                                  max_loops=4, exit_threshold=0.5)  # fmt: skip
        prompt = 5 + i
        assert event.token_ids == [runner.token_at(100 + i, prompt + k) for k in range(10)]
        # the first token comes from the full-depth prompt; the others exit where the
        # function says for the position that was fed
        assert event.exit_depths[0] == 4
        assert event.exit_depths[1:] == [
            runner.exit_loops_at(sampling, prompt + k - 1) for k in range(1, 10)
        ]
    assert runner.simulated_s > 0 and runner.stats.core_passes > 0


# ---------------------------------------------------------------------- a shard lost, in pure form
def _shard(toy_checkpoint: Path, shard: str, model: OuroModel):  # type: ignore[no-untyped-def]
    from services.common.checkpoint import load_model_limits
    from services.scheduler.driver.driver import SchedulerDriver

    config = SchedulerConfig(
        block_size=4,
        num_blocks=256,
        async_scheduling=True,
        wavefront_chunked_prefill=True,
        prefill_chunk_size=3,
        enable_prefix_caching=True,
    )
    codec = TextCodec.from_checkpoint(toy_checkpoint)
    driver = SchedulerDriver(
        config, load_model_limits(toy_checkpoint), codec, instance=f"s{shard}", shard_id=shard
    )
    driver.bind(f"w{shard}")
    runner = ModelRunner(model, config.num_blocks, config.block_size, config.kv_layout)
    return driver, runner


def _pump(driver, runner, table: OpenRequests, client: list, steps: int) -> None:  # type: ignore[no-untyped-def]
    """``steps`` driver steps; relayed events go through admission's table to the client."""
    for _ in range(steps):
        out = driver.step()
        assert not out.deliveries  # every event goes through admission
        for wb in out.batches:
            driver.on_result(run_on(runner, wb))
        for relay in out.relays:
            _, event = table.relayed(driver.shard_id, relay.item, driver.instance)
            if event is not None:
                client.append(event)
        if driver.idle:
            return


def test_a_lost_shards_stream_goes_on_elsewhere_each_index_once(
    toy_model: OuroModel, toy_checkpoint: Path
) -> None:
    import msgspec

    from tests.conftest_nats import check_stream

    params = SamplingParams(
        max_tokens=14, temperature=0.8, top_k=20, ignore_eos=True, min_loops=1, exit_threshold=0.6
    )  # sampled, not greedy: the seed admission fixed must carry over
    prompt = [11, 3, 250, 9, 48, 7, 7, 130]
    first = AdmittedRequest(
        request_id="r",
        prompt_token_ids=prompt,
        params=msgspec.structs.replace(params, seed=seed_from_request_id("r")),
        reply_subject="_INBOX.r",
        admission_id="adm",
        admission_seq=1,
        shard_id="0",
        relay_subject="rlt.v1.adm.adm.relay.events",
    )
    table = OpenRequests(scheduler_lost_s=5.0)
    entry = table.opened(1, "r", "_INBOX.r", "", 0.0, shard="0", admitted=first)
    client: list = []
    a, runner_a = _shard(toy_checkpoint, "0", toy_model)
    b, runner_b = _shard(toy_checkpoint, "1", toy_model)
    a.add(first, track="rlt.v1.adm.adm.1")
    entry.owner = "s0"
    _pump(a, runner_a, table, client, steps=12)
    assert 0 < len(entry.token_ids) < 14
    # shard 0 is lost: admission resubmits with what the client has, under a new seq
    moved = msgspec.structs.replace(
        first,
        admission_seq=2,
        shard_id="1",
        resume_token_ids=list(entry.token_ids),
        resume_exit_depths=list(entry.exit_depths),
    )
    table.moved(entry, 2, "1", 1.0)
    b.add(moved, track="rlt.v1.adm.adm.2")
    # the old shard, still running somewhere, keeps producing: all of it is dropped
    _pump(a, runner_a, table, client, steps=200)
    _pump(b, runner_b, table, client, steps=400)
    assert b.idle and len(table) == 0
    final = check_stream(client)  # indices 0..13 once each, text adds up, one terminal
    assert isinstance(final, FinishedEvent) and final.shard == "1"
    # the same as an uninterrupted run on one shard
    c, runner_c = _shard(toy_checkpoint, "2", toy_model)
    alone = OpenRequests(scheduler_lost_s=5.0)
    alone.opened(1, "r", "_INBOX.r", "", 0.0, shard="2", admitted=first)
    whole: list = []
    c.add(msgspec.structs.replace(first, shard_id="2"))
    _pump(c, runner_c, alone, whole, steps=400)
    ref = check_stream(whole)
    assert isinstance(ref, FinishedEvent)
    assert (final.token_ids, final.exit_depths, final.text) == (
        ref.token_ids,
        ref.exit_depths,
        ref.text,
    )


class _FenceHost:
    """A scheduler service as far as its fence's dropping goes."""

    instance_id = "s0"
    bus_connected = True
    bus_connected_since = 0.0

    def __init__(self, driver) -> None:  # type: ignore[no-untyped-def]
        self.driver = driver
        self.log = structlog.get_logger("test")

    def live_tries(self):  # type: ignore[no-untyped-def]
        return self.driver.tries()

    def drop_fenced(self, keys):  # type: ignore[no-untyped-def]
        return self.driver.drop_fenced(keys)


def test_fenced_tries_lose_their_unsent_relayed_events(
    toy_model: OuroModel, toy_checkpoint: Path
) -> None:
    """While a scheduler is dark its relayed events wait in its fence; the tries admission
    fenced meanwhile are dropped from them (a short one that ended meanwhile included), the
    others are kept in order."""
    from services.scheduler.fencing import Fence

    driver, runner = _shard(toy_checkpoint, "0", toy_model)
    fence = Fence(_FenceHost(driver), reconnect_grace_s=0.0, scheduler_lost_s=10.0)  # type: ignore[arg-type]
    relay = "rlt.v1.adm.adm.relay.events"
    for seq, max_tokens in ((1, 2), (2, 30), (3, 30)):
        driver.add(
            AdmittedRequest(
                request_id=f"r{seq}",
                prompt_token_ids=[5, 6, 7, seq],
                params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                reply_subject=f"_INBOX.{seq}",
                admission_id="adm",
                admission_seq=seq,
                relay_subject=relay,
            ),
            track=f"rlt.v1.adm.adm.{seq}",
        )
    for _ in range(30):  # nothing sent: as if dark
        out = driver.step()
        fence.held_relays += out.relays
        for wb in out.batches:
            driver.on_result(run_on(runner, wb))
    assert "r1" not in driver.streams  # ended while its events waited
    assert fence.drop({("adm", 1), ("adm", 2), ("other", 3)}) == {("adm", 1), ("adm", 2)}
    assert "r2" not in driver.streams and "r3" in driver.streams  # r2 ends without a word
    items = [relay.item for relay in fence.held_relays]
    assert {item.seq for item in items} == {3}
    indices = [item.event.index for item in items if isinstance(item.event, TokenEvent)]
    assert indices == list(range(len(indices))) and indices


def test_a_scheduler_forgets_admissions_that_stopped_submitting(toy_checkpoint: Path) -> None:
    """Its load reports name each admission's newest submission; admission instances come
    and go (restarts), so one silent for ADMISSION_FORGET_S leaves the reports."""
    import msgspec

    from services.common.checkpoint import load_model_limits
    from services.scheduler.driver.driver import SchedulerDriver
    from services.scheduler.driver.load_report import ADMISSION_FORGET_S

    driver = SchedulerDriver(SchedulerConfig(), load_model_limits(toy_checkpoint))
    params = msgspec.structs.replace(SamplingParams(max_tokens=2), seed=1)
    for i, admission in enumerate(["old", "new"]):
        driver.add(
            AdmittedRequest(
                request_id=f"r{i}",
                prompt_token_ids=[1, 2, 3],
                params=params,
                reply_subject=f"_INBOX.{i}",
                admission_id=admission,
                admission_seq=7 + i,
                relay_subject=f"rlt.v1.adm.{admission}.relay.events",
            )
        )
    assert driver.load().last_admission_seq == {"old": 7, "new": 8}
    driver.load_report.admission_heard["old"] -= ADMISSION_FORGET_S + 1  # silent since
    assert driver.load().last_admission_seq == {"new": 8}
