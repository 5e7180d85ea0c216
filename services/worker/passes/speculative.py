"""Self-speculative cycles on the worker: a SPECULATIVE row of a batch becomes the next
pass of its request's cycle (draft or verify rows, plain single-token decode rows of the
pass), and what the pass gave is decided into committed tokens (docs/speculative.md).

The cycle lives here, beside the request's row cursor: the scheduler only learns what was
committed. Both backends use it: ``ModelRunner`` (tensors) and ``SimRunner`` (a cost
model whose draft agrees with the target at a given rate).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from messages.batch import Batch, BatchRow, RowKind, RowResult, SampledLogprobs, WorkerSampling
from services.common.speculative_sampling import accept_or_resample
from services.worker.passes.rows import LiveRow, RowCursor


class CycleGrammar(Protocol):
    """What a cycle asks of its request's structured output (``RequestGrammar``)."""

    def position_mask(self) -> Any: ...
    def speculate(self, token: int) -> str | None: ...
    def commit(self, token: int, output_index: int) -> str | None: ...
    def rollback(self) -> None: ...


# a token's log-probability under one row of raw logits (the runner's ``token_logprob``)
TokenScorer = Callable[[torch.Tensor, int], float]


@dataclass
class SpecPosition:
    """One position of a cycle: position ``p + index``, which gives output ``output_index``."""

    index: int
    position: int
    output_index: int
    input_token: int
    pool_slot: int
    depth: int = 0  # loops run
    remaining: float = 1.0
    exit_loops: int = 0  # 0: has not exited
    draft_token: int = -1  # what was fed to the next position (the exact token if it exited)
    token: int = -1  # the coda's token at its exit (the target's)
    draft_logits: torch.Tensor | None = None
    target_logits: torch.Tensor | None = None
    # the exit coda's log-probabilities (asked for by the request), of ``token``; and its
    # raw logits where the rejection rule may commit another token than ``token``
    logprobs: SampledLogprobs | None = None
    raw_logits: torch.Tensor | None = None
    # a structured output's mask of this position: the grammar state after the committed
    # tokens and the drafts before it (its draft and its target are sampled under it)
    mask: Any = None  # a ``PositionMask``
    error: str | None = None


@dataclass
class SpecCycle:
    request_id: str
    k: int  # draft positions; position k is the bonus position
    d: int
    positions: list[SpecPosition]
    drafting: int = 0  # the position being drafted; k + 1: drafting is over
    decided: int = 0  # positions committed so far
    extra_slots: list[int] = field(default_factory=list)
    max_loops: int | None = None  # a shed depth budget (None: the request's)
    grammar: CycleGrammar | None = None  # its structured output, if it has one

    @property
    def start(self) -> SpecPosition:
        return self.positions[0]


