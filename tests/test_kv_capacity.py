"""KV accounting: everything comes back after finish, abort and worker error; requests that
do not fit now wait and then run; requests that can never fit are refused at once."""

from __future__ import annotations

import pytest

from messages.api import ErrorEvent, FinishedEvent
from messages.errors import RequestError
from messages.sampling import SamplingParams
from services.common.config import SchedulerConfig
from services.engine.engine import LLMEngine
from tests.engine_harness import Arrival, run_workload

pytestmark = pytest.mark.unit

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_blocks_return_after_finish(toy_model) -> None:
    config = SchedulerConfig(block_size=4, num_blocks=64)
    record = run_workload(toy_model, config, [Arrival("a", [1, 2, 3, 4, 5], GREEDY)])
    assert record.finished["a"].finish_reason == "length"  # run_workload checked the KV


def test_blocks_return_after_abort_mid_decode(toy_model) -> None:
    config = SchedulerConfig(block_size=4, num_blocks=64, async_scheduling=True)
    engine = LLMEngine(toy_model, config)
    engine.add_request(
        "a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    )
    engine.add_request("b", [6, 7, 8], GREEDY)
    for _ in range(12):
        engine.step()
    assert engine.scheduler.kv.num_free_blocks < config.num_blocks
    events = engine.abort_request("a")
    assert isinstance(events[-1], FinishedEvent) and events[-1].finish_reason == "abort"
    rest = engine.run_until_done()
    # b still finishes normally; a produces nothing more
    assert [e.request_id for e in rest if isinstance(e, FinishedEvent)] == ["b"]
    assert all(e.request_id != "a" for e in rest)
    engine.scheduler.kv.check_consistency()
    assert engine.scheduler.kv.num_free_blocks == config.num_blocks


def test_blocks_return_after_worker_error(toy_model) -> None:
    config = SchedulerConfig(block_size=4, num_blocks=64)
    engine = LLMEngine(toy_model, config)
    engine.add_request("a", [1, 2, 3], GREEDY)
    engine.step()  # prefill

    def broken(_batch):
        raise RuntimeError("device fell over")

    engine.runner.execute = broken
    events = engine.run_until_done()
    errors = [e for e in events if isinstance(e, ErrorEvent)]
    assert len(errors) == 1 and errors[0].request_id == "a"
    assert "device fell over" in errors[0].message
    assert engine.scheduler.kv.num_free_blocks == config.num_blocks


def test_over_capacity_requests_wait_then_run(toy_model) -> None:
    # each request needs ceil(9/4)*4 = 12 blocks; 20 blocks hold one at a time
    config = SchedulerConfig(block_size=4, num_blocks=20, max_num_seqs=4)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    arrivals = [Arrival(f"r{i}", [10 + i, 11, 12, 13, 14], params) for i in range(3)]
    record = run_workload(toy_model, config, arrivals)
    ample = run_workload(toy_model, SchedulerConfig(block_size=4, num_blocks=200), arrivals)
    for a in arrivals:
        assert record.finished[a.request_id].token_ids == ample.finished[a.request_id].token_ids
    # capacity really was the constraint: the tight run needed more steps
    assert len(record.batches) > len(ample.batches)


def test_never_fitting_request_is_refused_with_a_message(toy_model) -> None:
    engine = LLMEngine(toy_model, SchedulerConfig(block_size=4, num_blocks=8))
    with pytest.raises(RequestError, match="KV blocks"):
        engine.add_request("big", list(range(1, 30)), GREEDY)
    assert not engine.has_unfinished_requests()
