"""Decode passes with static shapes: padded to a row-count bucket, read from fixed input
buffers and written to fixed output buffers, so that on a GPU each bucket's pass is captured
once as a CUDA graph and replayed (one launch instead of hundreds).

Buckets are 1, 2, 4, ... up to ``max_rows``; a decode pass of n rows runs in the smallest
bucket that holds it, its padding rows masked (no KV write, no exit, a scratch pool row).
Each bucket has three variants (``Variant``): no coda, for a loop where no row may exit (the
host knows each row's min and max loops), which reads no lm_head and copies no KV; a greedy
coda; and a sampled one. Passes with prompt rows, more rows than the largest bucket,
log-probabilities asked for or a structured output's rows run eagerly. On a CPU the same
padded path runs eagerly under ``DecodeMode.PADDED``, so the oracle tests cover what a graph
replays.

On CUDA every variant of every bucket is captured at start (``capture_all``, logged with its
time and memory) into one shared memory pool, before the worker serves: nothing is captured
while serving. Graphs of one pool reuse each other's scratch memory, so a replay's results
are valid until the next replay: the runner reads them (or copies them) before that.
"""

from __future__ import annotations

import functools
import os
import time
from enum import StrEnum
from typing import Any, Protocol

import structlog
import torch

from services.worker.model.ouro import OuroModel
from services.worker.passes.decode_pool import DecodePool
from services.worker.passes.pass_inputs import DevicePass, PassShape
from services.worker.passes.pass_plan import PassPlan, PassPlanner
from services.worker.passes.rows import LiveRow
from services.worker.passes.transfer import Transfer

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


@functools.cache
def _warmup_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream of every capture's warm-up: torch gives each stream a cuBLAS
    workspace of its own (tens of MiB, kept for good), so a stream per capture would hold
    one per graph."""
    return torch.cuda.Stream(device)


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


class Variant(StrEnum):
    """What a static pass runs after the core loop."""

    NO_CODA = "no_coda"  # no row may exit at this loop: exit rule and pool write only
    GREEDY = "greedy"  # the coda, every wanted row greedy (one argmax)
    SAMPLED = "sampled"  # the coda and the sampler (top-k/top-p where a row asks)

    @classmethod
    def of(cls, plan: PassPlan) -> Variant:
        if not plan.shape.num_coda:
            return cls.NO_CODA
        return cls.GREEDY if plan.all_greedy else cls.SAMPLED


class _Captured:
    """One bucket variant's static buffers (and graph, on CUDA)."""

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
        self._static: dict[tuple[int, Variant], _Captured] = {}
        self.replays = 0  # passes that ran through a static bucket
        self.captures = 0  # graphs captured (all at start unless the decode pool grew)
        self.capture_bytes = 0  # device memory the captures reserved (their shared pool)
        self._pool: Any = None  # the graphs' shared memory pool (CUDA)

    def capture_all(self) -> None:
        """Captures every variant of every bucket (start-up, before serving) into one shared
        memory pool, and logs how long it took and the memory it reserved."""
        t0 = time.perf_counter()
        device = self.runner.model.device
        # each capture empties the allocator's cache: emptied first, what that frees (a
        # backend probe's buffers, say) is not taken off the graphs' memory
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(device)
        for bucket in self.buckets:
            for variant in Variant:
                self._prepare(bucket, variant, capture=True)
        torch.cuda.synchronize(device)
        self.capture_bytes = max(0, torch.cuda.memory_reserved(device) - before)
        free, total = torch.cuda.mem_get_info(device)
        _log.info(
            "cuda_graphs_ready",
            buckets=self.buckets,
            variants=[str(v) for v in Variant],
            graphs=len(self._static),
            seconds=round(time.perf_counter() - t0, 3),
            pool_mib=round(self.capture_bytes / 2**20, 1),
            free_gib=round(free / 2**30, 2),
            total_gib=round(total / 2**30, 2),
        )

    def graph(self, bucket: int, variant: Variant) -> torch.cuda.CUDAGraph | None:
        """The captured graph of a bucket variant (None: not captured), for benchmarks that
        time a replay alone; it replays the last inputs its bucket ran."""
        static = self._static.get((bucket, variant))
        return static.graph if static is not None else None

    def try_run(self, active: list[LiveRow]) -> tuple[PassPlan, torch.Tensor] | None:
        """Runs ``active`` as a static decode pass if it is one; None: run it eagerly. The
        packed results live in the bucket's static output until the next static pass."""
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
        static = self._prepare(bucket, Variant.of(plan))
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

    def _prepare(self, bucket: int, variant: Variant, capture: bool = False) -> _Captured:
        key = (bucket, variant)
        static = self._static.get(key)
        if static is None:
            shape = self._blank(bucket, variant).shape
            static = self._static[key] = _Captured(shape, self.runner.model.device)
        if self.mode is DecodeMode.GRAPHS and (
            static.graph is None or static.pool_version != self.runner.pool.version
        ):
            if not capture:
                # only a decode pool that had to grow gets here (its rows moved): the
                # graphs read the old rows, so they are captured again
                _log.warning("cuda_graph_recaptured_while_serving", bucket=bucket)
            self._capture(static, bucket, variant)
        return static

    def _blank(self, bucket: int, variant: Variant) -> PassPlan:
        """An all-padding plan of the variant's shape: every write goes to scratch."""
        runner = self.runner
        blank = runner.planner.plan(
            [],
            runner.requests,
            False,
            pad_to=bucket,
            table_width=self.table_width,
            with_coda=variant is not Variant.NO_CODA,
        )
        blank.all_greedy = variant is not Variant.SAMPLED
        blank.filters = variant is Variant.SAMPLED
        return blank

    def _capture(self, static: _Captured, bucket: int, variant: Variant) -> None:
        """Captures the variant's pass on all-padding inputs into the shared pool."""
        t0 = time.perf_counter()
        blank = self._blank(bucket, variant)
        static.words.copy_(torch.from_numpy(blank.host.buffer))
        stream = _warmup_stream(self.runner.model.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: kernels compiled and autotuned outside the capture
                self._body(blank, static)
        torch.cuda.current_stream().wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            static.packed = self._body(blank, static)
        static.graph = graph
        static.pool_version = self.runner.pool.version
        self.captures += 1
        _log.debug(
            "cuda_graph_captured",
            rows=bucket,
            variant=str(variant),
            seconds=round(time.perf_counter() - t0, 3),
        )
