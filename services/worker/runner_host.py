"""What a worker computes with: the model (or, for ``device="sim"``, only its checkpoint's
config) and the runner built over one KV geometry, rebuilt at each reset.

A KV geometry the device cannot hold is refused before the runner is rebuilt
(``check_geometry``), so a scheduler asking for too much gets a failed batch instead of a
worker that died allocating. With CUDA graphs the KV is sized after the capture: at load a
runner over one KV block captures every graph, and the memory that took is kept free of KV
for the real runner's own capture (which runs before it serves). No NATS here: the worker
service decides when to reset.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from pathlib import Path

import structlog
import torch

from kernels.kv_codec import (
    AUTO,
    DEFAULT_BATCH_LIMITS,
    INT4_DELTA,
    BatchLimits,
    open_blocks_bound,
    tail_reserve_blocks,
)
from kernels.kv_codec import check as check_codec
from services.common.config import KVLayout
from services.common.model_config import OuroConfig
from services.common.tokenizer import TextCodec
from services.worker.kv_cache import PagedKV, bytes_per_block, check_storable
from services.worker.kv_int4.paged import Int4KV
from services.worker.kv_int4.store import TailPoolStats
from services.worker.kv_transfer.arena import KVArena
from services.worker.model.ouro import OuroModel
from services.worker.passes.static_decode import DecodeMode
from services.worker.runner import ModelRunner
from services.worker.sampling.grammar import GrammarBook
from services.worker.sim import SimRunner

SIM_DEVICE = "sim"
# KV block size of the graph-memory probe (the graphs' memory does not depend on it)
_PROBE_BLOCK_SIZE = 16

_log = structlog.get_logger("rlt")


class RunnerHost:
    """Loads the model once; builds a ``ModelRunner`` (or a ``SimRunner``) per KV geometry."""

    def __init__(
        self,
        checkpoint: str | Path,
        device: str,
        dtype: torch.dtype,
        *,
        sim_kv: bool = False,
        before_replace: Callable[[], None] | None = None,
        kv_cache_dtype: str = AUTO,
        kv_int4_anchor_every: int = 0,
        batch_limits: BatchLimits = DEFAULT_BATCH_LIMITS,
    ) -> None:
        """``sim_kv``: a simulated device gets host KV arenas too (no compute reads them), so
        a disaggregation bench moves real bytes between simulated workers.
        ``before_replace``: called before a runner is dropped for a new one, so that
        whatever else holds its KV (the KV transfer agent) lets go of it first.
        ``kv_cache_dtype``: the server's KV codec (every runner it builds stores it), and
        ``kv_int4_anchor_every`` int4-delta's anchor interval. ``batch_limits``: the
        scheduler's, which bound the int4-delta tails its batches hold open."""
        check_storable(kv_cache_dtype)  # refused at start, by name
        self.kv_cache_dtype = kv_cache_dtype
        self.batch_limits = batch_limits
        self.kv_int4_anchor_every = kv_int4_anchor_every
        self.sim_kv = sim_kv
        self.before_replace = before_replace
        self.checkpoint = Path(checkpoint)
        self.device = device
        self.dtype = dtype
        self.simulated = device == SIM_DEVICE
        self.model: OuroModel | None = None
        self.runner: ModelRunner | SimRunner | None = None
        # structured outputs (the checkpoint's tokenizer); kept across runner rebuilds
        self.grammars: GrammarBook | None = None
        self._sim_config: OuroConfig | None = None
        # device memory the CUDA graphs of a runner take (measured at load), kept out of KV
        self.graph_reserve_bytes = 0

    def load(self) -> None:
        """Blocking (reads the checkpoint): the service runs it on a thread."""
        if self.simulated:
            # no weights: the checkpoint's config gives depths, vocabulary and EOS ids
            self._sim_config = OuroConfig.from_checkpoint(self.checkpoint)
            return
        self.model = OuroModel.from_checkpoint(
            self.checkpoint, dtype=self.dtype, device=self.device
        )
        codec = TextCodec.from_checkpoint(self.checkpoint)
        if codec is not None:  # without a tokenizer a structured output fails its row
            cfg = self.model.cfg
            self.grammars = GrammarBook(codec, cfg.vocab_size, cfg.stop_token_ids)
        device = self.model.device
        if device.type == "cuda" and DecodeMode.default_for(device) is DecodeMode.GRAPHS:
            self.graph_reserve_bytes = self._measure_graph_memory()

    def _measure_graph_memory(self) -> int:
        """Captures every graph over a one-block KV cache and returns the memory it took."""
        assert self.model is not None
        t0 = time.perf_counter()
        probe = ModelRunner(self.model, 1, _PROBE_BLOCK_SIZE, decode_mode=DecodeMode.GRAPHS)
        assert probe.static is not None
        reserve = probe.static.capture_bytes
        del probe
        gc.collect()
        torch.cuda.empty_cache()
        _log.info(
            "cuda_graph_memory_measured",
            mib=round(reserve / 2**20, 1),
            seconds=round(time.perf_counter() - t0, 2),
        )
        return reserve

    def close(self) -> None:
        if self.grammars is not None:
            self.grammars.close()

    def check_geometry(self, num_blocks: int, block_size: int, kv_layout: str) -> None:
        """Refuses a KV geometry that cannot be allocated, instead of dying trying."""
        KVLayout(kv_layout)  # ValueError for an unknown layout
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"bad KV geometry: {num_blocks} blocks of {block_size}")
        if self.simulated:
            return  # no device memory
        assert self.model is not None
        cfg = self.model.cfg
        check_codec(self.kv_cache_dtype, cfg.head_dim, block_size)  # int4-delta: bs >= 2
        elem = torch.empty((), dtype=self.model.dtype).element_size()
        # codes, scales and all: what PagedKV allocates per block id
        per_block = bytes_per_block(
            self.kv_cache_dtype,
            cfg.num_hidden_layers,
            block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
            elem,
        )
        # int4-delta: and its reserve of full-precision tail blocks (what Int4Store starts at)
        planes = cfg.total_ut_steps if KVLayout(kv_layout) == KVLayout.LAST_EXITED else 1
        open_bound = open_blocks_bound(planes, block_size, self.batch_limits)
        tails = tail_reserve_blocks(self.kv_cache_dtype, num_blocks + 1, open_bound)
        tail_block = bytes_per_block(
            AUTO, cfg.num_hidden_layers, block_size, cfg.num_key_value_heads, cfg.head_dim, elem
        )
        need = num_blocks * per_block + tails * tail_block
        runner = self.runner
        # a runner with graphs frees their pool with itself: the next one captures in it
        holds_graphs = isinstance(runner, ModelRunner) and runner.static is not None
        reserve = 0 if holds_graphs and runner.static.captures else self.graph_reserve_bytes
        limit = kv_memory_limit(self.device, self._kv_bytes(), reserve)
        if need > limit:
            raise MemoryError(
                f"KV cache of {num_blocks} blocks x {block_size} needs {need / 2**30:.2f} GiB, "
                f"only {limit / 2**30:.2f} GiB available (RLT_WORKER_MAX_KV_BYTES; "
                f"{reserve / 2**30:.2f} GiB kept for CUDA graphs)"
            )

    @property
    def total_loops(self) -> int:
        cfg = self._sim_config if self.simulated else (self.model.cfg if self.model else None)
        assert cfg is not None, "load() first"
        return cfg.total_ut_steps

    def int4_tails(self) -> TailPoolStats | None:
        """The current runner's int4-delta tail pool (None: another codec, or no runner)."""
        runner = self.runner  # once: the compute thread may replace it meanwhile
        if isinstance(runner, ModelRunner) and runner.int4 is not None:
            return runner.int4.store.tail_stats()
        return None

    def _kv_bytes(self) -> int:
        runner = self.runner  # once: the compute thread may replace it meanwhile
        if not isinstance(runner, ModelRunner):
            return 0
        return runner.kv.nbytes

    def make_runner(self, num_blocks: int, block_size: int, kv_layout: str) -> None:
        # on the compute thread (or at setup): allocating device KV can take a while
        if self.runner is not None and self.before_replace is not None:
            self.before_replace()
        self.runner = None  # free the old KV before allocating the new one
        # a runner and its static decode passes refer to each other: only the cyclic
        # collector frees them, and it would not run before the new KV is allocated
        gc.collect()
        if self.simulated:
            assert self._sim_config is not None
            dilation = float(os.environ.get("RLT_SIM_DILATION", "1"))
            self.runner = SimRunner.h200(
                self._sim_config,
                dilation=dilation,
                kv_cache_dtype=self.kv_cache_dtype,
                kv_int4_anchor_every=self.kv_int4_anchor_every,
            )
            if self.sim_kv:
                self.runner.kv_arena = sim_arena(
                    num_blocks,
                    block_size,
                    self.kv_cache_dtype,
                    self.kv_int4_anchor_every,
                    self.batch_limits,
                )
        else:
            assert self.model is not None
            runner = ModelRunner(
                self.model,
                num_blocks,
                block_size,
                KVLayout(kv_layout),
                grammars=self.grammars,
                kv_cache_dtype=self.kv_cache_dtype,
                kv_int4_anchor_every=self.kv_int4_anchor_every,
                batch_limits=self.batch_limits,
            )
            self.runner = runner
            if runner.model.device.type == "cuda":
                free, _total = torch.cuda.mem_get_info(runner.model.device)
                _log.info(
                    "kv_cache_allocated",
                    gib=round(runner.kv.nbytes / 2**30, 2),
                    graph_reserve_mib=round(self.graph_reserve_bytes / 2**20, 1),
                    free_gib_after=round(free / 2**30, 2),
                )


