"""Token-sparse prefill on the worker (docs/sparse_prefill.md): which of a window's tokens a
sparse loop runs, the K/V its frozen tokens carry, and the scores the next sparse loop
chooses by.

The scheduler sends each sparse loop of a window as fragments of its active rows by rank
(``BatchRow.fragment``); it knows how many tokens are active, never which. The worker
chooses them when the window's first fragment arrives, from the scores its earlier loops
left, and runs only them: each fragment becomes one-token prompt rows, through the same fused
ops as any prompt row, that form ONE attention segment (``LiveRow.joins_segment``): the
attention kernels see each row's own position and read the fragment's context once per query
tile, not once per active token. A frozen token
is not touched: its hidden row already holds its last loop's state, and its K/V at the
loop's plane is copied from the plane below (the copy the LAST_EXITED layout makes for a
decode token that exits early).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from messages.batch import BatchRow, RowKind
from services.common.sparse_prefill import SparseSchedule
from services.worker.passes.pass_plan import PassPlan, PassPlanner
from services.worker.passes.rows import LiveRow
from services.worker.passes.transfer import Transfer
from services.worker.passes.window_choice import choose_on_device


@dataclass
class SparseWindows:
    """One request's window state on the worker, its one owner: each prompt position's score
    for its next loop, and each window's active positions at the loop chosen last. It lives
    as long as the prompt's hidden rows (the runner drops both when the prompt's last
    position has run its last loop); a new incarnation of the request starts a new one, so
    an entry is keyed by (incarnation, absolute window start, loop)."""

    schedule: SparseSchedule
    prompt_len: int
    scores: torch.Tensor  # [P] float32: |h(l) - h(l-1)| / |h(l)| of each position's last loop
    # window start -> (loop, its active positions in order): the candidates of the next loop
    active: dict[int, tuple[int, np.ndarray]] = field(default_factory=dict)
    # window start -> how often its scores were written: a choice made ahead is good only
    # if none were written since
    versions: dict[int, int] = field(default_factory=dict)
    # window start -> its next loop's active tokens, chosen on the device ahead of time
    ahead: dict[int, ChosenAhead] = field(default_factory=dict)

    @classmethod
    def new(cls, schedule: SparseSchedule, prompt_len: int, device: torch.device) -> SparseWindows:
        return cls(
            schedule, prompt_len, torch.zeros(prompt_len, dtype=torch.float32, device=device)
        )


@dataclass(frozen=True)
class ChosenAhead:
    """A window's active tokens for ``loop``, chosen on the device after the batch that
    wrote its scores (``version``) and copied back without a wait: readable once the
    transfer has waited more than ``waits`` times."""

    loop: int
    version: int
    host: torch.Tensor  # the batch's choices, every window's
    at: int  # this window's, from here
    count: int
    waits: int


class SparseRequest(Protocol):
    """What this module reads of a request on the worker (``ModelRunner``'s request)."""

    tables: list[list[int]]  # one block table per plane
    sparse: SparseWindows | None


class WindowStateError(ValueError):
    """A fragment the worker has no window state for: the batch that should have chosen its
    active tokens failed (with async scheduling, later fragments were already sent), or the
    request is not token-sparse here. Only that request's row fails."""


def choose_active(candidates: np.ndarray, scores: np.ndarray, count: int, last: int) -> np.ndarray:
    """The ``count`` active positions among ``candidates`` (ascending): ``last`` (the prompt's
    last position) if it is one of them, then the highest scores, equal scores to the lower
    position. Returned ascending."""
    forced = candidates == last
    others, other_scores = candidates[~forced], scores[~forced]
    take = count - int(forced.sum())
    # lexsort's last key is the primary one: score descending, then position ascending
    order = np.lexsort((others, -other_scores))
    chosen = np.concatenate([others[order[:take]], candidates[forced]])
    return np.sort(chosen)


class SparseFragments:
    """Turns a batch's sparse fragments into the rows that run, and keeps the scores."""

    def __init__(
        self,
        planner: PassPlanner,
        transfer: Transfer,
        copy_slots: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None],
        total_loops: int,
        on_frozen: Callable[[str, SparseRequest, np.ndarray, int], None] | None = None,
    ) -> None:
        """``copy_slots(src, dst, mask)``: the KV storage's slot copy (codes and scales).
        ``on_frozen(request_id, request, positions, loop)``: told of each window's frozen
        tokens before their copy (int4-delta's storage records them and opens their
        blocks)."""
        self.planner = planner
        self.transfer = transfer
        self.copy_slots = copy_slots
        self.total_loops = total_loops
        self.on_frozen = on_frozen
        # windows whose scores this batch wrote, for the loop they feed
        self._touched: dict[tuple[int, int], tuple[SparseWindows, int, int]] = {}
        self.num_chosen_ahead = 0  # windows opened with a choice made ahead (no wait)
        self.num_chosen_waiting = 0  # windows whose choice waited for the device

    # ------------------------------------------------------------------ before the passes
    def expand(self, rows: list[LiveRow], requests: Mapping[str, SparseRequest]) -> list[LiveRow]:
        """``rows`` with every fragment replaced by the prompt rows of its active tokens
        (sharing the fragment's result). A window's first fragment chooses the loop's
        active tokens and copies the K/V of the frozen ones into the loop's plane first."""
        opening = [
            live
            for live in rows
            if live.row.fragment is not None and live.row.fragment.active_start == 0
        ]
        failed = self._open_windows(opening, requests) if opening else set()
        out: list[LiveRow] = []
        for live in rows:
            if live.row.fragment is None:
                out.append(live)
            elif live.index not in failed:
                try:
                    out += self._fragment_rows(live, self._windows(requests, live.row))
                except WindowStateError as exc:
                    live.result.error = str(exc)  # its request ends, the others go on
        return out

    def _windows(self, requests: Mapping[str, SparseRequest], row: BatchRow) -> SparseWindows:
        windows = requests[row.request_id].sparse
        if windows is None:
            raise WindowStateError(f"{row.request_id}: a sparse fragment for a dense request")
        return windows

    def _candidates(self, windows: SparseWindows, row: BatchRow) -> np.ndarray:
        """The window's tokens a loop may keep: those its previous loop kept."""
        start, loop = row.token_start, row.depth
        if not windows.schedule.is_sparse(loop - 1):
            return np.arange(start, start + row.token_count)
        previous = windows.active.get(start)
        if previous is None or previous[0] != loop - 1:
            raise WindowStateError(
                f"{row.request_id}: window {start} has no active tokens of loop {loop - 1}"
            )
        return previous[1]

    def _open_windows(
        self, opening: list[LiveRow], requests: Mapping[str, SparseRequest]
    ) -> set[int]:
        """Each opening window's active tokens (chosen ahead on the device, or else now,
        with one read of their candidates' scores), and every frozen token's K/V copied up
        one plane (one op). Returns the batch indices of the fragments that failed
        (``WindowStateError``), which do not run."""
        chosen: list[tuple[BatchRow, SparseWindows, np.ndarray]] = []
        pairs: list[np.ndarray] = []
        failed: set[int] = set()
        for live in opening:
            row = live.row
            try:
                windows = self._windows(requests, row)
                count = windows.schedule.active_count(row.depth, row.token_count)
                if row.fragment is None or count != row.fragment.window_active:
                    raise WindowStateError(
                        f"{row.request_id}: window {row.token_start} keeps {count} tokens at "
                        f"loop {row.depth}, the scheduler counted "
                        f"{None if row.fragment is None else row.fragment.window_active}"
                    )
                ahead = self._take_ahead(windows, row)
                if ahead is not None:
                    windows.active[row.token_start] = (row.depth, ahead)
                    pairs.append(self._frozen_pairs(requests[row.request_id], row, ahead))
                    continue
                chosen.append((row, windows, self._candidates(windows, row)))
            except WindowStateError as exc:
                live.result.error = str(exc)
                failed.add(live.index)
        if chosen:
            pairs += self._choose_waiting(chosen, requests)
        if pairs:
            self._copy_up(np.concatenate(pairs, axis=1))
        return failed

    def _take_ahead(self, windows: SparseWindows, row: BatchRow) -> np.ndarray | None:
        """The window's active tokens for this loop if chosen ahead from its final scores
        and back on the host (no wait); None: they are chosen now."""
        ahead = windows.ahead.pop(row.token_start, None)
        if (
            ahead is None
            or ahead.loop != row.depth
            or ahead.version != windows.versions.get(row.token_start)
            or self.transfer.counts.to_host <= ahead.waits
        ):
            return None
        self.num_chosen_ahead += 1
        return ahead.host[ahead.at : ahead.at + ahead.count].numpy().astype(np.int64)

    def _choose_waiting(
        self,
        chosen: list[tuple[BatchRow, SparseWindows, np.ndarray]],
        requests: Mapping[str, SparseRequest],
    ) -> list[np.ndarray]:
        """Windows without a choice made ahead: one read of their candidates' scores (a
        wait). Returns their frozen tokens' slot pairs."""
        self.num_chosen_waiting += len(chosen)
        total = sum(c.size for _, _, c in chosen)
        words = self.transfer.host_words(total)
        words[:] = np.concatenate([c for _, _, c in chosen])
        index = self.transfer.to_device(words).long()
        gathers, at = [], 0
        for _, windows, candidates in chosen:
            gathers.append(windows.scores.index_select(0, index[at : at + candidates.size]))
            at += candidates.size
        scores = self.transfer.to_host(torch.cat(gathers)).numpy()
        pairs: list[np.ndarray] = []
        at = 0
        for row, windows, candidates in chosen:
            count = windows.schedule.active_count(row.depth, row.token_count)
            active = choose_active(
                candidates, scores[at : at + candidates.size], count, windows.prompt_len - 1
            )
            at += candidates.size
            windows.active[row.token_start] = (row.depth, active)
            pairs.append(self._frozen_pairs(requests[row.request_id], row, active))
        return pairs

    def _frozen_pairs(self, req: SparseRequest, row: BatchRow, active: np.ndarray) -> np.ndarray:
        """[2, F] (plane l-1 slot, plane l slot) of the window's frozen tokens."""
        window = np.arange(row.token_start, row.token_start + row.token_count)
        frozen = np.setdiff1d(window, active, assume_unique=True)
        if self.on_frozen is not None and frozen.size:
            self.on_frozen(row.request_id, req, frozen, row.depth)
        bs = self.planner.block_size
        below = np.asarray(req.tables[self.planner.plane(row.depth - 1)], dtype=np.int64)
        here = np.asarray(req.tables[self.planner.plane(row.depth)], dtype=np.int64)
        blocks, offsets = frozen // bs, frozen % bs
        return np.stack([below[blocks] * bs + offsets, here[blocks] * bs + offsets])

    def _copy_up(self, pairs: np.ndarray) -> None:
        count = pairs.shape[1]
        if count == 0:
            return
        words = self.transfer.host_words(2 * count)
        words[:] = pairs.reshape(-1)
        slots = self.transfer.to_device(words)
        keep = torch.ones(count, dtype=torch.bool, device=slots.device)
        self.copy_slots(slots[:count], slots[count:], keep)

    def _fragment_rows(self, live: LiveRow, windows: SparseWindows) -> list[LiveRow]:
        """The fragment's active tokens as one live row of one-token pass rows at their
        positions (``LiveRow.positions``, ascending: each sees keys up to its own position),
        one attention segment, with the fragment's result. It asks for logits only when
        it holds the prompt's last position (its last row)."""
        row = live.row
        fragment = row.fragment
        assert fragment is not None
        chosen = windows.active.get(row.token_start)
        if chosen is None or chosen[0] != row.depth:
            raise WindowStateError(
                f"{row.request_id}: window {row.token_start} has no active tokens of loop "
                f"{row.depth}"
            )
        positions = chosen[1][fragment.active_start : fragment.active_end]
        if fragment.active_end == fragment.window_active and row.depth == self.total_loops - 1:
            del windows.active[row.token_start]  # its last reader
        if positions.size == 0:
            return []
        last = int(positions[-1])
        part = BatchRow(
            request_id=row.request_id,
            kind=RowKind.PREFILL,
            token_start=int(positions[0]),
            token_count=int(positions.size),
            depth=row.depth,
            num_loops=1,
            compute_logits=row.compute_logits and last == windows.prompt_len - 1,
            output_index=row.output_index,
        )
        out = LiveRow(live.index, part, row.depth, 1)
        out.positions = positions
        out.result = live.result
        return [out]

    # ------------------------------------------------------------------ after a pass
    def record_scores(
        self,
        plan: PassPlan,
        inputs: torch.Tensor,
        outputs: torch.Tensor,
        requests: Mapping[str, SparseRequest],
    ) -> None:
        """Scores of the prompt rows whose next loop is sparse: the relative change of each
        token's state over the loop that just ran, in float32."""
        # per request and loop fed: its pass rows and the positions their scores go to
        targets: dict[tuple[int, int], tuple[SparseWindows, list[np.ndarray], list[np.ndarray]]]
        targets = {}
        for offset, live in zip(plan.row_offsets, plan.rows, strict=True):
            if live.is_decode:
                continue
            windows = requests[live.row.request_id].sparse
            following = live.depth + 1
            if windows is None or following >= self.total_loops:
                continue
            if not windows.schedule.is_sparse(following):
                continue
            start, count = live.row.token_start, live.row.token_count
            key = (id(windows), following)
            _, rows, positions = targets.setdefault(key, (windows, [], []))
            rows.append(np.arange(offset, offset + count))
            at = live.positions
            positions.append(np.arange(start, start + count) if at is None else at)
        if not targets:
            return
        rows_all = np.concatenate([r for _, rows, _ in targets.values() for r in rows])
        num = rows_all.size
        words = self.transfer.host_words(2 * num)  # one copy: rows, then positions
        words[:num] = rows_all
        words[num:] = np.concatenate([p for _, _, positions in targets.values() for p in positions])
        index = self.transfer.to_device(words).long()
        new = outputs.index_select(0, index[:num]).float()
        old = inputs.index_select(0, index[:num]).float()
        score = torch.linalg.vector_norm(new - old, dim=-1) / torch.linalg.vector_norm(
            new, dim=-1
        ).clamp_min(1e-12)
        at = 0
        for windows, rows, _ in targets.values():
            end = at + sum(r.size for r in rows)
            windows.scores.index_put_((index[num + at : num + end],), score[at:end])
            at = end
        for (_, following), (windows, _, positions) in targets.items():
            width = windows.schedule.window
            for start in np.unique(np.concatenate(positions) // width * width).tolist():
                windows.versions[start] = windows.versions.get(start, 0) + 1
                self._touched[(id(windows), start)] = (windows, start, following)

    def choose_ahead(self) -> None:
        """At the end of a batch, before its results are read: the active tokens of every
        window whose scores it wrote, for the loop they feed, chosen on the device and
        copied back without a wait of their own (the results' read waits for them). The
        window's opening uses them if no score of it was written since, so the batch that
        opens it waits only for its results (a choice made before the window's last scores
        is made again after them)."""
        touched, self._touched = self._touched, {}
        entries: list[tuple[SparseWindows, int, int, np.ndarray, int]] = []
        for windows, start, loop in touched.values():
            end = min(start + windows.schedule.window, windows.prompt_len)
            if windows.schedule.is_sparse(loop - 1):
                previous = windows.active.get(start)
                if previous is None or previous[0] != loop - 1:
                    continue  # its loop's choice is still to come: nothing to choose from
                candidates = previous[1]
            else:
                candidates = np.arange(start, end)
            count = windows.schedule.active_count(loop, end - start)
            entries.append((windows, start, loop, candidates, count))
        if not entries:
            return
        sizes = np.array([e[3].size for e in entries], dtype=np.int64)
        n, w = int(sizes.sum()), len(entries)
        words = self.transfer.host_words(2 * n + 3 * w)
        words[:n] = np.concatenate([e[3] for e in entries])
        words[n : 2 * n] = np.repeat(np.arange(w), sizes)
        words[2 * n : 2 * n + w] = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        words[2 * n + w : 2 * n + 2 * w] = [e[4] for e in entries]
        words[2 * n + 2 * w :] = [
            windows.prompt_len - 1 if start + windows.schedule.window >= windows.prompt_len
            else -1
            for windows, start, _, _, _ in entries
        ]  # fmt: skip
        device = self.transfer.to_device(words).long()
        candidates = device[:n]
        scores, at = [], 0
        for windows, _, _, c, _ in entries:
            scores.append(windows.scores.index_select(0, candidates[at : at + c.size]))
            at += c.size
        counts = [e[4] for e in entries]
        chosen = choose_on_device(
            candidates,
            device[n : 2 * n],
            device[2 * n : 2 * n + w],
            torch.cat(scores),
            device[2 * n + w : 2 * n + 2 * w],
            device[2 * n + 2 * w :],
            total=sum(counts),
            span=max(windows.prompt_len for windows, *_ in entries) + 1,
        )
        host, waits = self.transfer.readback(chosen.int())
        at = 0
        for windows, start, loop, _, count in entries:
            version = windows.versions[start]
            windows.ahead[start] = ChosenAhead(loop, version, host, at, count, waits)
            at += count
