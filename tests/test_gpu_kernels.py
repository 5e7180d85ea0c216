"""GPU kernels against the float32 torch reference on CPU (bf16 tolerances).

Everything here needs CUDA (flash tests also a usable flash-attn) and skips cleanly without.
Run on a lent GPU through ``scripts/device_check.py`` or ``pytest tests/test_gpu_kernels.py``.
Kernel tests import only torch and ``kernels`` so they run on a bare GPU image; the engine
tests need msgspec (the engine's messages) and skip if it is missing.
"""

from __future__ import annotations

import math
import random
import tempfile
from pathlib import Path

import pytest
import torch

from kernels import (
    FlashBackend,
    SdpaBackend,
    Segment,
    build_attention_metadata,
    copy_kv_slots,
    flash_unsupported_reason,
    paged_attention,
    select_attention_backend,
    write_kv,
)
from services.oracle import SerialOracle
from services.worker.model.ouro import OuroModel
from services.worker.model.toy import write_toy_checkpoint

pytestmark = pytest.mark.gpu

CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
HEAD_DIM = 64  # flash-attn needs head_dim % 8 == 0
SCALE = 1.0 / math.sqrt(HEAD_DIM)
# Mixed decode (1 row with history) and prefill (many rows, with and without history).
LAYOUTS = [
    [(1, 9), (5, 3), (1, 0), (3, 17)],
    [(1, 300), (1, 40), (17, 0), (1, 700), (40, 260)],
    [(64, 0), (64, 0)],  # SDPA's is_causal fast path
]


def _flash_reason(block_size: int) -> str | None:
    if not CUDA:
        return "needs a CUDA device"
    return flash_unsupported_reason(torch.device("cuda"), torch.bfloat16, block_size, HEAD_DIM)


requires_flash = pytest.mark.skipif(
    _flash_reason(256) is not None, reason=f"flash unusable: {_flash_reason(256)}"
)


