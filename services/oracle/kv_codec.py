"""The KV codecs as the serial oracle applies them, written apart from ``kernels/`` so that a
bug in the engine's codec cannot hide in both.

* ``fp8``: every K/V row (one token, one kv head) is stored as ``e4m3(x / s) * s`` with
  ``s = max|x| / 448``: the oracle keeps those values in place of the exact ones.
* ``int4-delta``: the oracle keeps the exact K/V of every plane and, per token, the last
  plane that stores it (``top``: a token that exited, or that token-sparse prefill froze,
  stores nothing above it). A query reads the keys of its own group (``group_size``
  positions, the engine's block) exactly and earlier groups as they read back once coded:
  an anchor plane (plane 0, and plane j with ``j % anchor_every == 0`` when that is set) on
  its own for every token (a token whose top is below it holds its copied-up K/V there),
  any other plane j as plane j - 1's read-back plus the coded difference, for the tokens
  whose top is at least j.

The int4 arithmetic (the module docstring of ``kernels/ops/kv_int4.py`` states it once):
asymmetric min/max with 15 steps, keys per channel over the group's stored tokens, values
per token over ``value_group`` channels, scale and zero rounded to ``scale_dtype`` (float16
in the engine; float32 gives FlashLoop's reference arithmetic).
"""

from __future__ import annotations

import torch

CODECS = ("auto", "fp8", "int4-delta")
_E4M3_MAX = 448.0
_STEPS = 15


def fp8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """x [..., hd] -> the float32 values the fp8 codec stores for it."""
    x = x.float()
    s = x.abs().max(dim=-1, keepdim=True).values / _E4M3_MAX
    safe = torch.where(s == 0, torch.ones_like(s), s)
    e4m3 = torch.clamp(x / safe, min=-_E4M3_MAX, max=_E4M3_MAX).to(torch.float8_e4m3fn)
    return e4m3.to(torch.float32) * s


def _fake_quant(d: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, scale_dtype: torch.dtype):
    """min/max asymmetric 4-bit round trip of d given its (broadcast) range."""
    step = ((hi - lo) / _STEPS).to(scale_dtype).float()
    base = lo.to(scale_dtype).float()
    divisor = torch.where(step > 0, step, torch.ones_like(step))
    levels = torch.clamp(torch.round((d - base) / divisor), 0, _STEPS)
    return levels * step + base


def int4_round_trip_keys(
    d: torch.Tensor, stored: torch.Tensor, scale_dtype: torch.dtype = torch.float16
) -> torch.Tensor:
    """d [G, nkv, hd], per channel over the stored tokens of the group; others read 0."""
    rows = d[stored]
    if rows.shape[0] == 0:
        return torch.zeros_like(d)
    lo = rows.min(dim=0).values
    hi = rows.max(dim=0).values
    out = _fake_quant(d, lo, hi, scale_dtype)
    return out * stored[:, None, None]


def int4_round_trip_values(
    d: torch.Tensor, stored: torch.Tensor, group: int, scale_dtype: torch.dtype = torch.float16
) -> torch.Tensor:
    """d [G, nkv, hd], per token over groups of ``group`` channels; unstored tokens read 0."""
    g, nkv, hd = d.shape
    split = d.reshape(g, nkv, hd // group, group)
    lo = split.min(dim=-1, keepdim=True).values
    hi = split.max(dim=-1, keepdim=True).values
    out = _fake_quant(split, lo, hi, scale_dtype).reshape(g, nkv, hd)
    return out * stored[:, None, None]


def int4_delta_group(
    planes: list[torch.Tensor],
    top: torch.Tensor,
    keys: bool,
    group: int,
    scale_dtype: torch.dtype = torch.float16,
    anchor_every: int = 0,
) -> list[torch.Tensor]:
    """The read-back of planes 0..len(planes)-1 of one group: planes[j] [G, nkv, hd] exact,
    top [G] the last plane storing each token (planes above read the plane below, up to the
    next anchor), ``anchor_every`` the anchor interval (0: plane 0 only)."""
    out: list[torch.Tensor] = []
    for j, exact in enumerate(planes):
        anchor = j == 0 or (anchor_every > 0 and j % anchor_every == 0)
        if anchor:  # coded on its own, every token
            stored = torch.ones_like(top, dtype=torch.bool)
            below = torch.zeros_like(exact, dtype=torch.float32)
        else:
            stored = top >= j
            below = out[-1]
        d = exact.float() - below
        if keys:
            coded = int4_round_trip_keys(d, stored, scale_dtype)
        else:
            coded = int4_round_trip_values(d, stored, group, scale_dtype)
        out.append(below + coded)
    return out
