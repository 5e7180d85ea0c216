"""A worker that loses its device state mid-generation: every request is recomputed on a
fresh worker (prompt again, known tokens replayed at their recorded exit depths) and the
outputs equal an uninterrupted run."""

from __future__ import annotations

import pytest

from messages.api import FinishedEvent, TokenEvent
from messages.sampling import SamplingParams
from services.common.config import SchedulerConfig
from services.engine.engine import LLMEngine
from services.engine.executor import InProcessExecutor
from services.worker.runner import ModelRunner

pytestmark = pytest.mark.unit

PARAMS = SamplingParams(
    max_tokens=10, temperature=0.0, min_loops=1, exit_threshold=0.7, ignore_eos=True
)
PROMPTS = {"a": [5, 9, 33, 71, 2, 18], "b": [101, 7, 7, 250], "c": [44, 45, 46, 47, 48, 49, 50]}


def finished(events) -> dict[str, FinishedEvent]:
    return {e.request_id: e for e in events if isinstance(e, FinishedEvent)}


@pytest.mark.parametrize(
    "mode",
    [
        {},
        {
            "wavefront_chunked_prefill": True,
            "async_scheduling": True,
            "prefill_chunk_size": 3,
            "enable_prefix_caching": True,
        },
    ],
)
@pytest.mark.parametrize("crash_step", [3, 9, 20])
def test_recompute_after_worker_loss_equals_uninterrupted_run(toy_model, mode, crash_step):
    config = SchedulerConfig(block_size=4, num_blocks=128, max_num_batched_tokens=8, **mode)

    def fresh_engine() -> LLMEngine:
        engine = LLMEngine(toy_model, config)
        for rid, prompt in PROMPTS.items():
            engine.add_request(rid, prompt, PARAMS)
        return engine

    expected = finished(fresh_engine().run_until_done())
    engine = fresh_engine()
    events = []
    for _ in range(crash_step):
        events += engine.step()
    # the worker dies: its in-flight results never arrive; a new one starts empty
    engine.core.reset_after_executor_loss()
    engine.runner = ModelRunner(toy_model, config.num_blocks, config.block_size, config.kv_layout)
    engine.core.executor = InProcessExecutor(engine.runner)
    events += engine.run_until_done()
    got = finished(events)
    for rid, want in expected.items():
        assert (got[rid].token_ids, got[rid].exit_depths) == (want.token_ids, want.exit_depths)
        # the client saw each token exactly once: replayed tokens are not streamed again
        streamed = [e for e in events if isinstance(e, TokenEvent) and e.request_id == rid]
        assert [e.index for e in streamed] == list(range(len(want.token_ids)))
    engine.scheduler.kv.check_consistency()
    assert engine.scheduler.kv.num_free_blocks == config.num_blocks
