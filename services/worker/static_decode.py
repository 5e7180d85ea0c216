"""Decode passes with static shapes: padded to a row-count bucket, read from fixed input
buffers and written to fixed output buffers, so that on a GPU each bucket's pass is captured
once as a CUDA graph and replayed (one launch instead of hundreds).

Buckets are 1, 2, 4, ... up to ``max_rows``; a decode pass of n rows runs in the smallest
bucket that holds it, its padding rows masked (no KV write, no exit, a scratch pool row).
Passes with prompt rows, more rows than the largest bucket, log-probabilities asked for or
a structured output's rows run eagerly. On a CPU the same padded path runs eagerly under
``DecodeMode.PADDED``, so the oracle tests cover what a graph replays.
"""

from __future__ import annotations

import os
import time
from enum import StrEnum
from typing import Any, Protocol

import structlog
import torch

from services.worker.decode_pool import DecodePool
from services.worker.model.ouro import OuroModel
from services.worker.pass_inputs import DevicePass, PassShape
from services.worker.pass_plan import PassPlan, PassPlanner
from services.worker.rows import LiveRow
from services.worker.transfer import Transfer

_log = structlog.get_logger("rlt")


class DecodeMode(StrEnum):
    EAGER = "eager"  # unpadded passes, no graphs (the CPU default)
    PADDED = "padded"  # static padded decode passes, run eagerly (any device)
    GRAPHS = "graphs"  # static padded decode passes captured as CUDA graphs (CUDA default)

    @classmethod
    def default_for(cls, device: torch.device) -> DecodeMode:
        """``RLT_DECODE_MODE`` if set (``--no-cuda-graphs`` sets it to eager), else graphs
        on CUDA and eager elsewhere. Graphs need CUDA: asked for elsewhere, padded."""
        asked = os.environ.get("RLT_DECODE_MODE")
        mode = cls(asked) if asked else cls.GRAPHS if device.type == "cuda" else cls.EAGER
        return cls.PADDED if mode is cls.GRAPHS and device.type != "cuda" else mode


def buckets(max_rows: int) -> list[int]:
    out = [1]
    while out[-1] < max_rows:
        out.append(min(2 * out[-1], max_rows))
    return out


class PassRunner(Protocol):
    """What a static pass needs of the runner that owns it."""

    model: OuroModel
    block_size: int
    requests: dict[str, Any]
    planner: PassPlanner
    transfer: Transfer
    pool: DecodePool

    def pass_inputs(self, plan: PassPlan, device: DevicePass) -> torch.Tensor: ...

    def run_core(
        self, plan: PassPlan, device: DevicePass, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class _Captured:
    """One bucket's static buffers (and graph, on CUDA)."""

    def __init__(self, shape: PassShape, device: torch.device) -> None:
        self.shape = shape
        self.words = torch.zeros(shape.size, dtype=torch.int32, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.packed: torch.Tensor | None = None
        self.pool_version = -1


class StaticDecode:
    def __init__(self, runner: PassRunner, mode: DecodeMode, max_rows: int = 128) -> None:
        self.runner = runner
        self.mode = mode
        self.buckets = buckets(max_rows)
        cfg = runner.model.cfg
        self.table_width = -(-cfg.max_position_embeddings // runner.block_size)
        self._static: dict[tuple[int, bool], _Captured] = {}
        self.replays = 0  # passes that ran through a static bucket

    def capture_all(self) -> None:
        """Captures every bucket's greedy decode pass (start-up; sampling passes are captured
        on their first use) and logs what it captured and how long it took."""
        t0 = time.perf_counter()
        for bucket in self.buckets:
            blank = self.runner.planner.plan(
                [], self.runner.requests, False, pad_to=bucket, table_width=self.table_width
            )
            self._prepare(bucket, blank)
        _log.info(
            "cuda_graphs_ready",
            buckets=self.buckets,
            seconds=round(time.perf_counter() - t0, 3),
        )

    def try_run(self, active: list[LiveRow]) -> tuple[PassPlan, torch.Tensor] | None:
        """Runs ``active`` as a static decode pass if it is one; None: run it eagerly."""
        n = len(active)
        if n > self.buckets[-1] or not all(
            live.is_decode and live.row.token_count == 1 for live in active
        ):
            return None
        requests = self.runner.requests
        if any(requests[live.row.request_id].sampling.logprobs is not None for live in active):
            return None
        # token masks are filled on the host per pass: a captured graph has no step for them
        if any(requests[live.row.request_id].sampling.structured_output for live in active):
            return None
        bucket = next(b for b in self.buckets if b >= n)
        plan = self.runner.planner.plan(
            active,
            requests,
            False,
            pad_to=bucket,
            table_width=self.table_width,
        )
        static = self._prepare(bucket, plan)
        self.runner.transfer.to_device(plan.host.buffer, out=static.words)
        if static.graph is not None:
            static.graph.replay()
            assert static.packed is not None
            packed = static.packed
        else:
            packed = self._body(plan, static)
        self.replays += 1
        return plan, packed

    def _body(self, plan: PassPlan, static: _Captured) -> torch.Tensor:
        runner = self.runner
        device = DevicePass(static.shape, static.words)
        hidden = runner.pass_inputs(plan, device)
        packed, _ = runner.run_core(plan, device, hidden)
        return packed

    def _prepare(self, bucket: int, plan: PassPlan) -> _Captured:
        key = (bucket, plan.all_greedy)
        static = self._static.get(key)
        if static is None:
            static = self._static[key] = _Captured(plan.shape, self.runner.model.device)
        if self.mode is DecodeMode.GRAPHS and (
            static.graph is None or static.pool_version != self.runner.pool.version
        ):
            self._capture(static, plan)
        return static

    def _capture(self, static: _Captured, plan: PassPlan) -> None:
        """Captures the bucket's pass on all-padding inputs (every write goes to scratch)."""
        t0 = time.perf_counter()
        runner = self.runner
        blank = runner.planner.plan(
            [],
            runner.requests,
            False,
            pad_to=plan.shape.num_tokens,
            table_width=self.table_width,
        )
        blank.all_greedy, blank.filters = plan.all_greedy, not plan.all_greedy
        static.words.copy_(torch.from_numpy(blank.host.buffer))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: kernels compiled and autotuned outside the capture
                self._body(blank, static)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static.packed = self._body(blank, static)
        static.graph = graph
        static.pool_version = runner.pool.version
        _log.info(
            "cuda_graph_captured",
            rows=plan.shape.num_tokens,
            greedy=plan.all_greedy,
            seconds=round(time.perf_counter() - t0, 3),
        )
