"""Paged attention through ``torch.nn.functional.scaled_dot_product_attention``.

Same contract as ``kernels.paged_attention.paged_attention``: every segment's context K/V is
gathered from the paged cache with the metadata's index tensors into a padded
[Sb, kvh, Cb, hd] batch per query-length bucket, then one SDPA call per bucket runs on it with
that bucket's boolean causal mask.
Unlike the reference it computes in the input dtype (bf16/fp16 on GPU) and lets torch pick a
fused kernel (flash / memory-efficient on CUDA, the fused CPU kernel on CPU).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.paged_attention import (
    AttentionBucket,
    AttentionMetadata,
    check_attention_inputs,
)


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
class SdpaBucketState:
    """One metadata bucket's gather indices and mask."""

    query_rows: torch.Tensor  # [Sb, Qb] packed row of each query
    block: torch.Tensor  # [Sb, Cb] block id of each context position
    offset: torch.Tensor  # [Sb, Cb] offset inside that block
    attn_mask: torch.Tensor | None  # [Sb, 1, Qb, Cb] bool (True = attend) or None
    is_causal: bool  # every segment is a whole prompt from position 0 of the same length


@dataclass(frozen=True)
class SdpaPassState:
    """Per-pass gather indices and masks (one entry per metadata bucket), shared by all layers."""

    buckets: tuple[SdpaBucketState, ...]

    @property
    def is_causal(self) -> bool:
        return all(b.is_causal for b in self.buckets)

    @property
    def attn_mask(self) -> torch.Tensor | None:
        """The mask of a single-bucket pass (None when is_causal or with several buckets)."""
        return self.buckets[0].attn_mask if len(self.buckets) == 1 else None


def _bucket_state(bucket: AttentionBucket, block_size: int) -> SdpaBucketState:
    num_segs, q_max, c_max = bucket.num_segments, bucket.q_max, bucket.c_max
    block = torch.div(bucket.context_slots, block_size, rounding_mode="floor")
    offset = bucket.context_slots - block * block_size
    # Each segment has <= Qb rows and ctx_len <= Cb; if all Sb*Qb grid rows are real and
    # Qb == Cb then every segment has Qb rows starting at position 0, and SDPA's top-left
    # causal mask is exactly ours, with no padding anywhere.
    is_causal = num_segs > 0 and q_max == c_max and bucket.num_rows == num_segs * q_max
    mask = None if is_causal else bucket.mask[:, None]
    return SdpaBucketState(bucket.query_rows, block, offset, mask, is_causal)


def build_sdpa_state(meta: AttentionMetadata) -> SdpaPassState:
    """Sync-free: decides ``is_causal`` from shapes and the (host) row counts only."""
    return SdpaPassState(tuple(_bucket_state(b, meta.block_size) for b in meta.buckets))


def _attend_bucket(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    st: SdpaBucketState,
    scale: float,
) -> torch.Tensor:
    """One bucket through SDPA: [Sb * Qb, H, hd] in ``q.dtype``."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // k_cache.shape[2]
    num_segs, q_max = st.query_rows.shape
    # [Sb, Cb, kvh, hd] -> [Sb, kvh, Cb, hd]; two-index gather works for any cache strides.
    keys = k_cache[st.block, st.offset].to(q.dtype).transpose(1, 2)
    vals = v_cache[st.block, st.offset].to(q.dtype).transpose(1, 2)
    qs = q[st.query_rows].transpose(1, 2)  # [Sb, H, Qb, hd]

    kwargs: dict[str, bool] = {}
    if group > 1:
        # enable_gqa avoids repeating K/V, but on CUDA the masked (memory-efficient) kernel
        # does not take it and SDPA would drop to the slow math path: expand there instead.
        if sdpa_supports_gqa() and (q.device.type != "cuda" or st.attn_mask is None):
            kwargs["enable_gqa"] = True
        else:
            # Head h reads kv head h // group, as in the reference kernel.
            keys = keys.repeat_interleave(group, dim=1)
            vals = vals.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(
        qs,
        keys,
        vals,
        attn_mask=st.attn_mask,
        is_causal=st.is_causal,
        scale=scale,
        **kwargs,
    )  # [Sb, H, Qb, hd]
    return out.transpose(1, 2).reshape(num_segs * q_max, num_heads, head_dim)


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
    check_attention_inputs(q, k_cache, v_cache, meta)
    if q.shape[0] == 0:
        return q.new_empty(q.shape)
    if state is None:
        state = build_sdpa_state(meta)
    outs = [_attend_bucket(q, k_cache, v_cache, st, scale) for st in state.buckets]
    flat = outs[0] if len(outs) == 1 else torch.cat(outs)
    return flat[meta.row_to_bucketed]
