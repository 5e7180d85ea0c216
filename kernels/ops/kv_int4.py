"""``rlt::int4_encode`` / ``rlt::int4_decode``: one plane of a sealed int4-delta block.

A block's plane is coded against the plane below *as reconstructed* (``prev``; none for the
first stored plane). Only the tokens the plane stores (``stored``) are coded; the others are
"the same as the plane below" and read back as ``prev``. The arithmetic, which the serial
oracle repeats in its own code (``services/oracle/kv_codec.py``):

    d = x - prev                         (float32; x itself without prev)
    lo, hi = min, max of d               keys: per (head, channel) over the stored tokens
                                         values: per (token, head, group of channels)
    scale = fp16((hi - lo) / 15), zero = fp16(lo)
    code = clamp(round_half_even((d - zero) / scale), 0, 15)     (scale 0: code 0)
    read back: prev + code * scale + zero  (stored tokens), prev (the others)

Codes are packed two per byte, channel 2i in the low nibble. Keys: scale/zero
[B, kv_heads, head_dim]; values: [B, G, kv_heads, head_dim // group].
"""

from __future__ import annotations

import torch

from kernels.kv_codec import INT4_LEVELS

_lib = torch.library.Library("rlt", "FRAGMENT")
_lib.define(
    "int4_encode(Tensor x, Tensor? prev, Tensor stored, bool per_channel, int group) "
    "-> (Tensor, Tensor, Tensor)"
)
_lib.define(
    "int4_decode(Tensor codes, Tensor scale, Tensor zero, Tensor stored, Tensor? prev, "
    "bool per_channel, int group) -> Tensor"
)


def _grouped(t: torch.Tensor, group: int) -> torch.Tensor:
    """[..., hd] -> [..., hd // group, group]"""
    return t.unflatten(-1, (t.shape[-1] // group, group))


def int4_encode_reference(
    x: torch.Tensor,
    prev: torch.Tensor | None,
    stored: torch.Tensor,
    per_channel: bool,
    group: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, prev [B, G, nkv, hd]; stored [B, G] -> (codes uint8 [B, G, nkv, hd // 2], scale,
    zero float16)."""
    d = x.float() if prev is None else x.float() - prev.float()
    keep = stored.bool()[:, :, None, None]
    if per_channel:
        lo = d.masked_fill(~keep, float("inf")).amin(dim=1)
        hi = d.masked_fill(~keep, float("-inf")).amax(dim=1)
        empty = ~keep.any(dim=1)  # [B, 1, 1]: a block no token of which this plane stores
        lo, hi = lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0)
        scale, zero = _scale_zero(lo, hi)
        s, z = scale.float()[:, None], zero.float()[:, None]
    else:
        grouped = _grouped(d, group)
        lo = grouped.amin(dim=-1).masked_fill(~keep, 0.0)
        hi = grouped.amax(dim=-1).masked_fill(~keep, 0.0)
        scale, zero = _scale_zero(lo, hi)
        s = scale.float().repeat_interleave(group, dim=-1)
        z = zero.float().repeat_interleave(group, dim=-1)
    codes = torch.round((d - z) / torch.where(s > 0, s, 1.0)).clamp(0, INT4_LEVELS)
    codes = codes.to(torch.uint8).masked_fill(~keep, 0)
    return _pack(codes), scale, zero


def _scale_zero(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return ((hi - lo) / INT4_LEVELS).to(torch.float16), lo.to(torch.float16)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """Packed codes [..., hd // 2] -> codes [..., hd] (uint8, 0..15)."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


def int4_decode_reference(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    stored: torch.Tensor,
    prev: torch.Tensor | None,
    per_channel: bool,
    group: int,
) -> torch.Tensor:
    """The float32 values one plane reads back as, [B, G, nkv, hd]."""
    c = unpack(codes).float()
    if per_channel:
        s, z = scale.float()[:, None], zero.float()[:, None]
    else:
        s = scale.float().repeat_interleave(group, dim=-1)
        z = zero.float().repeat_interleave(group, dim=-1)
    d = (c * s + z) * stored.bool()[:, :, None, None]
    return d if prev is None else prev.float() + d


def _encode_fake(
    x: torch.Tensor, prev: torch.Tensor | None, stored: torch.Tensor, per_channel: bool, group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, g, nkv, hd = x.shape
    params = (b, nkv, hd) if per_channel else (b, g, nkv, hd // group)
    codes = x.new_empty((b, g, nkv, hd // 2), dtype=torch.uint8)
    return codes, x.new_empty(params, dtype=torch.float16), x.new_empty(params, dtype=torch.float16)


def _decode_fake(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    stored: torch.Tensor,
    prev: torch.Tensor | None,
    per_channel: bool,
    group: int,
) -> torch.Tensor:
    b, g, nkv, half = codes.shape
    return codes.new_empty((b, g, nkv, 2 * half), dtype=torch.float32)


# The sealing of a block runs once per block and plane, not per pass: the torch version is
# the CUDA kernel too (a Triton one would save launches, not bandwidth).
for _key in ("CPU", "CUDA"):
    _lib.impl("int4_encode", int4_encode_reference, _key)
    _lib.impl("int4_decode", int4_decode_reference, _key)
torch.library.register_fake("rlt::int4_encode", _encode_fake, lib=_lib)
torch.library.register_fake("rlt::int4_decode", _decode_fake, lib=_lib)

_encode_op = torch.ops.rlt.int4_encode.default
_decode_op = torch.ops.rlt.int4_decode.default


def int4_encode(
    x: torch.Tensor,
    prev: torch.Tensor | None,
    stored: torch.Tensor,
    per_channel: bool,
    group: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes one plane of B sealed blocks (see the module docstring)."""
    return _encode_op(x, prev, stored, per_channel, group)


def int4_decode(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    stored: torch.Tensor,
    prev: torch.Tensor | None,
    per_channel: bool,
    group: int,
) -> torch.Tensor:
    """What one plane of B sealed blocks reads back as (float32)."""
    return _decode_op(codes, scale, zero, stored, prev, per_channel, group)