class Speculation:
    """The worker's cycles, one per speculating request.

    ``allocate``/``free`` hand out decode-pool rows (position 0 uses the request's own).
    ``grammars``: the structured outputs of the requests that have one (the runner's);
    ``score``: scores a committed token that is not its exit coda's own (log-probabilities
    of a sampled cycle)."""

    def __init__(
        self,
        total_loops: int,
        allocate: Callable[[], int],
        free: Callable[[int], None],
        grammars: Mapping[str, CycleGrammar] | None = None,
        score: TokenScorer | None = None,
    ) -> None:
        self.total_loops = total_loops
        self._allocate = allocate
        self._free = free
        self._grammars: Mapping[str, CycleGrammar] = grammars if grammars is not None else {}
        self._score = score
        self.cycles: dict[str, SpecCycle] = {}

    def drop(self, request_id: str) -> None:
        """The request ended, was preempted or is loaded again: its cycle is gone (and its
        grammar back at the committed tokens)."""
        cycle = self.cycles.pop(request_id, None)
        if cycle is not None:
            for slot in cycle.extra_slots:
                self._free(slot)
            if cycle.grammar is not None:
                cycle.grammar.rollback()

    # ------------------------------------------------------------------ resolving rows
    def resolve(
        self, batch: Batch, requests: Mapping[str, RowCursor], pool_slot: Callable[[str], int]
    ) -> tuple[list[LiveRow], dict[int, SpecCycle]]:
        """The live rows of ``batch``'s SPECULATIVE rows, and the cycle of each such row
        that runs (by row index). A row with nothing to run is left out (skipped)."""
        rows: list[LiveRow] = []
        running: dict[int, SpecCycle] = {}
        for i, row in enumerate(batch.rows):
            if row.kind is not RowKind.SPECULATIVE:
                continue
            cursor = requests.get(row.request_id)
            if cursor is None:
                continue
            cycle = self.cycles.get(row.request_id)
            if cycle is None:
                cycle = self._start(row, cursor, pool_slot(row.request_id))
                if cycle is None:
                    continue
            live = self._rows(i, cycle, cursor.sampling)  # type: ignore[attr-defined]
            if live:
                rows.extend(live)
                running[i] = cycle
        return rows, running

    def _start(self, row: BatchRow, cursor: RowCursor, pool_slot: int) -> SpecCycle | None:
        """A new cycle from the row (the scheduler knew where it starts) or from the token
        the request's last cycle or decode row ended with."""
        if row.embed:
            position, token, index = row.token_start, row.input_token_id, row.output_index
        else:
            nxt = cursor.next_decode
            if nxt is None or nxt.depth != 0:
                return None  # its predecessor did not run (failed): skipped
            position, token, index = nxt.token_start, nxt.input_token_id, nxt.output_index
        cursor.next_decode = None
        sampling: WorkerSampling = cursor.sampling  # type: ignore[attr-defined]
        k = row.speculative_tokens
        if sampling.max_tokens:
            # position p + i gives output index + i: none past max_tokens (nor its KV)
            k = min(k, sampling.max_tokens - 1 - index)
        if k < 0:
            return None  # the request already has all its tokens: a stale row
        grammar = self._grammars.get(row.request_id)
        start = SpecPosition(0, position, index, token, pool_slot)
        if grammar is not None:
            start.mask = grammar.position_mask()
        cycle = SpecCycle(
            row.request_id, k, row.draft_loops, [start], max_loops=row.max_loops, grammar=grammar
        )
        self.cycles[row.request_id] = cycle
        return cycle

    def _rows(self, index: int, cycle: SpecCycle, sampling: WorkerSampling) -> list[LiveRow]:
        """The pass's rows of the cycle: every drafted position that has not exited runs
        its next loop (verify rows), beside the position being drafted. A position at loop
        j reads its predecessors' plane j, which each wrote (or filled by its exit) in an
        earlier pass: each started earlier and runs one loop per pass."""
        sampled = sampling.temperature != 0.0
        drafted = cycle.positions[cycle.decided : cycle.drafting]
        rows = [
            # verify rows keep the target's logits where a draft must be tested against them
            self._live(index, cycle, pos, 0, sampled and pos.index < cycle.k)
            for pos in drafted
            if pos.exit_loops == 0
        ]
        if cycle.drafting <= cycle.k:
            pos = cycle.positions[cycle.drafting]
            draft_end = cycle.d if pos.index < cycle.k else 0
            rows.append(self._live(index, cycle, pos, draft_end, sampled and draft_end > 0))
        return rows

    def _live(
        self, index: int, cycle: SpecCycle, pos: SpecPosition, coda_at: int, keep: bool
    ) -> LiveRow:
        row = BatchRow(
            request_id=cycle.request_id,
            kind=RowKind.DECODE,
            token_start=pos.position,
            token_count=1,
            depth=pos.depth,
            embed=pos.depth == 0,
            input_token_id=pos.input_token,
            remaining=pos.remaining,
            compute_logits=True,
            output_index=pos.output_index,
            max_loops=cycle.max_loops,
        )
        live = LiveRow(index, row, pos.depth, 1)
        live.spec = pos
        live.pool_slot = pos.pool_slot
        live.coda_at = coda_at
        live.keep_logits = keep
        return live

    # ------------------------------------------------------------------ a pass's results
    @staticmethod
    def loop_ended(live: LiveRow, *, loops_run: int, exited: bool, remaining: float) -> None:
        pos: SpecPosition = live.spec
        pos.depth = loops_run
        pos.remaining = remaining
        if exited:
            pos.exit_loops = loops_run

    @staticmethod
    def coda(
        live: LiveRow,
        token: int,
        logits: torch.Tensor | None,
        error: str | None,
        logprobs: SampledLogprobs | None = None,
        raw_logits: torch.Tensor | None = None,
    ) -> None:
        """The coda of a spec row gave ``token``: a draft (it did not exit) or the target,
        with its log-probabilities if the request asks for them (plain decoding's: the exit
        coda's)."""
        pos: SpecPosition = live.spec
        if error is not None:
            pos.error = error
            return
        if pos.exit_loops:
            pos.token = token
            pos.logprobs = logprobs
            if pos.draft_token < 0:  # exited while drafting: exact, fed on as it is
                pos.draft_token = token
            else:
                pos.target_logits = logits
                pos.raw_logits = raw_logits
        else:
            pos.draft_token = token
            pos.draft_logits = logits

    def settle(
        self, running: dict[int, SpecCycle], requests: Mapping[str, RowCursor]
    ) -> dict[int, RowResult]:
        """After the pass: moves each cycle on, decides what it can and returns each row's
        result."""
        results: dict[int, RowResult] = {}
        for index, cycle in running.items():
            cursor = requests[cycle.request_id]
            result = RowResult(row_index=index)
            results[index] = result
            failed = next((p.error for p in cycle.positions if p.error is not None), None)
            if failed is None:
                failed = self._advance_draft(cycle)
            if failed is None:
                ended, failed = self._decide(cycle, cursor.sampling, result)  # type: ignore[attr-defined]
            if failed is not None:
                result.error = failed
                self.drop(cycle.request_id)
                cursor.next_decode = None
                continue
            if ended:
                self._end(cycle, cursor, result)
            else:
                result.cycle_open = True
        return results

    def _advance_draft(self, cycle: SpecCycle) -> str | None:
        """A drafted position that exited or reached the draft depth hands its token to the
        next position (a new pool row, and its mask: the grammar advanced by the token);
        the last one ends the drafting. Returns why the cycle fails, if it does."""
        if cycle.drafting > cycle.k:
            return None
        pos = cycle.positions[cycle.drafting]
        if not pos.exit_loops and pos.depth < cycle.d:
            return None
        cycle.drafting += 1
        if cycle.drafting > cycle.k:
            return None
        nxt = SpecPosition(
            cycle.drafting, pos.position + 1, pos.output_index + 1, pos.draft_token, -1
        )
        if cycle.grammar is not None:
            problem = cycle.grammar.speculate(pos.draft_token)
            if problem is not None:
                return problem
            nxt.mask = cycle.grammar.position_mask()
        nxt.pool_slot = self._allocate()
        cycle.extra_slots.append(nxt.pool_slot)
        cycle.positions.append(nxt)
        return None

    def _decide(
        self, cycle: SpecCycle, sampling: WorkerSampling, result: RowResult
    ) -> tuple[bool, str | None]:
        """Commits the positions whose token is known, in order: (whether the cycle ends: a
        rejected draft, or the bonus position decided; why it fails, if a committed token
        does not follow the request's structured output)."""
        while cycle.decided < len(cycle.positions):
            pos = cycle.positions[cycle.decided]
            if not pos.exit_loops:
                return False, None
            token = pos.token
            if (
                sampling.temperature != 0.0
                and pos.draft_logits is not None
                and pos.target_logits is not None
            ):
                token = accept_or_resample(
                    pos.target_logits,
                    pos.draft_logits,
                    pos.draft_token,
                    temperature=sampling.temperature,
                    top_k=sampling.top_k,
                    top_p=sampling.top_p,
                    seed=sampling.seed,
                    output_index=pos.output_index,
                )
            if cycle.grammar is not None:
                problem = cycle.grammar.commit(token, pos.output_index)
                if problem is not None:
                    return True, problem
            result.token_ids.append(token)
            result.token_exit_loops.append(pos.exit_loops)
            if pos.logprobs is not None:
                result.token_logprobs.append(self._logprobs_of(pos, token))
            cycle.decided += 1
            if pos.index == cycle.k or token != pos.draft_token:
                return True, None
        return False, None

    def _end(self, cycle: SpecCycle, cursor: RowCursor, result: RowResult) -> None:
        last = cycle.positions[cycle.decided - 1]
        result.drafted = min(cycle.drafting, cycle.k)  # a rejection may end it while drafting
        result.accepted = cycle.decided - 1
        cursor.next_decode = BatchRow(
            request_id=cycle.request_id,
            kind=RowKind.DECODE,
            token_start=last.position + 1,
            token_count=1,
            depth=0,
            embed=True,
            input_token_id=result.token_ids[-1],
            compute_logits=True,
            output_index=last.output_index + 1,
        )
        self.drop(cycle.request_id)

    def _logprobs_of(self, pos: SpecPosition, token: int) -> SampledLogprobs:
        """The committed token's log-probabilities: the exit coda's, whose chosen entry is
        the coda's own token; the rejection rule may commit another, scored from the raw
        logits."""
        lp = pos.logprobs
        assert lp is not None
        if token == pos.token:
            return lp
        # kept for every sampled verified position of a request that asks logprobs
        assert pos.raw_logits is not None and self._score is not None
        return SampledLogprobs(
            logprob=self._score(pos.raw_logits, token),
            top_ids=lp.top_ids,
            top_logprobs=lp.top_logprobs,
        )