def _case(
    layout: list[tuple[int, int]], block_size: int, kv_heads: int, group: int, seed: int
) -> dict:
    """A pass in float32 on CPU: bf16-representable values, shuffled block tables, history."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [-(-(p + n) // block_size) + rng.randint(0, 1) for n, p in layout]
    num_blocks = sum(need) + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    segments, row = [], 0
    for (n, p), nb in zip(layout, need, strict=True):
        table, perm = perm[:nb], perm[nb:]
        segments.append(Segment(row_start=row, num_rows=n, pos_start=p, block_table=table))
        row += n

    def bf16_values(*shape: int) -> torch.Tensor:
        # Rounded through bf16 so the CPU reference sees exactly the GPU kernel's inputs.
        return torch.randn(*shape, generator=gen).to(torch.bfloat16).float()

    shape = (num_blocks, block_size, kv_heads, HEAD_DIM)
    k_cache, v_cache = bf16_values(*shape), bf16_values(*shape)
    rng.shuffle(segments)
    return {
        "segments": segments,
        "num_rows": row,
        "block_size": block_size,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "q": bf16_values(row, kv_heads * group, HEAD_DIM),
        "k": bf16_values(row, kv_heads, HEAD_DIM),
        "v": bf16_values(row, kv_heads, HEAD_DIM),
    }


def _reference(case: dict) -> torch.Tensor:
    meta = build_attention_metadata(case["segments"], case["block_size"], case["num_rows"])
    kc, vc = case["k_cache"].clone(), case["v_cache"].clone()
    write_kv(kc, vc, meta.slot_mapping, case["k"], case["v"])
    return paged_attention(case["q"], kc, vc, meta, SCALE)


def _on_gpu(case: dict, backend) -> torch.Tensor:
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    meta = build_attention_metadata(
        case["segments"], case["block_size"], case["num_rows"], device=dev
    )
    kc, vc = case["k_cache"].to(dev, bf16), case["v_cache"].to(dev, bf16)
    write_kv(kc, vc, meta.slot_mapping, case["k"].to(dev, bf16), case["v"].to(dev, bf16))
    backend.prepare(meta)
    out = backend.forward(case["q"].to(dev, bf16), kc, vc, meta, SCALE)
    assert out.dtype == bf16 and out.device.type == "cuda"
    return out.float().cpu()


@requires_cuda
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("block_size", [1, 16, 256])
@pytest.mark.parametrize("group", [1, 2])
def test_sdpa_cuda_bf16(layout: list[tuple[int, int]], block_size: int, group: int) -> None:
    case = _case(layout, block_size, kv_heads=2, group=group, seed=block_size + group)
    torch.testing.assert_close(_on_gpu(case, SdpaBackend()), _reference(case), rtol=2e-2, atol=2e-2)


@requires_flash
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("group", [1, 2])
def test_flash_cuda_bf16(layout: list[tuple[int, int]], group: int) -> None:
    case = _case(layout, 256, kv_heads=2, group=group, seed=11 + group)
    torch.testing.assert_close(
        _on_gpu(case, FlashBackend()), _reference(case), rtol=2e-2, atol=2e-2
    )


@requires_cuda
def test_cuda_selection() -> None:
    backend = select_attention_backend("cuda", torch.bfloat16, 256, HEAD_DIM)
    expected = SdpaBackend if _flash_reason(256) else FlashBackend
    assert isinstance(backend, expected), backend.reason
    # A block size flash cannot take always falls back to sdpa, with the reason.
    small = select_attention_backend("cuda", torch.bfloat16, 16, HEAD_DIM, prefer="flash")
    assert isinstance(small, SdpaBackend) and "falling back to sdpa" in small.reason
    fp32 = select_attention_backend("cuda", torch.float32, 256, HEAD_DIM)
    assert isinstance(fp32, SdpaBackend)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_write_kv_cuda(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    shape = (7, 4, 2, HEAD_DIM)
    slots = torch.randperm(28, generator=gen)[:11]
    k, v = torch.randn(11, 2, HEAD_DIM, generator=gen), torch.randn(11, 2, HEAD_DIM, generator=gen)
    kc, vc = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    write_kv(kc, vc, slots, k, v)
    gk, gv = torch.zeros(shape, dtype=dtype, device="cuda"), torch.zeros_like(kc, device="cuda")
    write_kv(gk, gv, slots.cuda(), k.cuda(), v.cuda())  # float32 rows cast on write
    assert torch.equal(gk.cpu(), kc) and torch.equal(gv.cpu(), vc)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_copy_kv_slots_cuda(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    shape = (3, 6, 4, 2, HEAD_DIM)  # [L, blocks, block_size, kvh, hd]
    kc = torch.randn(shape, generator=gen).to(dtype)
    vc = torch.randn(shape, generator=gen).to(dtype)
    src = torch.tensor([0, 5, 5, 13, 22])
    dst = torch.tensor([5, 6, 7, 1, 23])  # src/dst overlap: sources gathered first
    gk, gv = kc.cuda(), vc.cuda()
    copy_kv_slots(kc, vc, src, dst)
    copy_kv_slots(gk, gv, src.cuda(), dst.cuda())
    assert torch.equal(gk.cpu(), kc) and torch.equal(gv.cpu(), vc)


@requires_cuda
@pytest.mark.parametrize("backend", ["sdpa", "reference"])
def test_engine_cuda_fp32_matches_oracle(
    toy_checkpoint: Path, oracle: SerialOracle, backend: str
) -> None:
    """Float32 on CUDA stays on the oracle (DESIGN §6), early exit included."""
    pytest.importorskip("msgspec")
    from messages.sampling import SamplingParams
    from services.common.config import SchedulerConfig
    from services.engine.engine import LLMEngine
    from services.worker.runner import ModelRunner
    from tests.engine_harness import assert_matches_oracle, oracle_result

    config = SchedulerConfig(block_size=4, num_blocks=256)
    model = OuroModel.from_checkpoint(toy_checkpoint, device="cuda")
    engine = LLMEngine(model, config)
    engine.runner = ModelRunner(
        model, config.num_blocks, config.block_size, config.kv_layout, attention_backend=backend
    )
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
            assert_matches_oracle(fin, oracle_result(oracle, prompt, params, config), backend)


@requires_cuda
def test_engine_cuda_bf16_runs() -> None:
    """bf16 on CUDA: the whole path runs and yields in-vocab tokens (agreement with the
    float32 oracle is reported, not asserted, by scripts/device_check.py)."""
    pytest.importorskip("msgspec")
    from messages.sampling import SamplingParams
    from services.common.config import SchedulerConfig
    from services.engine.engine import LLMEngine

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_toy_checkpoint(tmp)
        model = OuroModel.from_checkpoint(ckpt, dtype=torch.bfloat16, device="cuda")
    engine = LLMEngine(model, SchedulerConfig(block_size=16, num_blocks=64))
    assert engine.runner.k_cache.dtype == torch.bfloat16
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for fin in engine.generate([[1, 2, 3], [4, 5]], params):
        assert len(fin.token_ids) == 6
        assert all(0 <= t < model.cfg.vocab_size for t in fin.token_ids)