def kv_memory_limit(device: str, current_kv_bytes: int, reserve_bytes: int = 0) -> int:
    """Bytes a new KV cache may take: ``RLT_WORKER_MAX_KV_BYTES`` if set, else the cache
    being replaced plus what the device has free, with headroom on the free part only (a
    cache rebuilt at the size it has always fits), less ``reserve_bytes`` kept for what is
    allocated after the KV (the CUDA graphs' pool)."""
    configured = os.environ.get("RLT_WORKER_MAX_KV_BYTES")
    if configured:
        return int(configured)
    if device.startswith("cuda") and torch.cuda.is_available():
        dev = torch.device(device)
        free, _total = torch.cuda.mem_get_info(dev)
        # what torch's allocator holds unused is free to us too (mem_get_info omits it)
        cached = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
        return kv_budget(current_kv_bytes, free + cached, 0.95, reserve_bytes)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    return kv_budget(current_kv_bytes, available, 0.8, reserve_bytes)
    except OSError:
        pass
    return 1 << 62  # unknown platform: no check


def kv_budget(current_kv_bytes: int, free_bytes: int, share: float, reserve_bytes: int) -> int:
    """The cache being replaced, plus ``share`` of the free memory, less the reserve."""
    return current_kv_bytes + int(share * free_bytes) - reserve_bytes


