"""``rlt::paged_attention_int4``: causal paged attention over int4-delta KV (the torch
reference; the layout is ``kernels/kv_codec.py``'s).

Segment s reads a chain of ``planes[s]`` + 1 = n planes. A key in the query's own block
comes exact from the tail cache (``k_tail`` / ``v_tail``, the ``auto`` layout) through
``tail_tables[s, block]``; a key of an earlier (sealed) block is read back from the codes of
the chain's planes, ``block_tables[s, i, block]`` for i = 0..n - 1: the first (an anchor) on
its own, each later one adding its delta to the tokens it stores. The host packs a pass at
loop d's chain from the anchor at or below d (``kernels.kv_codec.chain_start``); with plane 0
the only anchor, i is the plane. Rows, positions and padding are as in ``rlt::paged_attention``
(``query_pos`` optional). Sealed blocks are decoded per segment here, not kept: a pass makes
no dequantised copy of the cache. On CUDA the Triton kernels decode them tile by tile
inside the kernel: ``attention_int4_triton.py``, and for decode passes at long context the
split-K ``attention_int4_decode_triton.py``.
"""

from __future__ import annotations

import torch

from kernels.kv_codec import value_group
from kernels.ops._triton import int4_decode_partitions, num_sms, triton_available
from kernels.ops.kv_int4 import int4_decode_reference

_lib = torch.library.Library("rlt", "FRAGMENT")
_lib.define(
    "paged_attention_int4(Tensor q, Tensor k_codes, Tensor v_codes, Tensor k_scale, "
    "Tensor k_zero, Tensor v_scale, Tensor v_zero, Tensor stored, Tensor k_tail, "
    "Tensor v_tail, Tensor block_tables, Tensor tail_tables, Tensor planes, "
    "Tensor context_lens, Tensor query_start, float scale, int max_query_len, "
    "Tensor? query_pos=None) -> Tensor"
)


