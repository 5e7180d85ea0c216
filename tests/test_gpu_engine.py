"""The engine on CUDA: float32 against the serial oracle, and a bf16 smoke run; graphs
captured at start for every bucket and variant, never while serving; the KV sized after the
graphs' memory is known; the start-up backend choices.

Needs CUDA and skips cleanly without. Run on a lent GPU with ``pytest -m gpu
tests/test_gpu_engine.py`` (the image lacks msgspec and structlog: carry them as
``docs/gpu.md`` says; the suite's conftest needs them). The fused ops themselves are
checked against their CPU references by the ``gpu`` test of ``tests/test_kernel_ops.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from messages.sampling import SamplingParams
from services.common.config import SchedulerConfig
from services.engine.engine import LLMEngine
from services.oracle import SerialOracle
from services.worker.model.ouro import OuroModel
from services.worker.passes.static_decode import DecodeMode
from tests.engine_harness import assert_matches_oracle, oracle_result

pytestmark = pytest.mark.gpu

CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


@requires_cuda
@pytest.mark.parametrize("mode", ["eager", "graphs"])
def test_engine_cuda_fp32_matches_oracle(
    toy_checkpoint: Path, oracle: SerialOracle, mode: str
) -> None:
    """Float32 on CUDA stays on the oracle (DESIGN §6), early exit included, with unpadded
    passes and with decode passes replayed from CUDA graphs."""
    config = SchedulerConfig(block_size=4, num_blocks=256)
    model = OuroModel.from_checkpoint(toy_checkpoint, device="cuda")
    engine = LLMEngine(model, config, decode_mode=DecodeMode(mode))
    prompts = [[5, 17, 42, 99, 3], [250, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19], [300]]
    for threshold, min_loops in ((1.0, 2), (0.7, 1)):
        params = SamplingParams(
            max_tokens=8,
            temperature=0.0,
            ignore_eos=True,
            exit_threshold=threshold,
            min_loops=min_loops,
        )
        for prompt, fin in zip(prompts, engine.generate(prompts, params), strict=True):
            assert_matches_oracle(fin, oracle_result(oracle, prompt, params, config), mode)


@requires_cuda
def test_engine_cuda_bf16_runs(toy_checkpoint: Path) -> None:
    """bf16 on CUDA: the whole path runs and yields in-vocab tokens (agreement with the
    float32 oracle is reported, not asserted, by scripts/device_check.py)."""
    model = OuroModel.from_checkpoint(toy_checkpoint, dtype=torch.bfloat16, device="cuda")
    engine = LLMEngine(model, SchedulerConfig(block_size=16, num_blocks=64))
    assert engine.runner.k_cache.dtype == torch.bfloat16
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for fin in engine.generate([[1, 2, 3], [4, 5]], params):
        assert len(fin.token_ids) == 6
        assert all(0 <= t < model.cfg.vocab_size for t in fin.token_ids)


@requires_cuda
def test_graphs_are_captured_at_start_in_one_pool_and_never_while_serving(
    toy_checkpoint: Path, oracle: SerialOracle
) -> None:
    """Every bucket's three variants are captured when the runner is built; serving greedy,
    sampled and early-exit rows replays them and captures nothing more."""
    from services.worker.passes.static_decode import Variant, buckets

    config = SchedulerConfig(block_size=4, num_blocks=256)
    model = OuroModel.from_checkpoint(toy_checkpoint, device="cuda")
    engine = LLMEngine(model, config, decode_mode=DecodeMode.GRAPHS)
    static = engine.runner.static
    assert static is not None
    expected = len(buckets(128)) * len(Variant)
    assert static.captures == expected and static.capture_bytes > 0
    prompts = [[5, 17, 42, 99, 3], [250, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19], [300]]
    greedy = SamplingParams(
        max_tokens=8, temperature=0.0, ignore_eos=True, exit_threshold=0.7, min_loops=2
    )
    sampled = SamplingParams(
        max_tokens=8, temperature=0.8, top_p=0.9, top_k=40, seed=5, ignore_eos=True
    )
    for prompt, fin in zip(prompts, engine.generate(prompts, greedy), strict=True):
        assert_matches_oracle(fin, oracle_result(oracle, prompt, greedy, config), "graphs")
    engine.generate(prompts, sampled)
    assert static.captures == expected and static.replays > 0


@requires_cuda
def test_kv_is_sized_after_the_graphs_memory_is_known(toy_checkpoint: Path) -> None:
    from services.worker.runner_host import RunnerHost

    host = RunnerHost(toy_checkpoint, "cuda", torch.float32)
    host.load()
    assert host.graph_reserve_bytes > 0  # measured by capturing every graph at load
    host.make_runner(64, 16, "last_exited")
    runner = host.runner
    assert runner is not None and runner.static is not None and runner.static.captures > 0
    free, _ = torch.cuda.mem_get_info()
    per_block = 2 * model_bytes_per_block(runner)
    with pytest.raises(MemoryError, match="kept for CUDA graphs"):
        host.check_geometry(int(2 * free / per_block) + 1, 16, "last_exited")


def model_bytes_per_block(runner) -> int:  # type: ignore[no-untyped-def]
    """K (or V) bytes of one block of 16 positions over every layer."""
    cfg = runner.model.cfg
    elem = runner.k_cache.element_size()
    return cfg.num_hidden_layers * 16 * cfg.num_key_value_heads * cfg.head_dim * elem


@requires_cuda
def test_the_triton_sampler_is_chosen_for_drawing_the_references_tokens() -> None:
    """At start the Triton sampler must draw exactly the torch reference's tokens on this
    GPU (the sampler's contract); flash-attn is chosen only where it is exact and faster."""
    from kernels.ops.backends import select_backends

    choices = {
        c.op: c
        for c in select_backends(
            torch.device("cuda"),
            vocab_size=49152,
            num_heads=16,
            kv_heads=16,
            head_dim=128,
            block_size=16,
            dtype=torch.bfloat16,
        )
    }
    assert choices["sample"].backend == "triton", choices["sample"].reason
    assert choices["paged_attention"].backend in ("triton", "flash_attn_4")
