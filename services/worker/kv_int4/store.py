"""The device tensors of int4-delta KV (``kernels/kv_codec.py``'s layout) and the host's
record of which block ids are sealed and which tail block holds an open one.

Every block id has codes, scales, zero points and ``stored`` flags for every layer. A block
that is not sealed yet keeps its tokens exact in a *tail* block of the ``auto`` layout
(model dtype); a tail is taken when the block is first written and given back when it is
sealed, so the tail pool holds the open blocks only. It starts at the reserve the memory
accounting counts (``kernels.kv_codec.tail_reserve_blocks``), which holds what a batch can
leave open without token-sparse prefill; past it (token-sparse prefill keeps more) it grows
on demand, in doublings, up to one tail per block id (it can never need more), each growth
logged, as device memory nothing counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import structlog
import torch

from kernels.kv_codec import chain_start, value_group
from kernels.ops.attention_int4 import Int4Cache
from kernels.ops.kv_int4 import int4_decode, int4_encode

_log = structlog.get_logger("rlt")


@dataclass(frozen=True)
class TailPoolStats:
    """The tail pool as operators see it (the worker's health and ``rlt:kv_int4_*``)."""

    open_blocks: int  # block ids holding a tail now
    peak_open_blocks: int  # the most at once so far, mid-pass included
    pool_blocks: int  # tails allocated
    reserved_blocks: int  # what the memory accounting counts (the pool's first size)
    growths: int  # times the pool grew past what it had (uncounted memory)


class Int4Store:
    """Codes of ``num_blocks`` block ids (the scheduler's, plus the scratch block) and the
    tail pool, ``tails`` blocks at first, for every layer."""

    def __init__(
        self,
        layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        tails: int,
    ) -> None:
        self.block_size = block_size
        self.group = value_group(head_dim)
        self.device = device
        blocks = (layers, num_blocks, block_size, kv_heads)
        self.k_codes = torch.zeros((*blocks, head_dim // 2), dtype=torch.uint8, device=device)
        self.v_codes = torch.zeros_like(self.k_codes)
        per_channel = (layers, num_blocks, kv_heads, head_dim)
        self.k_scale = torch.zeros(per_channel, dtype=torch.float16, device=device)
        self.k_zero = torch.zeros_like(self.k_scale)
        per_token = (*blocks, head_dim // self.group)
        self.v_scale = torch.zeros(per_token, dtype=torch.float16, device=device)
        self.v_zero = torch.zeros_like(self.v_scale)
        self.stored = torch.zeros(
            (layers, num_blocks, block_size), dtype=torch.uint8, device=device
        )
        self.reserved_tails = max(1, tails)
        tail = (layers, self.reserved_tails, block_size, kv_heads, head_dim)
        self.k_tail = torch.zeros(tail, dtype=dtype, device=device)
        self.v_tail = torch.zeros_like(self.k_tail)
        # host: sealed block ids, and each block id's tail block (-1: none)
        self.sealed = np.zeros(num_blocks, dtype=np.bool_)
        self.tail_of = np.full(num_blocks, -1, dtype=np.int64)
        self._free_tails = list(range(self.k_tail.shape[1] - 1, -1, -1))
        self.growths = 0  # times the pool grew past what it had
        self.open_blocks = 0  # block ids holding a tail now
        self.peak_open_blocks = 0  # the most at once, mid-pass included
        # the device's copy of tail_of, refreshed before each pass that writes
        self.tail_map = torch.full((num_blocks,), -1, dtype=torch.int64, device=device)

    # ------------------------------------------------------------------ bytes
    @property
    def nbytes(self) -> int:
        """Device bytes of every tensor: codes, scales, flags and the tail pool as it is."""
        tensors = (
            self.k_codes,
            self.v_codes,
            self.k_scale,
            self.k_zero,
            self.v_scale,
            self.v_zero,
            self.stored,
            self.k_tail,
            self.v_tail,
            self.tail_map,
        )
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def pool_blocks(self) -> int:
        """Tail blocks allocated now: the reserve, or more once the pool grew past it."""
        return int(self.k_tail.shape[1])

    def tail_stats(self) -> TailPoolStats:
        return TailPoolStats(
            self.open_blocks,
            self.peak_open_blocks,
            self.pool_blocks,
            self.reserved_tails,
            self.growths,
        )

    # ------------------------------------------------------------------ tails
    def open(self, blocks: np.ndarray) -> None:
        """Block ids about to be written: a sealed one is being reused for new tokens (a
        sealed block is never written otherwise), so it is opened again; each gets a tail."""
        for block in np.unique(blocks).tolist():
            self.sealed[block] = False
            if self.tail_of[block] < 0:
                self.tail_of[block] = self._take_tail()
                self.open_blocks += 1
        self.peak_open_blocks = max(self.peak_open_blocks, self.open_blocks)

    def close(self, blocks: list[int]) -> None:
        """Gives back the tails of ``blocks`` (sealed, or dropped without being sealed)."""
        for block in blocks:
            tail = int(self.tail_of[block])
            if tail >= 0:
                self._free_tails.append(tail)
                self.tail_of[block] = -1
                self.open_blocks -= 1

    def _take_tail(self) -> int:
        if not self._free_tails:
            self._grow()
        return self._free_tails.pop()

    def _grow(self) -> None:
        have = self.k_tail.shape[1]
        limit = self.sealed.shape[0]
        if have >= limit:  # one tail per block id is the most that can ever be open
            raise RuntimeError(f"int4-delta tail pool exhausted at {have} blocks")
        more = min(have, limit - have)
        pad = (self.k_tail.shape[0], more, *self.k_tail.shape[2:])
        self.k_tail = torch.cat([self.k_tail, self.k_tail.new_zeros(pad)], dim=1)
        self.v_tail = torch.cat([self.v_tail, self.v_tail.new_zeros(pad)], dim=1)
        self._free_tails.extend(range(have + more - 1, have - 1, -1))
        self.growths += 1
        # memory the geometry check did not count: on a GPU this can run out mid-run
        _log.warning(
            "int4_tail_pool_grew",
            tails=have + more,
            reserved=self.reserved_tails,
            added_mib=round(2 * self.k_tail[:, have:].nbytes / 2**20, 1),
        )

    def sync_tail_map(self) -> None:
        self.tail_map.copy_(torch.from_numpy(self.tail_of), non_blocking=False)

    def tail_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """Paged slots (block id * bs + offset; -1: none) -> slots of the tail pool."""
        bs = self.block_size
        safe = slots.clamp_min(0).long()
        mapped = self.tail_map.index_select(0, safe // bs) * bs + safe % bs
        return torch.where(slots < 0, -1, mapped)

    # ------------------------------------------------------------------ one layer
    def layer(self, idx: int) -> Int4Cache:
        return Int4Cache(
            self.k_codes[idx],
            self.v_codes[idx],
            self.k_scale[idx],
            self.k_zero[idx],
            self.v_scale[idx],
            self.v_zero[idx],
            self.stored[idx],
        )

    def seal_layer(self, idx: int, seal: SealBatch) -> None:
        """Codes the blocks of ``seal`` in layer ``idx`` from their tails, plane by plane
        (an anchor plane's codes are its K/V; another's the delta from the plane below as
        read back from the chain's anchor up)."""
        cache = self.layer(idx)
        for plane, (a, b) in seal.groups:
            blocks, tails, stored = seal.blocks[a:b], seal.tails[a:b], seal.stored[a:b]
            prev_k = prev_v = None
            first = chain_start(plane, seal.anchor_every)
            if plane > first:
                prev_k, prev_v = self._read_back(cache, seal.chains[a:b, first:plane])
            xk = self.k_tail[idx].index_select(0, tails)
            xv = self.v_tail[idx].index_select(0, tails)
            kc, ks, kz = int4_encode(xk, prev_k, stored, True, self.group)
            vc, vs, vz = int4_encode(xv, prev_v, stored, False, self.group)
            cache.k_codes[blocks], cache.k_scale[blocks], cache.k_zero[blocks] = kc, ks, kz
            cache.v_codes[blocks], cache.v_scale[blocks], cache.v_zero[blocks] = vc, vs, vz
            cache.stored[blocks] = stored

    def _read_back(
        self, cache: Int4Cache, chains: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V float32 [n, bs, nkv, hd] read back through n chains of block ids
        (chains [n, p]: an anchor, then the planes above it)."""
        k = v = None
        for j in range(chains.shape[1]):
            ids = chains[:, j]
            stored = cache.stored[ids]
            k = int4_decode(
                cache.k_codes[ids],
                cache.k_scale[ids],
                cache.k_zero[ids],
                stored,
                k,
                True,
                self.group,
            )
            v = int4_decode(
                cache.v_codes[ids],
                cache.v_scale[ids],
                cache.v_zero[ids],
                stored,
                v,
                False,
                self.group,
            )
        assert k is not None and v is not None
        return k, v


class SealBatch:
    """Blocks to seal, sorted by plane: ids, tails, each one's block ids at the planes below
    (``chains`` [n, planes]), its ``stored`` flags [n, bs], and the (plane, row range) of
    each plane's run; ``anchor_every`` the anchor interval the codes follow."""

    def __init__(
        self,
        entries: list[tuple[int, int, int, list[int], np.ndarray]],
        planes: int,
        block_size: int,
        device: torch.device,
        anchor_every: int = 0,
    ) -> None:
        """``entries``: (plane, block id, tail, block ids of planes 0..plane-1, stored)."""
        self.anchor_every = anchor_every
        entries = sorted(entries, key=lambda e: e[0])
        self.entries = entries
        n = len(entries)
        chains = np.zeros((n, max(planes, 1)), dtype=np.int64)
        stored = np.zeros((n, block_size), dtype=np.uint8)
        self.groups: list[tuple[int, tuple[int, int]]] = []
        for i, (plane, _block, _tail, chain, flags) in enumerate(entries):
            chains[i, : len(chain)] = chain
            stored[i] = flags
            if not self.groups or self.groups[-1][0] != plane:
                self.groups.append((plane, (i, i + 1)))
            else:
                self.groups[-1] = (plane, (self.groups[-1][1][0], i + 1))
        self.block_ids = [e[1] for e in entries]
        self.blocks = torch.tensor(self.block_ids, dtype=torch.int64, device=device)
        self.tails = torch.tensor([e[2] for e in entries], dtype=torch.int64, device=device)
        self.chains = torch.from_numpy(chains).to(device)
        self.stored = torch.from_numpy(stored).to(device)

    def __len__(self) -> int:
        return len(self.block_ids)
