"""Depth-aware paged KV on the real runner: the LAST_EXITED exit copy touches exactly the
exited token's slots in higher planes, and SHARED really is a different layout."""

from __future__ import annotations

import pytest
import torch

from messages.sampling import SamplingParams
from services.common.config import KVLayout, SchedulerConfig
from services.engine.engine import LLMEngine
from tests.engine_harness import assert_matches_oracle, oracle_result

D = 4


def slot(table: list[int], position: int, block_size: int) -> int:
    return table[position // block_size] * block_size + position % block_size


@pytest.mark.unit
def test_exit_copy_writes_only_the_exited_tokens_higher_planes(toy_model) -> None:
    config = SchedulerConfig(
        block_size=4, num_blocks=64, split_prefill=False, async_scheduling=False
    )
    engine = LLMEngine(toy_model, config)
    runner = engine.runner
    engine.add_request(
        "x",
        [5, 17, 33, 9, 41],
        SamplingParams(
            max_tokens=10, temperature=0.0, min_loops=1, exit_threshold=0.5, ignore_eos=True
        ),
    )
    checked = 0
    original_execute = runner.execute

    def watched_execute(wire):
        before_k = runner.k_cache.clone()
        result = original_execute(wire)
        for row, res in zip(wire.rows, result.rows, strict=True):
            if row.kind != "decode" or not res.exited or res.exit_loops == D:
                continue
            nonlocal checked
            checked += 1
            e = res.exit_loops - 1
            tables = runner.requests[row.request_id].tables
            p = row.token_start
            bs = config.block_size
            written = {slot(tables[e], p, bs)} | {slot(tables[j], p, bs) for j in range(e + 1, D)}
            flat_after = runner.k_cache.flatten(1, 2)
            flat_before = before_k.flatten(1, 2)
            for j in range(e + 1, D):
                assert torch.equal(
                    flat_after[:, slot(tables[j], p, bs)], flat_after[:, slot(tables[e], p, bs)]
                )
            changed = (flat_after != flat_before).any(dim=(0, 2, 3)).nonzero().flatten().tolist()
            assert set(changed) <= written, f"slots {set(changed) - written} changed unexpectedly"
        return result

    runner.execute = watched_execute
    engine.run_until_done()
    assert checked >= 2, "the workload produced too few early exits to check"


@pytest.mark.oracle
def test_shared_layout_differs_from_last_exited_and_each_matches_its_oracle(
    toy_model, oracle
) -> None:
    prompt = [12, 7, 99, 4, 250, 31]
    params = SamplingParams(
        max_tokens=10, temperature=0.0, min_loops=1, exit_threshold=0.6, ignore_eos=True
    )
    results = {}
    for layout in KVLayout:
        config = SchedulerConfig(kv_layout=layout, block_size=4, num_blocks=64)
        engine = LLMEngine(toy_model, config)
        (finished,) = engine.generate([prompt], params)
        expected = oracle_result(oracle, prompt, params.resolve(D, 512), config)
        assert assert_matches_oracle(finished, expected, str(layout)) > 0
        results[layout] = (finished.token_ids, finished.exit_depths)
    # history read at depth min(d, e) vs the final version: the outputs must diverge
    assert results[KVLayout.SHARED] != results[KVLayout.LAST_EXITED]
