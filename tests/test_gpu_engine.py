"""The engine on CUDA: float32 against the serial oracle, and a bf16 smoke run.

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
from services.worker.static_decode import DecodeMode
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
