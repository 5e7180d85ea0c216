"""Synthetic decode attention inputs on paged KV: each row's context in randomly shuffled
blocks of a shared pool, as a long-running cache looks after many requests came and went.

The start-up backend probe (``kernels.ops.backends``) and the device check's attention
microbenchmark time and compare attention kernels on these.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedDecodeCase:
    q: torch.Tensor  # [rows (+ padding), nh, hd]
    k_cache: torch.Tensor  # [num_blocks, block_size, nkv, hd]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [rows, width] int32
    context_lens: torch.Tensor  # [rows] int32
    query_start: torch.Tensor  # [rows + 1] int32: one query row per segment
    scale: float
    aliased: bool  # rows share blocks (the pool was capped below rows x context)

    def args(self) -> tuple:
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.context_lens,
            self.query_start,
            self.scale,
            1,
        )

    def kv_bytes(self) -> int:
        """Bytes of K and V the rows' contexts read (each row its own, aliased or not)."""
        per_token = 2 * self.k_cache.shape[2] * self.k_cache.shape[3] * self.k_cache.element_size()
        return int(self.context_lens.sum()) * per_token


def paged_decode_case(
    rows: int,
    context: int,
    num_heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    seed: int = 0,
    max_pool_bytes: int | None = None,
    pad_rows: int = 0,
) -> PagedDecodeCase:
    """``rows`` decode rows, each over ``context`` positions in shuffled blocks. With
    ``max_pool_bytes`` the pool holds at most that many bytes of K and V: rows then share
    blocks (still each in its own shuffled order), so large grids fit a small device."""
    device = torch.device(device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    per_row = -(-context // block_size)
    block_bytes = 2 * block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
    num_blocks = rows * per_row
    if max_pool_bytes is not None:
        num_blocks = max(per_row, min(num_blocks, max_pool_bytes // block_bytes))
    aliased = num_blocks < rows * per_row
    tables = torch.stack(
        [torch.randperm(num_blocks, generator=gen)[:per_row] for _ in range(rows)]
        if aliased
        else list(torch.randperm(num_blocks, generator=gen).view(rows, per_row))
    ).to(torch.int32)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.empty(shape, dtype=dtype, device=device)
    v_cache = torch.empty(shape, dtype=dtype, device=device)
    # drawn on the device in slabs: a CPU generator would take minutes for gigabytes
    dev_gen = torch.Generator(device=device).manual_seed(seed)
    for cache in (k_cache, v_cache):
        for slab in cache.split(4096):
            slab.normal_(generator=dev_gen)
    q = torch.randn((rows + pad_rows, num_heads, head_dim), generator=gen).to(dtype)
    return PagedDecodeCase(
        q=q.to(device),
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=tables.to(device),
        context_lens=torch.full((rows,), context, dtype=torch.int32, device=device),
        query_start=torch.arange(rows + 1, dtype=torch.int32, device=device),
        scale=head_dim**-0.5,
        aliased=aliased,
    )
