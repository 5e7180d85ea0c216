"""``rlt::rope_write_kv_fp8``: the reference equals RoPE (``rope_write_kv``) followed by
``fp8_quantize``, bit for bit; the Triton kernel equals the reference under the interpreter;
the op passes opcheck."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

from kernels.ops import kv_copy, rope_kv, rope_kv_fp8
from kernels.ops.kv_fp8 import fp8_quantize_reference
from tests.helpers import assert_passes_under_triton_interpreter

ROOT = Path(__file__).resolve().parent.parent
NH, NKV, HD, BS, BLOCKS = 4, 2, 16, 4, 6


def _case(seed: int, rows: int, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(rows, (NH + 2 * NKV) * HD, generator=g) * 3).to(dtype)
    angle = torch.rand(rows, HD // 2, generator=g) * 6.28
    cos = torch.cat([angle.cos()] * 2, dim=-1).to(dtype)
    sin = torch.cat([angle.sin()] * 2, dim=-1).to(dtype)
    slots = torch.randperm(BLOCKS * BS, generator=g)[:rows]
    slots[1] = -1  # a padding row
    return qkv, cos, sin, slots


def _caches():
    codes = [torch.zeros(BLOCKS, BS, NKV, HD, dtype=torch.uint8) for _ in range(2)]
    scales = [torch.zeros(BLOCKS, BS, NKV) for _ in range(2)]
    return (*codes, *scales)


def _write(impl, qkv, cos, sin, slots):
    caches = _caches()
    q = impl(qkv, cos, sin, *caches, slots, NH, NKV)
    return q, caches


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_rope_then_quantize(dtype: torch.dtype) -> None:
    qkv, cos, sin, slots = _case(0, 9, dtype)
    q, (kc, vc, ks, vs) = _write(rope_kv_fp8.rope_write_kv_fp8_reference, qkv, cos, sin, slots)
    k_plain = torch.zeros(BLOCKS, BS, NKV, HD, dtype=dtype)
    v_plain = torch.zeros_like(k_plain)
    q_plain = rope_kv.rope_write_kv_reference(qkv, cos, sin, k_plain, v_plain, slots, NH, NKV)
    assert torch.equal(q, q_plain)
    written = slots[slots >= 0]
    for codes, scales, plain in ((kc, ks, k_plain), (vc, vs, v_plain)):
        want_codes, want_scales = fp8_quantize_reference(plain.view(-1, NKV, HD)[written])
        assert torch.equal(codes.view(-1, NKV, HD)[written], want_codes)
        assert torch.equal(scales.view(-1, NKV)[written], want_scales)
        untouched = torch.ones(BLOCKS * BS, dtype=torch.bool)
        untouched[written] = False
        assert not codes.view(-1, NKV, HD)[untouched].any()  # padding wrote nothing


@pytest.mark.unit
def test_op_passes_opcheck() -> None:
    qkv, cos, sin, slots = _case(1, 5)
    torch.library.opcheck(
        torch.ops.rlt.rope_write_kv_fp8.default, (qkv, cos, sin, *_caches(), slots, NH, NKV)
    )


@pytest.mark.unit
def test_triton_kernel_matches_reference_under_interpreter() -> None:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    assert_passes_under_triton_interpreter("tests.test_rope_kv_fp8")


def _interpreter_checks() -> list[str]:
    failures = []
    for dtype in (torch.float32, torch.bfloat16):
        for seed in range(3):
            qkv, cos, sin, slots = _case(seed, 11, dtype)
            want_q, want = _write(rope_kv_fp8.rope_write_kv_fp8_reference, qkv, cos, sin, slots)
            got_q, got = _write(rope_kv_fp8.rope_write_kv_fp8_triton, qkv, cos, sin, slots)
            tag = f"({dtype}, seed {seed})"
            if dtype == torch.float32:
                # float32: the rotation rounds as the reference's, so every bit agrees
                if not torch.equal(got_q, want_q):
                    failures.append(f"q differs {tag}")
                for name, a, b in zip(("k", "v", "k_scale", "v_scale"), got, want, strict=True):
                    if not torch.equal(a, b):
                        failures.append(f"{name} differs {tag}")
                continue
            # bf16: the rotation may round one bf16 step apart from torch's (as rope_write_kv's
            # kernel does, tests/test_kernel_ops.py); it is that kernel's rotation bit for bit,
            # and the codes and scales are the reference quantiser's of it
            k_rot = torch.zeros(BLOCKS, BS, NKV, HD, dtype=dtype)
            v_rot = torch.zeros_like(k_rot)
            q_rot = rope_kv.rope_write_kv_triton(qkv, cos, sin, k_rot, v_rot, slots, NH, NKV)
            if not torch.equal(got_q, q_rot):
                failures.append(f"q is not rope_write_kv's {tag}")
            written = slots[slots >= 0]
            for name, plain, codes, scales in (
                ("k", k_rot, got[0], got[2]),
                ("v", v_rot, got[1], got[3]),
            ):
                want_codes, want_scales = fp8_quantize_reference(plain.view(-1, NKV, HD)[written])
                if not torch.equal(codes.view(-1, NKV, HD)[written], want_codes):
                    failures.append(f"{name} codes differ {tag}")
                if not torch.equal(scales.view(-1, NKV)[written], want_scales):
                    failures.append(f"{name} scales differ {tag}")
    # the exit copy moves scales as one-channel heads through the Triton copy kernel
    scales = torch.rand(2, BLOCKS, BS, NKV)
    want_s, got_s = scales.clone(), scales.clone()
    src, dst = torch.tensor([0, 5, 9]), torch.tensor([20, 3, 11])
    mask = torch.tensor([True, True, False])
    kv_copy.copy_kv_slots_masked_reference(
        want_s.unsqueeze(-1), want_s.clone().unsqueeze(-1), src, dst, mask
    )
    got_v = got_s.clone()
    kv_copy.copy_kv_slots_masked_triton(got_s.unsqueeze(-1), got_v.unsqueeze(-1), src, dst, mask)
    if not torch.equal(got_s, want_s):
        failures.append("scale copy differs")
    return failures


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1: the checks run the Triton kernels on CPU tensors")
        sys.exit(2)
    found = _interpreter_checks()
    for line in found:
        print("MISMATCH", line)
    sys.exit(1 if found else 0)
