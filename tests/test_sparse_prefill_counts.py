"""What a token-sparse loop costs the host per batch does not grow with its active rows: the
same torch ops (counted as ``test_pass_counts.py`` counts them) and the same host/device
copies and waits (every one goes through ``Transfer``) for a window that keeps 1 token as
for one that keeps 2,048. A fragment's rows move between the pass and the prompt's hidden
rows in one gather per request each way, and its block table is built once per segment."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

import pytest

from messages.batch import Batch, BatchResult
from messages.sampling import SamplingParams
from services.common.config import SchedulerConfig
from services.engine.engine import LLMEngine
from services.worker.model.ouro import OuroModel
from services.worker.model.toy import random_weights, toy_config
from services.worker.sim import SimCostModel, SimRunner
from tests.helpers import OpCounter

pytestmark = pytest.mark.unit

PROMPT = 2304  # one window; both runs freeze some of its tokens
ROWS = 2048
BLOCK = 16


@dataclass
class SparseBatch:
    rows: int  # pass rows of the batch's sparse fragments (its active tokens)
    ops: Counter[str]
    to_device: int
    to_host: int  # each one a wait for the device
    readback: int  # copies to the host that do not wait


def _sparse_batches(keep: float) -> tuple[list[SparseBatch], tuple[int, int]]:
    """The batches that run the sparse loops of one 2,304-token window whose late loops
    keep ``keep`` of its tokens (retention 1, 1, keep, keep), and how many windows opened
    with a choice made ahead and with one that waited for the device."""
    cfg = replace(toy_config("toy"), max_position_embeddings=4096)
    model = OuroModel(cfg, dict(random_weights(cfg)))
    config = SchedulerConfig(
        block_size=BLOCK,
        num_blocks=4 * PROMPT // BLOCK + 8,
        max_num_batched_tokens=2 * PROMPT,
        prefill_chunk_size=PROMPT,
        split_prefill=True,
        sparse_window=PROMPT,
    )
    engine = LLMEngine(model, config)
    runner = engine.runner
    execute = runner.execute
    found: list[SparseBatch] = []

    def counted(batch: Batch) -> BatchResult:
        fragments = [r for r in batch.rows if r.fragment is not None]
        if not fragments:
            return execute(batch)
        counts = runner.transfer.counts
        before = (counts.to_device, counts.to_host, counts.readback)
        with OpCounter() as counter:
            result = execute(batch)
        found.append(
            SparseBatch(
                sum(f.fragment.active_end - f.fragment.active_start for f in fragments),
                counter.ops,
                counts.to_device - before[0],
                counts.to_host - before[1],
                counts.readback - before[2],
            )
        )
        return result

    runner.execute = counted  # type: ignore[method-assign]
    params = SamplingParams(
        max_tokens=1,
        temperature=0.0,
        ignore_eos=True,
        token_sparse_prefill=True,
        prefill_retention=[1.0, 1.0, keep, keep],
    )
    engine.add_request("long", [(7 * i) % 500 + 1 for i in range(PROMPT)], params)
    engine.run_until_done()
    return found, (runner.sparse.num_chosen_ahead, runner.sparse.num_chosen_waiting)


def test_host_copies_waits_and_ops_per_sparse_batch_do_not_grow_with_active_rows() -> None:
    one, one_opened = _sparse_batches(1e-6)  # ceil(2304 * 1e-6) = 1 token per sparse loop
    every, every_opened = _sparse_batches(0.8888)  # ceil(2304 * 0.8888) = 2,048
    assert [b.rows for b in one] == [1, 1]
    assert [b.rows for b in every] == [ROWS, ROWS]
    for few, many in zip(one, every, strict=True):
        assert (few.to_device, few.to_host, few.readback) == (
            many.to_device,
            many.to_host,
            many.readback,
        )
        assert _launches(few.ops) == _launches(many.ops)
    # each batch opens its loop's window with the choice made on the device after the
    # batch that wrote the window's last scores (no read of its own) and brings its results
    # back: one wait. Inputs and the frozen tokens' K/V copy go down in one copy each; loop
    # 2 (loop 3 is the last) also sends the window's score positions and its candidates
    # for loop 3, whose choice comes back without a wait
    assert [(b.to_device, b.to_host, b.readback) for b in every] == [(4, 1, 1), (2, 1, 0)]
    assert one_opened == every_opened == (2, 0)  # both loops' windows: chosen ahead
    assert sum(_launches(every[0].ops).values()) < 80


def _launches(ops: Counter[str]) -> Counter[str]:
    """Ops that launch work: an allocation (the staging buffers grow at their own pace)
    launches nothing."""
    return Counter({op: n for op, n in ops.items() if not op.startswith("aten.empty")})


def test_the_simulated_device_charges_each_sparse_row_its_host_work(toy_model) -> None:
    """``SimCostModel.host_row_s`` per active token of a fragment, beside the roofline: with
    a host cost far above the device's, a prompt's sparse loops take their rows' host time
    (32 + 16 active tokens, each pass's plan paid before its launch)."""
    cfg = toy_model.cfg

    def simulated(host_row_s: float) -> float:
        cost = replace(SimCostModel.for_model(cfg), host_row_s=host_row_s)
        sim = SimRunner(cfg, cost, sleep=False)
        config = SchedulerConfig(block_size=4, num_blocks=64, sparse_window=64)
        engine = LLMEngine(toy_model, config, simulated=sim)
        params = SamplingParams(
            max_tokens=1,
            temperature=0.0,
            ignore_eos=True,
            token_sparse_prefill=True,
            prefill_retention=[1.0, 1.0, 0.5, 0.25],
        )
        engine.add_request("p", [(5 * i) % 500 + 1 for i in range(64)], params)
        engine.run_until_done()
        return sim.simulated_s

    assert simulated(1.0) - simulated(0.0) == pytest.approx(48.0, rel=1e-3)
