"""The worker's host work per core pass, measured: what the simulated device charges beside
its roofline (``SimCostModel.host_pass_s`` / ``host_row_s``).

A pass's host side is the plan (``PassPlanner.plan``: flat inputs, one block table per
segment) and, for a token-sparse fragment, the live row of its active tokens
(``SparseFragments``: one row object holding their positions). Both are pure host work,
so they are timed here without a model or a device: a fragment of 1 and of ``rows``
active tokens over a request whose block table holds ``blocks`` blocks. The per-pass cost
is the 1-row plan, the per-row cost the slope.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from messages.batch import BatchRow, RowKind, WorkerSampling
from services.worker.passes.pass_plan import PassPlanner, RequestView
from services.worker.passes.rows import LiveRow
from services.worker.passes.transfer import Transfer


@dataclass(frozen=True)
class HostCost:
    pass_s: float  # a pass's host work that does not depend on its rows
    row_s: float  # each further row (a sparse fragment's active token)
    rows: int  # the largest pass timed
    blocks: int  # block-table length of the timed request


def _fragment(rows: int, total: int) -> list[LiveRow]:
    """A fragment of ``rows`` active tokens of one request at loop 2, spread over ``total``
    positions, as ``SparseFragments`` builds it: one live row holding their positions."""
    step = max(1, total // rows)
    positions = np.minimum(np.arange(rows, dtype=np.int64) * step, total - 1)
    part = BatchRow(
        request_id="r",
        kind=RowKind.PREFILL,
        token_start=int(positions[0]),
        token_count=rows,
        depth=2,
        num_loops=1,
    )
    live = LiveRow(0, part, 2, 1)
    live.positions = positions
    return [live]


def _time_pass(
    planner: PassPlanner,
    transfer: Transfer,
    requests: dict[str, RequestView],
    rows: int,
    total: int,
    repeats: int,
) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        planner.plan(_fragment(rows, total), requests, False)
        best = min(best, time.perf_counter() - t0)
        transfer.to_host(torch.zeros(1))  # the pass's staging buffer is free again
    return best


def measure_host_cost(
    rows: int = 2048, blocks: int = 2048, block_size: int = 16, repeats: int = 5
) -> HostCost:
    """The best of ``repeats`` timings of a 1-row and a ``rows``-row sparse pass."""
    transfer = Transfer(torch.device("cpu"))
    planner = PassPlanner(
        block_size,
        4,
        True,
        scratch_slot=blocks * block_size,
        scratch_pool_slot=0,
        host_words=transfer.host_words,
    )
    total = blocks * block_size
    sampling = WorkerSampling(
        temperature=0.0, top_p=1.0, top_k=0, seed=0, min_loops=1, max_loops=4, exit_threshold=1.0
    )
    tables = [list(range(blocks)) for _ in range(4)]
    requests = {"r": RequestView([1] * total, sampling, tables, 1)}
    one = _time_pass(planner, transfer, requests, 1, total, repeats)
    many = _time_pass(planner, transfer, requests, rows, total, repeats)
    return HostCost(one, max(0.0, (many - one) / (rows - 1)), rows, blocks)