def sim_arena(
    num_blocks: int,
    block_size: int,
    codec: str = AUTO,
    anchor_every: int = 0,
    limits: BatchLimits = DEFAULT_BATCH_LIMITS,
) -> KVArena:
    """Host KV arenas shaped as Ouro-1.4B's (16 KV heads x 128, bfloat16; the device the
    simulation prices) under ``codec`` (fp8: codes and scales; int4-delta: packed codes,
    scales, zero points and flags), with ``RLT_SIM_KV_LAYERS``
    of its 24 layers (default 1, so a simulated worker holds 1/24 of the real bytes: the
    bench states the real ones beside), one block past the pool as a real runner has."""
    from services.worker.model.toy import toy_config

    cfg = toy_config("1.4b")
    layers = int(os.environ.get("RLT_SIM_KV_LAYERS", "1"))
    geometry = (layers, num_blocks + 1, block_size, cfg.num_key_value_heads, cfg.head_dim)
    cpu = torch.device("cpu")
    if codec == INT4_DELTA:
        planes = cfg.total_ut_steps
        int4 = Int4KV(*geometry, torch.bfloat16, cpu, planes, anchor_every, limits)
        return KVArena.of(int4)
    return KVArena.of(PagedKV(codec, *geometry, dtype=torch.bfloat16, device=cpu))
