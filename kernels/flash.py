"""Optional flash-attn paged attention; the torch reference kernels are always available.

Which flash-attn we drive and the rule we enforce (checked against the installed version):

* ``flash_attn`` 2.x, from 2.5.0 on (the release that added paged KV to
  ``flash_attn_with_kvcache``): the paged cache's block size (``page_block_size``) must be a
  multiple of 256; the C++ entry point rejects anything else. Head dim <= 256 and a multiple
  of 8 (no padding copies of the cache), fp16/bf16 only, compute capability >= 8.0.
* Anything else (< 2.5, or a 3.x "flash_attn" package whose API we have not verified) is
  treated as unusable, so the caller falls back to SDPA rather than guessing an API.

Semantics used: with ``cache_seqlens[b] = L`` and ``causal=True``, query ``i`` of ``Sq`` reads
keys ``0 .. L - Sq + i`` (bottom-right aligned causal mask). A segment's queries are the last
``num_rows`` positions of its context and their K/V are already written, so each segment is one
batch entry with its queries left-padded to the common ``Qmax``: real rows land exactly on
their positions; pad rows (zero queries) are computed and thrown away.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kernels.paged_attention import AttentionMetadata, check_attention_inputs

# flash-attn 2.x paged KV: page_block_size % 256 == 0 (csrc/flash_attn/flash_api.cpp).
FLASH2_PAGED_BLOCK_MULTIPLE = 256
# flash_attn_with_kvcache learned block_table (paged KV) in 2.5.0.
FLASH2_MIN_PAGED_VERSION = (2, 5)
FLASH_MAX_HEAD_DIM = 256

# flash_attn_with_kvcache-compatible callable (injectable so the index math is CPU-testable).
FlashKVCacheFn = Callable[..., torch.Tensor]


@functools.cache
def flash_attn_available() -> bool:
    """True only when CUDA is usable and ``flash_attn`` imports cleanly. Never raises."""
    try:
        if not torch.cuda.is_available():
            return False
        import flash_attn  # noqa: F401
    except Exception:
        # Broken wheels raise more than ImportError (missing CUDA libs, ABI mismatch, ...).
        return False
    return True


def _parse_version(text: str) -> tuple[int, ...]:
    # Leading dotted integers only: "2.7.4.post1" -> (2, 7, 4), "2.6.0rc1" -> (2, 6, 0).
    match = re.match(r"\d+(?:\.\d+)*", text.strip())
    return tuple(int(p) for p in match.group(0).split(".")) if match else ()


@functools.cache
def flash_attn_version() -> tuple[int, ...] | None:
    """Installed flash-attn version as ints, or None if unusable. Never raises."""
    if not flash_attn_available():
        return None
    try:
        import flash_attn

        return _parse_version(str(getattr(flash_attn, "__version__", "")))
    except Exception:
        return None


def flash_paged_block_multiple(version: tuple[int, ...] | None) -> int | None:
    """Block-size multiple the installed flash-attn needs for paged KV; None if unsupported."""
    if version is None or len(version) < 2:
        return None
    if version[0] == 2 and version[:2] >= FLASH2_MIN_PAGED_VERSION:
        return FLASH2_PAGED_BLOCK_MULTIPLE
    return None


def flash_unsupported_reason(
    device: torch.device, dtype: torch.dtype, block_size: int, head_dim: int
) -> str | None:
    """Why the flash backend cannot serve this setup, or None when it can. Never raises."""
    if device.type != "cuda":
        return f"flash-attn needs a CUDA device (got {device.type})"
    if not flash_attn_available():
        return "flash_attn is not importable (or CUDA is unavailable)"
    version = flash_attn_version()
    multiple = flash_paged_block_multiple(version)
    if multiple is None:
        shown = ".".join(map(str, version)) if version else "unknown"
        return f"flash_attn {shown} has no paged-KV API we support (need 2.x >= 2.5)"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"flash-attn needs fp16/bf16, model dtype is {dtype}"
    if block_size % multiple != 0:
        return f"flash_attn 2.x paged KV needs block_size % {multiple} == 0, got {block_size}"
    if head_dim > FLASH_MAX_HEAD_DIM or head_dim % 8 != 0:
        return f"flash-attn needs head_dim <= {FLASH_MAX_HEAD_DIM} and % 8 == 0, got {head_dim}"
    try:
        if torch.cuda.get_device_capability(device) < (8, 0):
            return "flash-attn 2 needs compute capability >= 8.0"
    except Exception as exc:  # a query failure must not take the worker down
        return f"cannot read CUDA device capability: {exc}"
    return None


@dataclass(frozen=True)
class FlashPassState:
    """Per-pass tensors for ``flash_attn_with_kvcache``, built once and shared by all layers."""

    q_index: torch.Tensor  # [T] int64: row t's slot in the left-padded [S * Qmax] query grid
    block_table: torch.Tensor  # [S, ceil(Cmax / bs)] int32
    cache_seqlens: torch.Tensor  # [S] int32: context length of each segment
    num_segments: int
    q_max: int


def build_flash_state(meta: AttentionMetadata) -> FlashPassState:
    """Derive flash's block_table / cache_seqlens / left-padded query slots from the metadata.

    Sync-free: only tensor ops on the metadata's device.
    """
    num_segs, q_max = meta.query_rows.shape
    bs = meta.block_size
    dev = meta.query_rows.device
    if meta.num_rows == 0 or num_segs == 0:
        empty = torch.zeros(0, dtype=torch.int64, device=dev)
        return FlashPassState(
            empty,
            torch.zeros((0, 0), dtype=torch.int32, device=dev),
            empty.to(torch.int32),
            0,
            0,
        )
    # Padding of query_rows repeats the last real row, so first/last give each segment's rows.
    seg_rows = meta.query_rows[:, -1] - meta.query_rows[:, 0] + 1  # [S]
    seg = torch.div(meta.row_to_padded, q_max, rounding_mode="floor")
    offset = meta.row_to_padded - seg * q_max
    q_index = seg * q_max + (q_max - seg_rows[seg]) + offset
    # Position k * bs lies in logical block k; context_slots maps it to its physical slot.
    # Positions past a segment's length were clamped to 0 (a real block): safe padding.
    block_table = torch.div(meta.context_slots[:, ::bs], bs, rounding_mode="floor")
    return FlashPassState(
        q_index=q_index,
        block_table=block_table.to(torch.int32).contiguous(),
        cache_seqlens=meta.context_lens.to(torch.int32).contiguous(),
        num_segments=num_segs,
        q_max=q_max,
    )


def load_flash_kvcache_fn() -> FlashKVCacheFn:
    """Import ``flash_attn.flash_attn_with_kvcache`` (raises if flash-attn is missing)."""
    from flash_attn import flash_attn_with_kvcache

    fn: Any = flash_attn_with_kvcache
    return fn


def flash_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    state: FlashPassState,
    kernel: FlashKVCacheFn,
) -> torch.Tensor:
    """Same contract as ``paged_attention`` (q [T, H, hd] -> [T, H, hd]), via flash-attn."""
    num_rows, num_heads, head_dim = q.shape
    check_attention_inputs(q, k_cache, v_cache, meta)
    if num_rows == 0:
        return q.new_empty((0, num_heads, head_dim))
    s, q_max = state.num_segments, state.q_max
    grid = q.new_zeros((s * q_max, num_heads, head_dim))
    grid.index_copy_(0, state.q_index, q.to(grid.dtype))
    out = kernel(
        grid.view(s, q_max, num_heads, head_dim),
        k_cache,
        v_cache,
        cache_seqlens=state.cache_seqlens,
        block_table=state.block_table,
        softmax_scale=scale,
        causal=True,
    )
    return out.reshape(s * q_max, num_heads, head_dim).index_select(0, state.q_index)
