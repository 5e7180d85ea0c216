"""The row protocol every worker backend follows: which rows of a batch run, how a decode
row continues or ends, and what the scheduler hears back.

``ModelRunner`` (tensors) and ``SimRunner`` (a cost model) both run a batch as a list of
``LiveRow`` and keep a ``RowCursor`` per request, so follow-on resolution, the next decode
row after a loop or a token, and the result fields are written once, here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from messages.batch import Batch, BatchKind, BatchResult, BatchRow, RowKind, RowResult


@dataclass
class RunnerStats:
    """What a runner did since it was made: the bench reads these (in-process, or from a
    worker service's health reply) and so can metrics."""

    batches: int = 0
    decode_batches: int = 0  # batches with decode rows: each is one pass that carries them
    core_passes: int = 0
    core_rows: int = 0  # hidden-state rows over all core passes (a decode row is one)
    execute_s: float = 0.0  # time inside execute

    def snapshot(self) -> dict[str, float]:
        return dict(self.__dict__)

    def record_pass(self, num_rows: int) -> None:
        self.core_passes += 1
        self.core_rows += num_rows

    def record_batch(self, batch: Batch, seconds: float) -> None:
        """One executed batch that took ``seconds``."""
        self.execute_s += seconds
        self.batches += 1
        if batch.kind is BatchKind.RECURRENT and any(
            r.kind in (RowKind.DECODE, RowKind.FOLLOW_ON, RowKind.SPECULATIVE) for r in batch.rows
        ):
            self.decode_batches += 1


@dataclass
class RowCursor:
    """A request's next decode row, known once its last decode or coda row ran: what a
    follow-on row (sent before the scheduler saw that result) resolves to."""

    next_decode: BatchRow | None = None


@dataclass
class LiveRow:
    """One row of a batch as it runs: ``depth`` loops done so far, ``loops_left`` to go."""

    index: int  # the row's place in the batch
    row: BatchRow
    depth: int
    loops_left: int
    result: RowResult = field(init=False)

    is_decode: bool = field(init=False)
    # its tokens join the previous live row's attention segment: the next active token of one
    # token-sparse fragment (same request, loop and block table, a later position)
    joins_segment: bool = False
    # a speculative cycle's row (services/worker/passes/speculative.py): the position it runs
    # (None: a plain row), its own decode-pool row (None: the request's), the loop count
    # whose coda it reads even without an exit (a draft's end; 0: none), and whether that
    # coda's logits are kept (sampled rows: the rejection rule reads them)
    spec: Any = None
    pool_slot: int | None = None
    coda_at: int = 0
    keep_logits: bool = False
    # a token-sparse fragment's active tokens (ascending prompt positions, numpy int64):
    # one pass row each, all of one attention segment; None: the row's token range
    positions: Any = None

    def __post_init__(self) -> None:
        self.result = RowResult(row_index=self.index)
        self.is_decode = self.row.kind is RowKind.DECODE

    @property
    def end(self) -> int:
        """One past the last prompt position this row runs."""
        if self.positions is not None:
            return int(self.positions[-1]) + 1
        return self.row.token_start + self.row.token_count

    @property
    def loops_run(self) -> int:
        """Loops done once the current one ends."""
        return self.depth + 1

    def reaches_coda(self, total_loops: int) -> bool:
        """Whether this loop may end in the coda: a decode row that may exit now, or a
        prompt chunk's last loop at full depth that asks for logits."""
        row = self.row
        if not row.compute_logits:
            return False
        if not self.is_decode:
            return self.loops_run == total_loops
        return True

    @property
    def draft_coda(self) -> bool:
        """This loop ends a draft: the coda runs whether or not the row exits."""
        return self.coda_at > 0 and self.loops_run == self.coda_at


def live_rows(batch: Batch, cursors: Mapping[str, RowCursor]) -> list[LiveRow]:
    """The rows of ``batch`` that run: follow-ons resolved to their request's next decode
    row; one whose predecessor did not run (no cursor) is left out, and reported skipped."""
    rows: list[LiveRow] = []
    for i, row in enumerate(batch.rows):
        if row.kind is RowKind.SPECULATIVE:
            continue  # resolved by the request's cycle (services/worker/passes/speculative.py)
        if row.kind is RowKind.FOLLOW_ON:
            cursor = cursors.get(row.request_id)
            if cursor is None or cursor.next_decode is None:
                continue
            follow_on, (row, cursor.next_decode) = row, (cursor.next_decode, None)
            if row.depth == 0 and follow_on.max_loops != row.max_loops:
                # a token's depth budget is the one its first loop was sent with; later
                # loops keep it (end_loop carries the row's fields on)
                row = msgspec.structs.replace(row, max_loops=follow_on.max_loops)
        rows.append(LiveRow(i, row, row.depth, row.num_loops))
    return rows


def forget_cursors(batch: Batch, cursors: Mapping[str, RowCursor]) -> None:
    """After a batch failed half-run: no cursor of its requests can be trusted, so their
    follow-ons are skipped."""
    for row in batch.rows:
        if (cursor := cursors.get(row.request_id)) is not None:
            cursor.next_decode = None


def end_loop(
    live: LiveRow, cursor: RowCursor, *, loops_run: int, exited: bool, remaining: float
) -> None:
    """A decode row's loop ended after ``loops_run`` loops: it exits (the coda will set its
    next row) or goes on at the next depth from the survival it reached."""
    live.result.remaining = remaining
    live.result.exited = exited
    if exited:
        live.result.exit_loops = loops_run
        cursor.next_decode = None
    else:
        cursor.next_decode = msgspec.structs.replace(
            live.row, depth=loops_run, embed=False, remaining=remaining
        )


def token_sampled(live: LiveRow, cursor: RowCursor, token: int) -> None:
    """The coda sampled ``token`` for this row: it is fed back at the next position, from
    loop 0."""
    row = live.row
    live.result.token_id = token
    cursor.next_decode = BatchRow(
        request_id=row.request_id,
        kind=RowKind.DECODE,
        token_start=live.end,
        token_count=1,
        depth=0,
        embed=True,
        input_token_id=token,
        compute_logits=True,
        output_index=row.output_index + 1,
    )


def row_failed(live: LiveRow, cursor: RowCursor, reason: str) -> None:
    """This row alone failed (e.g. its logits were NaN): its request ends, the others go on."""
    live.result.error = reason
    cursor.next_decode = None


def batch_result(
    batch: Batch, rows: list[LiveRow], extra: Mapping[int, RowResult] | None = None
) -> BatchResult:
    """The result of ``batch`` from the rows that ran (and ``extra``: results by row index,
    a speculative row's); the others are marked skipped."""
    ran = {live.index: live.result for live in rows if live.spec is None}
    if extra:
        ran.update(extra)
    results = [ran.get(i) or RowResult(row_index=i, skipped=True) for i in range(len(batch.rows))]
    return BatchResult(seq=batch.seq, rows=results)
