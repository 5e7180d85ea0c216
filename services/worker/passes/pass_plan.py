"""What one core pass runs, decided on the host from the batch's live rows: the flat inputs
(``pass_inputs``) and which live row each decode and coda entry of the results belongs to.

The plan is pure host work (lists and numpy), so its cost is visible and testable apart
from the device; a decode row costs a few integer writes, never a tensor.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from messages.batch import WorkerSampling
from services.worker.passes.pass_inputs import HostPass, PassShape
from services.worker.passes.rows import LiveRow

_NEVER = 1 << 30  # a loop count no row reaches: padding rows never exit
_F32_TINY = float(np.finfo(np.float32).smallest_subnormal)


@dataclass
class RequestView:
    """What a plan reads of a request on the worker."""

    prompt: list[int]
    sampling: WorkerSampling
    tables: list[list[int]]  # one block table per plane
    pool_slot: int  # its row of the decode hidden-state pool


@dataclass
class PromptGroup:
    """One request's prompt tokens in a pass: ranges of the ``load.*`` and ``store.*``
    sections (their pass rows and prompt positions), so its hidden rows move in one gather
    each way."""

    request_id: str
    loads: tuple[int, int]
    stores: tuple[int, int]


@dataclass
class PassPlan:
    rows: list[LiveRow]  # the live rows of this pass, in row order
    shape: PassShape
    host: HostPass
    max_query_len: int
    decode: list[LiveRow] = field(default_factory=list)  # results' decode entries
    coda: list[LiveRow] = field(default_factory=list)  # results' coda entries
    # loops each decode entry has run once this pass ends, and whether each coda entry's
    # row may take a token from this pass (both as planned: the rows move on meanwhile)
    decode_loops: list[int] = field(default_factory=list)
    coda_wanted: list[bool] = field(default_factory=list)
    # per request with prompt rows: where its loads and stores sit in the pass's sections
    prompt_groups: list[PromptGroup] = field(default_factory=list)
    row_offsets: list[int] = field(default_factory=list)  # first pass row of each live row
    all_greedy: bool = True
    filters: bool = False  # some coda row uses top-k or top-p
    logprobs_top: int = -1  # most alternatives a coda row asked for; -1: none asked
    padded: bool = False  # static shapes: padding rows up to the shape's sizes
    # some segment holds several live rows (``LiveRow.joins_segment``): attention reads each
    # row's position, as its rows are not the last ones of their context
    gathered: bool = False
    # some coda row keeps its logits (a sampled speculative row): the runner stores the
    # pass's coda logits here, float32 [coda rows, V]
    keep_logits: bool = False
    logits: Any = None
    raw_logits: Any = None  # ...and their raw logits too, if some coda row asks logprobs

    @property
    def decode_only(self) -> bool:
        return len(self.decode) == len(self.rows) and all(r.row.token_count == 1 for r in self.rows)


class PassPlanner:
    """Builds pass plans for one runner (its block size, planes and scratch slots)."""

    def __init__(
        self,
        block_size: int,
        total_loops: int,
        last_exited: bool,
        scratch_slot: int,
        scratch_pool_slot: int,
        host_words: Callable[[int], np.ndarray],
    ) -> None:
        self.block_size = block_size
        self.total_loops = total_loops
        self.last_exited = last_exited
        self.scratch_slot = scratch_slot  # a KV slot nobody reads: padding writes go there
        self.scratch_pool_slot = scratch_pool_slot
        self.host_words = host_words

    def plane(self, depth: int) -> int:
        return depth if self.last_exited else 0

    def slot(self, table: list[int], position: int) -> int:
        bs = self.block_size
        index = position // bs
        if index >= len(table):
            raise ValueError(
                f"block table of {len(table)} blocks does not cover position {position} "
                f"(block_size {bs})"
            )
        return table[index] * bs + position % bs

    # ------------------------------------------------------------------ what a pass holds
    def _may_exit(self, live: LiveRow, sampling: WorkerSampling) -> bool:
        loops = live.loops_run
        if live.draft_coda:  # a speculative draft reads its coda at its draft depth
            return True
        if live.row.forced_exit_loops:
            return loops >= live.row.forced_exit_loops
        # a token's shed depth budget (BatchRow.max_loops) caps the request's own
        if loops >= (live.row.max_loops or sampling.max_loops):
            return True
        return sampling.exit_threshold < 1.0 and loops >= sampling.min_loops

    def _pairs(self, live: LiveRow, req: RequestView) -> list[tuple[int, int]]:
        """LAST_EXITED: (source, destination) slots if this decode row exits now."""
        if not self.last_exited or live.loops_run >= self.total_loops:
            return []
        position = live.row.token_start
        src = self.slot(req.tables[live.depth], position)
        return [
            (src, self.slot(req.tables[p], position))
            for p in range(live.depth + 1, self.total_loops)
        ]

    def plan(
        self,
        rows: list[LiveRow],
        requests: dict[str, RequestView],
        first_pass: bool,
        pad_to: int | None = None,
        table_width: int | None = None,
        with_coda: bool | None = None,
    ) -> PassPlan:
        """The plan of a pass over ``rows``. ``pad_to``: static shapes for that many decode
        rows (all of ``rows`` must be single-token decode rows), block tables ``table_width``
        wide. A static pass has the coda and the exit copies (for all its rows) only if some
        row may exit at this loop; ``with_coda`` overrides that (a capture's blank plan)."""
        reqs = [requests[live.row.request_id] for live in rows]
        decode = [i for i, live in enumerate(rows) if live.is_decode]
        may_exit = {i for i in decode if self._may_exit(rows[i], reqs[i].sampling)}
        coda_index = [
            i
            for i, live in enumerate(rows)
            if live.reaches_coda(self.total_loops) and (not live.is_decode or i in may_exit)
        ]
        # exit copies only for rows that can exit now (none below max_loops at fixed depth)
        pairs = [
            (j, p)
            for j, i in enumerate(decode)
            if i in may_exit
            for p in self._pairs(rows[i], reqs[i])
        ]
        num_tokens = sum(live.row.token_count for live in rows)
        stores = sum(live.row.token_count for live in rows if not live.is_decode)
        loads = stores - sum(
            live.row.token_count
            for live in rows
            if not live.is_decode and live.row.embed and first_pass
        )
        segment_rows = _segment_rows(rows)
        widths = [-(-live.end // self.block_size) for live in rows]
        if pad_to is not None:
            padded = pad_to
            # one static shape per bucket with the coda and one without: a loop where no row
            # may exit reads no lm_head and copies no KV
            coda = bool(may_exit) if with_coda is None else with_coda
            spare_planes = self.total_loops - 1 if self.last_exited and coda else 0
            shape = PassShape(
                padded,
                padded,
                table_width or 1,
                padded,
                padded * spare_planes,
                padded if coda else 0,
            )
        else:
            shape = PassShape(
                num_tokens,
                len(segment_rows),
                max(widths, default=1) or 1,
                len(decode),
                len(pairs),
                len(coda_index),
                loads,
                stores,
            )
        host = HostPass(shape, self.host_words(shape.size))
        plan = PassPlan(
            rows=rows,
            shape=shape,
            host=host,
            max_query_len=1 if pad_to is not None else max(segment_rows),
            decode=[rows[i] for i in decode],
            coda=[rows[i] for i in coda_index],
            decode_loops=[rows[i].loops_run for i in decode],
            coda_wanted=[
                rows[i].reaches_coda(self.total_loops) or rows[i].draft_coda for i in coda_index
            ],
            padded=pad_to is not None,
            gathered=len(segment_rows) < len(rows)
            or any(live.positions is not None for live in rows),
            keep_logits=any(rows[i].keep_logits for i in coda_index),
        )
        self._fill_rows(plan, reqs, first_pass)
        self._fill_decode(plan, decode, reqs, pairs)
        self._fill_coda(plan, coda_index, reqs)
        return plan

    def _fill_rows(self, plan: PassPlan, reqs: list[RequestView], first_pass: bool) -> None:
        h = plan.host
        position, slot, token_id = h["token.position"], h["token.slot"], h["token.token_id"]
        embed, pool_slot = h["token.embed"], h["token.pool_slot"]
        table, context_len, query_start = (
            h["segment.table"],
            h["segment.context_len"],
            h["segment.query_start"],
        )
        # per request: the pass rows of its loads and of its stores
        moves: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {}
        at, s = 0, -1
        segment: tuple[int, list[int], int] | None = None  # (index, table, blocks needed)
        segment_ids = np.zeros(0, dtype=np.int64)  # the open segment's table, as an array
        joined = _joined_runs(plan.rows)
        skip_to = 0
        for i, (live, req) in enumerate(zip(plan.rows, reqs, strict=True)):
            if i < skip_to:
                continue
            end = joined.get(i, i + 1 if live.positions is not None else None)
            if end is not None and not (live.row.embed and first_pass):
                # a token-sparse fragment's rows, filled with array ops: host work per row
                # would grow with its active tokens
                if segment is not None:
                    _write_table(table, segment)
                s += 1
                segment, at = self._fill_joined(plan, i, end, req, s, at, moves)
                skip_to = end
                continue
            r = live.row
            count, start = r.token_count, r.token_start
            blocks = req.tables[self.plane(live.depth)]
            plan.row_offsets.append(at)
            needed = -(-(start + count) // self.block_size)
            if needed > len(blocks) or needed > plan.shape.table_width:
                raise ValueError(
                    f"block table of {len(blocks)} blocks does not cover position "
                    f"{start + count - 1} (block_size {self.block_size})"
                )
            if live.joins_segment and i > 0:
                _check_joins(plan.rows[i - 1], live)
            else:
                if segment is not None:
                    _write_table(table, segment)
                s += 1
                query_start[s] = at
                if not live.is_decode:
                    segment_ids = np.asarray(blocks, dtype=np.int64)
            # a joining row is the segment's latest: its context, its table's longest prefix
            # (written once, when the segment closes: a sparse fragment is one segment of
            # many rows, and a table per row would cost rows x blocks)
            segment = (s, blocks, needed)
            context_len[s] = start + count
            if live.is_decode:
                position[at] = start
                slot[at] = self.slot(blocks, start)
                pool_slot[at] = req.pool_slot if live.pool_slot is None else live.pool_slot
                if live.depth == 0:
                    token_id[at] = r.input_token_id
                    embed[at] = 1
            else:
                positions = np.arange(start, start + count)
                position[at : at + count] = positions
                slot[at : at + count] = (
                    segment_ids[positions // self.block_size] * self.block_size
                    + positions % self.block_size
                )
                pool_slot[at : at + count] = self.scratch_pool_slot
                pass_rows = np.arange(at, at + count)
                load_rows, stores = moves.setdefault(r.request_id, ([], []))
                stores.append(pass_rows)
                if r.embed and first_pass:
                    token_id[at : at + count] = req.prompt[start : start + count]
                    embed[at : at + count] = 1
                else:
                    load_rows.append(pass_rows)
            at += count
        if segment is not None:
            _write_table(table, segment)
        if moves:
            self._fill_moves(plan, moves)
        rows_end = at
        if plan.padded:  # padding rows: no segment, no KV write, a scratch pool row
            slot[rows_end:] = -1
            embed[rows_end:] = 1
            pool_slot[rows_end:] = self.scratch_pool_slot
        query_start[s + 1 :] = rows_end

    def _fill_joined(
        self,
        plan: PassPlan,
        first: int,
        end: int,
        req: RequestView,
        s: int,
        at: int,
        moves: dict[str, tuple[list[np.ndarray], list[np.ndarray]]],
    ) -> tuple[tuple[int, list[int], int], int]:
        """Rows ``[first, end)``: one segment of prompt rows of one request and loop at
        ascending positions (``LiveRow.joins_segment``), all read from the prompt's hidden
        rows. Returns the segment (for its table) and the next pass row."""
        run = plan.rows[first:end]
        head = run[0]
        if head.positions is not None:  # a fragment's active tokens, already laid out
            positions = head.positions
            plan.row_offsets.append(at)
        else:
            n = len(run)
            starts = np.fromiter((live.row.token_start for live in run), np.int64, n)
            counts = np.fromiter((live.row.token_count for live in run), np.int64, n)
            if np.any(starts[1:] < starts[:-1] + counts[:-1]) or any(
                live.is_decode
                or live.row.request_id != head.row.request_id
                or live.depth != head.depth
                for live in run
            ):
                for previous, live in itertools.pairwise(run):
                    _check_joins(previous, live)  # names the first row that cannot join
            within = np.concatenate([[0], np.cumsum(counts)[:-1]])
            plan.row_offsets.extend((at + within).tolist())
            positions = np.repeat(starts - within, counts) + np.arange(int(counts.sum()))
        total = int(positions.size)
        context = int(positions[-1]) + 1
        blocks = req.tables[self.plane(head.depth)]
        needed = -(-context // self.block_size)
        if needed > len(blocks) or needed > plan.shape.table_width:
            raise ValueError(
                f"block table of {len(blocks)} blocks does not cover position "
                f"{context - 1} (block_size {self.block_size})"
            )
        h = plan.host
        h["segment.query_start"][s] = at
        h["segment.context_len"][s] = context
        h["token.position"][at : at + total] = positions
        ids = np.asarray(blocks, dtype=np.int64)
        bs = self.block_size
        h["token.slot"][at : at + total] = ids[positions // bs] * bs + positions % bs
        h["token.pool_slot"][at : at + total] = self.scratch_pool_slot
        pass_rows = np.arange(at, at + total)
        load_rows, stores = moves.setdefault(head.row.request_id, ([], []))
        stores.append(pass_rows)
        load_rows.append(pass_rows)
        return (s, blocks, needed), at + total

    def _fill_moves(
        self,
        plan: PassPlan,
        moves: dict[str, tuple[list[np.ndarray], list[np.ndarray]]],
    ) -> None:
        """The load and store sections, grouped by request (a prompt row's position is its
        pass row's position: ``token.position``)."""
        h = plan.host
        position = h["token.position"]
        load_row, load_position = h["load.row"], h["load.position"]
        store_row, store_position = h["store.row"], h["store.position"]
        loaded = stored = 0
        for request_id, (load_rows, store_rows) in moves.items():
            first_load, first_store = loaded, stored
            if load_rows:
                rows = np.concatenate(load_rows)
                load_row[loaded : loaded + rows.size] = rows
                load_position[loaded : loaded + rows.size] = position[rows]
                loaded += rows.size
            rows = np.concatenate(store_rows)
            store_row[stored : stored + rows.size] = rows
            store_position[stored : stored + rows.size] = position[rows]
            stored += rows.size
            plan.prompt_groups.append(
                PromptGroup(request_id, (first_load, loaded), (first_store, stored))
            )

    def _fill_decode(
        self,
        plan: PassPlan,
        decode: list[int],
        reqs: list[RequestView],
        pairs: list[tuple[int, tuple[int, int]]],
    ) -> None:
        h = plan.host
        row, loops_run = h["decode.row"], h["decode.loops_run"]
        min_loops, max_loops = h["decode.min_loops"], h["decode.max_loops"]
        forced = h["decode.forced"]
        threshold, remaining = h["decode.threshold"], h["decode.remaining"]
        for j, i in enumerate(decode):
            live, s = plan.rows[i], reqs[i].sampling
            row[j] = plan.row_offsets[i]
            loops_run[j] = live.loops_run
            min_loops[j] = s.min_loops
            max_loops[j] = live.row.max_loops or s.max_loops
            forced[j] = live.row.forced_exit_loops
            threshold[j] = s.exit_threshold
            remaining[j] = live.row.remaining
        if plan.padded:
            n = len(decode)
            row[n:] = np.arange(n, plan.shape.num_decode)
            max_loops[n:] = _NEVER
            threshold[n:] = 1.0
            remaining[n:] = 1.0
        src, dst, owner = h["pair.src"], h["pair.dst"], h["pair.decode_row"]
        for k, (j, (a, b)) in enumerate(pairs):
            src[k], dst[k], owner[k] = a, b, j
        if plan.padded:
            src[len(pairs) :] = self.scratch_slot
            dst[len(pairs) :] = self.scratch_slot
            owner[len(pairs) :] = 0  # any row: a scratch-to-scratch copy changes nothing

    def _fill_coda(self, plan: PassPlan, coda_index: list[int], reqs: list[RequestView]) -> None:
        h = plan.host
        row, top_k, temperature = h["coda.row"], h["coda.top_k"], h["coda.temperature"]
        top_p, seed, output_index = h["coda.top_p"], h["coda.seed"], h["coda.output_index"]
        for j, i in enumerate(coda_index):
            live, s = plan.rows[i], reqs[i].sampling
            row[j] = plan.row_offsets[i] + live.row.token_count - 1  # its last position
            top_k[j] = s.top_k
            # a positive temperature that float32 rounds to 0 is not greedy: NaN fails the row
            tiny = s.temperature != 0.0 and abs(s.temperature) < _F32_TINY
            temperature[j] = np.nan if tiny else s.temperature
            top_p[j] = s.top_p
            seed[j] = s.seed
            output_index[j] = live.row.output_index
            if s.temperature != 0.0:
                plan.all_greedy = False
                if s.top_k > 0 or s.top_p < 1.0:
                    plan.filters = True
            if s.logprobs is not None:
                plan.logprobs_top = max(plan.logprobs_top, s.logprobs)
        if plan.padded:
            n = len(coda_index)
            row[n:] = np.arange(n, plan.shape.num_coda)
            top_p[n:] = 1.0


def _joined_runs(rows: list[LiveRow]) -> dict[int, int]:
    """first row -> end of each run of two or more rows that form one segment."""
    runs: dict[int, int] = {}
    first = 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or not rows[i].joins_segment:
            if i - first > 1:
                runs[first] = i
            first = i
    return runs


def _write_table(table: np.ndarray, segment: tuple[int, list[int], int]) -> None:
    s, blocks, needed = segment
    table[s, :needed] = blocks[:needed]


def _segment_rows(rows: list[LiveRow]) -> list[int]:
    """Token rows of each attention segment: a live row's own, with those joining it."""
    counts: list[int] = []
    for i, live in enumerate(rows):
        if live.joins_segment and i > 0:
            counts[-1] += live.row.token_count
        else:
            counts.append(live.row.token_count)
    return counts


def _check_joins(previous: LiveRow, live: LiveRow) -> None:
    """A row joins a segment only after a row of the same request and loop at an earlier
    position: the segment's rows share one block table and ascend."""
    a, b = previous.row, live.row
    if (
        a.request_id != b.request_id
        or previous.depth != live.depth
        or previous.is_decode
        or live.is_decode
        or b.token_start < a.token_start + a.token_count
    ):
        raise ValueError(
            f"row {b.request_id}@{b.token_start} (loop {live.depth}) cannot join the segment "
            f"of {a.request_id}@{a.token_start} (loop {previous.depth})"
        )
