"""Decode attention through flash-attn 4 (``flash_attn.cute``, the ``flash-attn-4`` wheel:
CuTe DSL kernels for Hopper and Blackwell with paged KV through a page table).

An optional CUDA backend of ``rlt::paged_attention`` for decode passes only: it is used
where ``kernels.ops.backends`` found it importable, equal to the reference within the
Triton kernel's tolerance and at least ``MIN_SPEEDUP`` times faster than the Triton decode
kernel on the model's shape, at start. The Triton op stays the reference and the fallback.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

# How much faster than the Triton decode kernel flash-attn must be to replace it.
MIN_SPEEDUP = 1.2


@functools.cache
def varlen_function() -> Callable[..., Any] | None:
    """flash-attn 4's varlen entry point, or None where it does not import. Never raises."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception:  # absent, or a CuTe DSL that does not load on this machine
        return None
    return flash_attn_varlen_func


def flash_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("flash-attn-4")
    except Exception:
        return None


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start: torch.Tensor,
    scale: float,
    max_query_len: int,
) -> torch.Tensor:
    """``rlt::paged_attention``'s contract through flash-attn: causal, bottom-right aligned
    (query j of an n-row segment sees positions up to context - n + j), GQA by head groups.
    Rows past query_start[S] come out zero, as the op promises."""
    fn = varlen_function()
    if fn is None:
        raise RuntimeError("flash-attn 4 is not importable here")
    result = fn(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q=query_start,
        max_seqlen_q=max_query_len,
        seqused_k=context_lens,
        page_table=block_tables,
        softmax_scale=scale,
        causal=True,
    )
    out = result[0] if isinstance(result, tuple) else result
    rows = torch.arange(q.shape[0], device=q.device)
    # flash-attn leaves rows no segment covers unwritten: one masked select keeps them zero
    return torch.where((rows < query_start[-1])[:, None, None], out, 0.0).to(q.dtype)
