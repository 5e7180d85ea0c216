"""Paged attention through ``torch.nn.functional.scaled_dot_product_attention``.

Same contract as ``kernels.paged_attention.paged_attention``: every segment's context K/V is
gathered from the paged cache with the metadata's index tensors into a padded
[S, kvh, Cmax, hd] batch, then one SDPA call runs on it with the metadata's boolean causal mask.
Unlike the reference it computes in the input dtype (bf16/fp16 on GPU) and lets torch pick a
fused kernel (flash / memory-efficient on CUDA, the fused CPU kernel on CPU).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.paged_attention import AttentionMetadata, check_cache_shape


@functools.cache
def sdpa_supports_gqa() -> bool:
    """Whether this torch's SDPA takes ``enable_gqa`` (added in torch 2.5). Never raises."""
    try:
        q = torch.zeros(1, 2, 1, 8)
        kv = torch.zeros(1, 1, 1, 8)
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except Exception:
        return False
    return True


@dataclass(frozen=True)
class SdpaPassState:
    """Per-pass gather indices and mask, built once and shared by all layers."""

    block: torch.Tensor  # [S, Cmax] block id of each context position
    offset: torch.Tensor  # [S, Cmax] offset inside that block
    attn_mask: torch.Tensor | None  # [S, 1, Qmax, Cmax] bool (True = attend) or None
    is_causal: bool  # every segment is a whole prompt from position 0 of the same length


def build_sdpa_state(meta: AttentionMetadata) -> SdpaPassState:
    """Sync-free: decides ``is_causal`` from shapes and the (host) row count only."""
    num_segs, q_max = meta.query_rows.shape
    c_max = meta.context_slots.shape[1]
    bs = meta.block_size
    block = torch.div(meta.context_slots, bs, rounding_mode="floor")
    offset = meta.context_slots - block * bs
    # Each segment has <= Qmax rows and ctx_len <= Cmax; if all S*Qmax grid rows are real and
    # Qmax == Cmax then every segment has Qmax rows starting at position 0, and SDPA's top-left
    # causal mask is exactly ours, with no padding anywhere.
    is_causal = num_segs > 0 and q_max == c_max and meta.num_rows == num_segs * q_max
    mask = None if is_causal else meta.mask[:, None]
    return SdpaPassState(block=block, offset=offset, attn_mask=mask, is_causal=is_causal)


def sdpa_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    state: SdpaPassState | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries over their segments' paged K/V via SDPA.

    q: [T, H, hd]; k_cache / v_cache: one layer [num_blocks, block_size, kvh, hd] that already
    hold this pass's new K/V. Returns [T, H, hd] in ``q.dtype``.
    """
    num_rows, num_heads, head_dim = q.shape
    if num_rows != meta.num_rows:
        raise ValueError(f"q has {num_rows} rows but metadata was built for {meta.num_rows}")
    check_cache_shape(k_cache, v_cache, meta)
    kv_heads = k_cache.shape[2]
    if num_heads % kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of kv heads {kv_heads}")
    if num_rows == 0:
        return q.new_empty((0, num_heads, head_dim))
    if state is None:
        state = build_sdpa_state(meta)
    group = num_heads // kv_heads
    num_segs, q_max = meta.query_rows.shape

    # [S, Cmax, kvh, hd] -> [S, kvh, Cmax, hd]; two-index gather works for any cache strides.
    keys = k_cache[state.block, state.offset].to(q.dtype).transpose(1, 2)
    vals = v_cache[state.block, state.offset].to(q.dtype).transpose(1, 2)
    qs = q[meta.query_rows].transpose(1, 2)  # [S, H, Qmax, hd]

    kwargs: dict[str, bool] = {}
    if group > 1:
        # enable_gqa avoids repeating K/V, but on CUDA the masked (memory-efficient) kernel
        # does not take it and SDPA would drop to the slow math path: expand there instead.
        if sdpa_supports_gqa() and (q.device.type != "cuda" or state.attn_mask is None):
            kwargs["enable_gqa"] = True
        else:
            # Head h reads kv head h // group, as in the reference kernel.
            keys = keys.repeat_interleave(group, dim=1)
            vals = vals.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(
        qs,
        keys,
        vals,
        attn_mask=state.attn_mask,
        is_causal=state.is_causal,
        scale=scale,
        **kwargs,
    )  # [S, H, Qmax, hd]
    out = out.transpose(1, 2).reshape(num_segs * q_max, num_heads, head_dim)
    return out[meta.row_to_padded]
