"""What one core pass runs, decided on the host from the batch's live rows: the flat inputs
(``pass_inputs``) and which live row each decode and coda entry of the results belongs to.

The plan is pure host work (lists and numpy), so its cost is visible and testable apart
from the device; a decode row costs a few integer writes, never a tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

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
    # rows that take their hidden state from a prompt's buffer, not the prelude or the pool:
    # (row offset in the pass, live row)
    from_prefill: list[tuple[int, LiveRow]] = field(default_factory=list)
    row_offsets: list[int] = field(default_factory=list)  # first pass row of each live row
    all_greedy: bool = True
    filters: bool = False  # some coda row uses top-k or top-p
    logprobs_top: int = -1  # most alternatives a coda row asked for; -1: none asked
    padded: bool = False  # static shapes: padding rows up to the shape's sizes
    # some segment holds several live rows (``LiveRow.joins_segment``): attention reads each
    # row's position, as its rows are not the last ones of their context
    gathered: bool = False

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
        segment_rows = _segment_rows(rows)
        widths = [
            -(-(live.row.token_start + live.row.token_count) // self.block_size) for live in rows
        ]
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
            coda_wanted=[rows[i].reaches_coda(self.total_loops) for i in coda_index],
            padded=pad_to is not None,
            gathered=len(segment_rows) < len(rows),
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
        at, s = 0, -1
        for i, (live, req) in enumerate(zip(plan.rows, reqs, strict=True)):
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
                s += 1
                query_start[s] = at
            # a joining row is the segment's latest: its context, its table's longest prefix
            table[s, :needed] = blocks[:needed]
            context_len[s] = start + count
            if live.is_decode:
                position[at] = start
                slot[at] = self.slot(blocks, start)
                pool_slot[at] = req.pool_slot
                if live.depth == 0:
                    token_id[at] = r.input_token_id
                    embed[at] = 1
            else:
                positions = np.arange(start, start + count)
                position[at : at + count] = positions
                ids = np.asarray(blocks[:needed], dtype=np.int64)
                slot[at : at + count] = (
                    ids[positions // self.block_size] * self.block_size
                    + positions % self.block_size
                )
                pool_slot[at : at + count] = self.scratch_pool_slot
                if r.embed and first_pass:
                    token_id[at : at + count] = req.prompt[start : start + count]
                    embed[at : at + count] = 1
                else:
                    plan.from_prefill.append((at, live))
            at += count
        rows_end = at
        if plan.padded:  # padding rows: no segment, no KV write, a scratch pool row
            slot[rows_end:] = -1
            embed[rows_end:] = 1
            pool_slot[rows_end:] = self.scratch_pool_slot
        query_start[s + 1 :] = rows_end

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
