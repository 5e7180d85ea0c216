"""``Int4KV``: the runner's int4-delta KV. Each pass writes its rows' K/V into the tails,
seals (per layer, before attention) the blocks its queries read coded that are not sealed
yet, and attends through ``rlt::paged_attention_int4`` with the tail rule: a key in the
query's own block from the tail, an earlier block from its codes, the chain of planes from
the anchor at or below d up to d (``kernels.kv_codec.chain_start``; no dense copy of the
context). The op reads a segment's chain as planes 0..n of its table: the host packs it.
After a batch every block whose tokens are all final is sealed at once, so tails stay few; a
request's open tails go when it finishes or is preempted. Under self-speculation a block
that a cycle may write again keeps its tails, and a write sends the request's sealed cursors
back so that the block is sealed again before it is read (``RequestBook``,
docs/speculative.md "Under int4-delta").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import torch

from kernels.kv_codec import (
    DEFAULT_BATCH_LIMITS,
    INT4_DELTA,
    BatchLimits,
    chain_start,
    check,
    open_blocks_bound,
    tail_reserve_blocks,
)
from kernels.ops import copy_kv_slots_masked, rope_write_kv
from kernels.ops.attention_int4 import paged_attention_int4
from services.worker.kv_int4.book import RequestBook
from services.worker.kv_int4.store import Int4Store, SealBatch
from services.worker.model.ouro import PassAttention
from services.worker.passes.pass_plan import PassPlan, RequestView
from services.worker.passes.rows import LiveRow
from services.worker.passes.speculative import SpecCycle


class Int4KV:
    """The int4-delta storage (``Int4Store``) and each request's ``RequestBook``."""

    k_scale = None  # the fp8 arguments of the core loop: not this codec's
    v_scale = None

    def __init__(
        self,
        layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        planes: int,
        anchor_every: int = 0,
        limits: BatchLimits = DEFAULT_BATCH_LIMITS,
    ) -> None:
        """``anchor_every``: every this many planes one is coded on its own (0: plane 0).
        ``limits``: the scheduler's, which bound the tails open at once (the pool's reserve,
        ``kernels.kv_codec.tail_reserve_blocks``)."""
        check(INT4_DELTA, head_dim, block_size)
        chain_start(0, anchor_every)  # a negative interval fails here, by name
        self.anchor_every = anchor_every
        tails = tail_reserve_blocks(
            INT4_DELTA, num_blocks, open_blocks_bound(planes, block_size, limits)
        )
        self.store = Int4Store(
            layers, num_blocks, block_size, kv_heads, head_dim, dtype, device, tails
        )
        self.layers = layers
        self.planes = planes
        self.block_size = block_size
        self.books: dict[str, RequestBook] = {}
        self._closing: list[int] = []  # tails to give back once the last pass has run
        self._sealing: list[int] = []  # the blocks the last pass seals
        self._held: set[int] = set()  # tails kept for blocks a cycle may write again
        self._releases: dict[int, list[int]] = {}  # block id to seal -> tails it gives back

    @property
    def k(self) -> torch.Tensor:
        return self.store.k_codes

    @property
    def v(self) -> torch.Tensor:
        return self.store.v_codes

    @property
    def nbytes(self) -> int:
        return self.store.nbytes

    def book(self, request_id: str) -> RequestBook:
        book = self.books.get(request_id)
        if book is None:
            book = self.books[request_id] = RequestBook(self.planes)
        return book

    # ------------------------------------------------------------------ a pass
    def pass_attention(
        self, plan: PassPlan, requests: Mapping[str, RequestView]
    ) -> Int4PassAttention:
        """Host work before a pass: tails for every block it writes, the tables and tail
        tables of its segments, and the blocks to seal before its attention reads them."""
        self._flush_closing()
        store, bs, h, shape = self.store, self.block_size, plan.host, plan.shape
        slots = h["token.slot"][: shape.num_tokens]
        pairs = shape.num_pairs
        written = [
            slots[slots >= 0] // bs,
            h["pair.src"][:pairs] // bs,
            h["pair.dst"][:pairs] // bs,
        ]
        store.open(np.concatenate(written).astype(np.int64))
        segments, width = shape.num_segments, shape.table_width
        chains = np.zeros((segments, self.planes, width), dtype=np.int64)
        tail_tables = np.zeros((segments, width), dtype=np.int64)
        seg_planes = np.zeros(segments, dtype=np.int64)
        entries: dict[int, tuple[int, int, int, list[int], np.ndarray]] = {}
        for live in plan.rows:  # before any of its seals: a row may read what another wrote
            self._reopened(live.row.request_id, live.row.token_start)
        for s, (live, end) in enumerate(_segments(plan.rows)):
            req = requests[live.row.request_id]
            plane = live.depth if self.planes > 1 else 0
            start = live.row.token_start
            last = (end - 1) // bs
            anchor = chain_start(plane, self.anchor_every)
            for i, j in enumerate(range(anchor, plane + 1)):
                chains[s, i, : last + 1] = req.tables[j][: last + 1]
            own = np.asarray(req.tables[plane][start // bs : last + 1], dtype=np.int64)
            tail_tables[s, start // bs : last + 1] = store.tail_of[own]
            seg_planes[s] = plane - anchor  # the chain's last entry
            self._need_sealed(live.row.request_id, req, range(plane + 1), last, entries)
        seal = self._seal_batch(entries.values())
        store.sync_tail_map()
        device = store.device

        def put(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(device)

        return Int4PassAttention(store, seal, put(chains), put(tail_tables), put(seg_planes))

    def _need_sealed(
        self,
        request_id: str,
        req: RequestView,
        planes: range,
        blocks: int,
        entries: dict[int, tuple[int, int, int, list[int], np.ndarray]],
    ) -> None:
        """Adds the blocks ``0 .. blocks - 1`` of ``planes`` that are not sealed."""
        book = self.book(request_id)
        for j in planes:
            table = req.tables[j]
            b = book.sealed_upto[j]
            while b < blocks:
                block = table[b]
                if not self.store.sealed[block] and block not in entries:
                    entries[block] = self._entry(book, req, j, b)
                    released = self._released_by_seal(book, req, j, b)
                    self._releases[block] = released
                    if book.uncertain(b, self.block_size):
                        self._hold(book, released, b, block)
                b += 1
            book.sealed_upto[j] = max(book.sealed_upto[j], blocks)

    def _reopened(self, request_id: str, start: int) -> None:
        """A row writes positions from ``start`` on: under speculation they may have been
        written (and their blocks sealed) by a rejected draft, so the request's sealed
        cursors go back to their block, whose seals are checked again."""
        book = self.book(request_id)
        if book.committed is not None:
            first = start // self.block_size
            book.sealed_upto = [min(b, first) for b in book.sealed_upto]

    def _released_by_seal(
        self, book: RequestBook, req: RequestView, plane: int, b: int
    ) -> list[int]:
        """The tails that sealing plane ``plane`` of block ``b`` gives back: the plane
        below's (kept until now for token-sparse prefill's copy of a frozen token up into
        this plane) and its own, unless such a copy may still read it (the next loop
        freezes prompt tokens of this block)."""
        out = [req.tables[plane - 1][b]] if plane else []
        if plane == self.planes - 1 or not book.may_copy_up(plane, b, self.block_size):
            out.append(req.tables[plane][b])
        return out

    def _hold(self, book: RequestBook, released: list[int], b: int, sealer: int) -> None:
        """A seal's ``released`` tails that a rewrite of block ``b`` needs: kept until the
        block is certain."""
        for block in released:
            self._held.add(block)
            book.held.append((b, block, sealer))

    def _release_held(self, book: RequestBook) -> None:
        """Gives back the kept tails of blocks that are certain now, where the seal that
        gave them back still stands (a block written again is sealed again, and gives
        them back then)."""
        keep: list[tuple[int, int, int]] = []
        for b, block, sealer in book.held:
            if book.uncertain(b, self.block_size):
                keep.append((b, block, sealer))
                continue
            self._held.discard(block)
            if self.store.sealed[sealer]:
                self._closing.append(block)
        book.held = keep

    def _entry(
        self, book: RequestBook, req: RequestView, plane: int, b: int
    ) -> tuple[int, int, int, list[int], np.ndarray]:
        block = req.tables[plane][b]
        tail = int(self.store.tail_of[block])
        if tail < 0:
            raise RuntimeError(f"int4-delta: block {block} (plane {plane}) has no tail to seal")
        chain = [req.tables[i][b] for i in range(plane)]
        if chain_start(plane, self.anchor_every) == plane:
            # an anchor codes every token on its own, an exited one's copied-up K/V too
            stored = np.ones(self.block_size, dtype=np.uint8)
        else:
            stored = book.stored(b, plane, self.block_size)
        return (plane, block, tail, chain, stored)

    def _seal_batch(
        self, entries: Iterable[tuple[int, int, int, list[int], np.ndarray]]
    ) -> SealBatch:
        """Marks the entries sealed; each gives back the tails its seal releases
        (``_released_by_seal``), unless a block a cycle may write again holds them."""
        seal = SealBatch(
            list(entries), self.planes, self.block_size, self.store.device, self.anchor_every
        )
        self.store.sealed[seal.block_ids] = True
        for block in seal.block_ids:
            released = self._releases.pop(block, [])
            self._closing += [b for b in released if b not in self._held]
        self._sealing = seal.block_ids
        return seal

    def abandon_pass(self) -> None:
        """A pass failed before its seals ran to the end: its blocks are open again, their
        tails kept (the batch's requests are recomputed)."""
        self.store.sealed[self._sealing] = False
        self._closing, self._sealing = [], []
        self._releases.clear()
        for book in self.books.values():  # their cursors may have passed those blocks
            book.sealed_upto = [0] * self.planes

    def _flush_closing(self) -> None:
        self.store.close(self._closing)
        self._closing = []

    # ------------------------------------------------------------------ copies
    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor, mask: torch.Tensor) -> None:
        """The exit copy: slot ``src[i]`` onto ``dst[i]`` where ``mask[i]``, in the tails
        (both are the exiting token's open blocks)."""
        store = self.store
        copy_kv_slots_masked(
            store.k_tail, store.v_tail, store.tail_slots(src), store.tail_slots(dst), mask
        )

    # ------------------------------------------------------------------ after a batch
    def after_batch(self, rows: list[LiveRow], requests: Mapping[str, RequestView]) -> None:
        """Records what the batch made final (exits included) and seals every block of its
        requests whose tokens are all final, in every layer."""
        self._flush_closing()
        touched: dict[str, RequestBook] = {}
        for live in rows:
            r = live.row
            if r.request_id not in requests:
                continue
            book = touched[r.request_id] = self.book(r.request_id)
            # a fragment's positions skip its frozen tokens, final too (copied up first)
            book.ran(r.depth, live.depth, live.end)
            if live.spec is not None:  # a cycle's position: its exit is on the position
                if live.spec.exit_loops:
                    book.exited(r.token_start, live.spec.exit_loops)
            elif live.is_decode and live.result.exited:
                book.exited(r.token_start, live.result.exit_loops)
        entries: dict[int, tuple[int, int, int, list[int], np.ndarray]] = {}
        for request_id, book in touched.items():
            req = requests[request_id]
            for j in range(self.planes):
                full = min(book.seal_limit(j) // self.block_size, len(req.tables[j]))
                self._need_sealed(request_id, req, range(j, j + 1), full, entries)
        if entries:
            seal = self._seal_batch(entries.values())
            for idx in range(self.layers):
                self.store.seal_layer(idx, seal)
        for book in touched.values():
            if book.held:
                self._release_held(book)
        self._flush_closing()

    def book_cycles(
        self, cycles: Iterable[SpecCycle], open_cycles: Mapping[str, SpecCycle]
    ) -> None:
        """Cycles ran (or are about to): each one's committed prefix and how far it drafted;
        a cycle no longer in ``open_cycles`` ended, and what it wrote past its committed
        positions is not final (the next cycle writes it again)."""
        for cycle in cycles:
            book = self.books.get(cycle.request_id)
            if book is None:  # released (finished, preempted): nothing of it is kept
                continue
            committed = cycle.start.position + cycle.decided
            book.speculating(committed, cycle.positions[-1].position + 1)
            if open_cycles.get(cycle.request_id) is not cycle:
                book.cycle_ended(committed)
                if book.held:
                    self._release_held(book)

    def release(self, request_id: str, tables: list[list[int]]) -> None:
        """The request finished or was preempted: its blocks lose their tails (a block is
        cached for prefix hits only once sealed at every plane, and then needs none)."""
        self._flush_closing()
        book = self.books.pop(request_id, None)
        if book is not None:
            self._held.difference_update(block for _b, block, _s in book.held)
        self.store.close([b for table in tables for b in table])

    def receive(self, blocks: list[int]) -> None:
        """A KV pull lands codes in ``blocks``: another worker's blocks, sealed there at
        every plane (only full blocks move), so sealed here with no tail. Nothing reads
        them before the pull is confirmed; a failed pull's blocks are written again before
        any read, which opens them."""
        self._flush_closing()
        self.store.close(blocks)
        self.store.sealed[blocks] = True

    def expect_freezes(
        self, request_id: str, first_loop: int, prompt_len: int, window: int
    ) -> None:
        """The request runs token-sparse prefill from loop ``first_loop`` in windows of
        ``window`` tokens: a prompt block's tail below such a loop is kept until its
        window's frozen tokens were copied up from it."""
        book = self.book(request_id)
        book.freezes_from, book.prompt_len, book.window = first_loop, prompt_len, window

    def freeze(self, request_id: str, req: RequestView, positions: np.ndarray, loop: int) -> None:
        """Token-sparse prefill froze ``positions`` at ``loop``: they store no delta there
        (nor above), and their K/V is about to be copied up from plane ``loop - 1``'s tails
        into plane ``loop``'s, which are opened here."""
        book = self.book(request_id)
        for p in positions.tolist():
            book.tops[p] = min(book.tops.get(p, self.planes - 1), loop - 1)
        blocks = np.unique(positions // self.block_size)
        below = np.asarray(req.tables[loop - 1], dtype=np.int64)[blocks]
        if (self.store.tail_of[below] < 0).any():
            raise RuntimeError("int4-delta: a frozen token's plane below has no tail to copy")
        self.store.open(np.asarray(req.tables[loop], dtype=np.int64)[blocks])
        self.store.sync_tail_map()
        self._copied_up(book, req, int(positions[0]), loop)

    def _copied_up(self, book: RequestBook, req: RequestView, position: int, loop: int) -> None:
        """The window holding ``position`` opened at ``loop``: its frozen tokens are copied
        up before the next pass, after which no copy reads plane ``loop - 1`` of the blocks
        wholly inside the window; the sealed ones give their tails back then (not only once
        plane ``loop`` is sealed, which may be a whole prompt later)."""
        start, end = book.window_of(position)
        bs = self.block_size
        table = req.tables[loop - 1]
        for b in range(-(-start // bs), min(end // bs, len(table))):
            block = table[b]
            if self.store.sealed[block] and block not in self._held:
                self._closing.append(block)


def _segments(rows: list[LiveRow]) -> list[tuple[LiveRow, int]]:
    """Each attention segment's first row and one past its last row's last position (a
    token-sparse fragment's positions skip its frozen tokens: its last query reads, and
    the pass seals, the blocks up to there)."""
    out: list[tuple[LiveRow, int]] = []
    for i, live in enumerate(rows):
        end = live.end
        if live.joins_segment and i > 0:
            out[-1] = (out[-1][0], end)
        else:
            out.append((live, end))
    return out


class Int4PassAttention:
    """One pass's int4-delta attention, layer by layer: write K/V into the tails, seal the
    pass's blocks in this layer, attend."""

    def __init__(
        self,
        store: Int4Store,
        seal: SealBatch,
        chains: torch.Tensor,
        tail_tables: torch.Tensor,
        planes: torch.Tensor,
    ) -> None:
        self.store = store
        self.seal = seal
        self.chains = chains
        self.tail_tables = tail_tables
        self.planes = planes
        self._slots: torch.Tensor | None = None

    def layer(
        self,
        idx: int,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: PassAttention,
        num_heads: int,
        num_kv_heads: int,
        scale: float,
    ) -> torch.Tensor:
        store = self.store
        if self._slots is None:
            self._slots = store.tail_slots(attn.slot_mapping)
        q = rope_write_kv(
            qkv,
            cos,
            sin,
            store.k_tail[idx],
            store.v_tail[idx],
            self._slots,
            num_heads,
            num_kv_heads,
        )
        if len(self.seal):
            store.seal_layer(idx, self.seal)
        return paged_attention_int4(
            q,
            store.layer(idx),
            store.k_tail[idx],
            store.v_tail[idx],
            self.chains,
            self.tail_tables,
            self.planes,
            attn.context_lens,
            attn.query_start,
            scale,
            attn.max_query_len,
            attn.query_pos,
        )