class Int4Cache:
    """One layer's int4-delta storage, every tensor indexed by block id first."""

    def __init__(self, *fields: torch.Tensor) -> None:
        (
            self.k_codes,
            self.v_codes,
            self.k_scale,
            self.k_zero,
            self.v_scale,
            self.v_zero,
            self.stored,
        ) = fields

    def read_back(self, tables: torch.Tensor, plane: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V float32 [n * bs, nkv, hd] of n sealed blocks read back through the chain
        ``tables[0..plane]`` (tables [chain, n]: an anchor, then the planes above it)."""
        k = v = None
        group = value_group(2 * self.k_codes.shape[-1])
        for j in range(plane + 1):
            ids = tables[j].long()
            stored = self.stored[ids]
            k = int4_decode_reference(
                self.k_codes[ids], self.k_scale[ids], self.k_zero[ids], stored, k, True, group
            )
            v = int4_decode_reference(
                self.v_codes[ids], self.v_scale[ids], self.v_zero[ids], stored, v, False, group
            )
        assert k is not None and v is not None
        return k.flatten(0, 1), v.flatten(0, 1)


def paged_attention_int4_reference(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    v_codes: torch.Tensor,
    k_scale: torch.Tensor,
    k_zero: torch.Tensor,
    v_scale: torch.Tensor,
    v_zero: torch.Tensor,
    stored: torch.Tensor,
    k_tail: torch.Tensor,
    v_tail: torch.Tensor,
    block_tables: torch.Tensor,
    tail_tables: torch.Tensor,
    planes: torch.Tensor,
    context_lens: torch.Tensor,
    query_start: torch.Tensor,
    scale: float,
    max_query_len: int,
    query_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    cache = Int4Cache(k_codes, v_codes, k_scale, k_zero, v_scale, v_zero, stored)
    bs = k_tail.shape[1]
    group = q.shape[1] // k_tail.shape[2]
    acc = torch.promote_types(q.dtype, torch.float32)
    out = q.new_zeros(q.shape)
    starts, ctxs = query_start.tolist(), context_lens.tolist()
    for s, ctx in enumerate(ctxs):
        lo, hi = starts[s], starts[s + 1]
        if hi <= lo:
            continue
        rows = torch.arange(lo, hi)
        pos = (
            query_pos[lo:hi].long() if query_pos is not None else torch.arange(ctx - (hi - lo), ctx)
        )
        last = int(pos.max())
        end = last + 1
        sealed = last // bs  # blocks wholly before the last query's block
        first_open = int(pos.min()) // bs
        keys = torch.zeros(end, *k_tail.shape[2:], dtype=acc)
        vals = torch.zeros_like(keys)
        coded_k, coded_v = keys.clone(), vals.clone()
        if sealed:
            rk, rv = cache.read_back(block_tables[s, :, :sealed], int(planes[s]))
            coded_k[: sealed * bs], coded_v[: sealed * bs] = rk.to(acc), rv.to(acc)
        for b in range(first_open, last // bs + 1):  # the queries' own blocks, exact
            span = slice(b * bs, min((b + 1) * bs, end))
            tail = int(tail_tables[s, b])
            keys[span] = k_tail[tail, : span.stop - span.start].to(acc)
            vals[span] = v_tail[tail, : span.stop - span.start].to(acc)
        key_pos = torch.arange(end)
        own = (key_pos[None, :] // bs) == (pos[:, None] // bs)  # [n, end]
        visible = key_pos[None, :] <= pos[:, None]
        qs = q[rows].to(acc).transpose(0, 1)  # [nh, n, hd]

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.repeat_interleave(group, dim=1).transpose(0, 1)  # [nh, end, hd]

        exact = qs @ heads(keys).transpose(1, 2)
        coded = qs @ heads(coded_k).transpose(1, 2)
        scores = torch.where(own[None], exact, coded) * scale
        weights = torch.softmax(scores.masked_fill(~visible[None], float("-inf")), dim=-1)
        mixed = (weights * own[None]) @ heads(vals) + (weights * ~own[None]) @ heads(coded_v)
        out[rows] = mixed.transpose(0, 1).to(q.dtype)
    return out


def _fake(q: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return q.new_empty(q.shape)


def _paged_attention_int4_cuda(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    v_codes: torch.Tensor,
    k_scale: torch.Tensor,
    k_zero: torch.Tensor,
    v_scale: torch.Tensor,
    v_zero: torch.Tensor,
    stored: torch.Tensor,
    k_tail: torch.Tensor,
    v_tail: torch.Tensor,
    block_tables: torch.Tensor,
    tail_tables: torch.Tensor,
    planes: torch.Tensor,
    context_lens: torch.Tensor,
    query_start: torch.Tensor,
    scale: float,
    max_query_len: int,
    query_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Triton kernels where triton imports, else the reference: the split-K one
    (``attention_int4_decode_triton.py``) for a decode pass whose grid would leave the GPU
    idle (``int4_decode_partitions``), the plain one (``attention_int4_triton.py``)
    otherwise. No GPU has run them yet: they are held to the reference under the
    interpreter."""
    args = (q, k_codes, v_codes, k_scale, k_zero, v_scale, v_zero, stored, k_tail, v_tail)
    rest = (block_tables, tail_tables, planes, context_lens, query_start, scale, max_query_len)
    if not triton_available():
        return paged_attention_int4_reference(*args, *rest, query_pos)
    splits = int4_decode_partitions(
        max_query_len,
        block_tables.shape[0],
        q.shape[1],
        block_tables.shape[2],
        k_tail.shape[1],
        num_sms(q.device),
    )
    if splits > 1:
        from kernels.ops import attention_int4_decode_triton

        return attention_int4_decode_triton.paged_attention_int4_decode_triton(
            *args, *rest, query_pos, num_splits=splits
        )
    from kernels.ops import attention_int4_triton

    return attention_int4_triton.paged_attention_int4_triton(*args, *rest, query_pos)


_lib.impl("paged_attention_int4", paged_attention_int4_reference, "CPU")
_lib.impl("paged_attention_int4", _paged_attention_int4_cuda, "CUDA")
torch.library.register_fake("rlt::paged_attention_int4", _fake, lib=_lib)

_op = torch.ops.rlt.paged_attention_int4.default


def paged_attention_int4(
    q: torch.Tensor,
    cache: Int4Cache,
    k_tail: torch.Tensor,
    v_tail: torch.Tensor,
    block_tables: torch.Tensor,
    tail_tables: torch.Tensor,
    planes: torch.Tensor,
    context_lens: torch.Tensor,
    query_start: torch.Tensor,
    scale: float,
    max_query_len: int,
    query_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, nh, hd] over one layer's int4-delta blocks -> [T, nh, hd] in q's dtype.
    block_tables [S, planes, maxB], tail_tables [S, maxB], planes [S]: each segment's chain's
    last index (the module docstring has the rest)."""
    return _op(
        q,
        cache.k_codes,
        cache.v_codes,
        cache.k_scale,
        cache.k_zero,
        cache.v_scale,
        cache.v_zero,
        cache.stored,
        k_tail,
        v_tail,
        block_tables,
        tail_tables,
        planes,
        context_lens,
        query_start,
        scale,
        max_query_len,
        query_pos,
    )
