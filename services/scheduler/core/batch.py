"""The scheduler's own view of a batch: tasks that point at live requests."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from messages.batch import Batch, BatchKind, RowKind
from services.scheduler.core.kv.kv_admission import Preemption
from services.scheduler.core.request import Request


class ScheduledTask(msgspec.Struct, gc=False, eq=False):
    """One row as the scheduler sees it. Never encoded: a Struct because one is built per
    row per step, and a Struct builds ~4x faster than a slotted dataclass.

    A FOLLOW_ON task's depth is not known when it is built (the worker resolves it; it is 0
    here) and its ``token_start`` is the furthest position it can reach."""

    request: Request
    kind: RowKind
    token_start: int
    token_count: int
    depth: int = 0
    num_loops: int = 1
    embed: bool = False
    compute_logits: bool = False
    forced_exit_loops: int = 0
    incarnation: int = 0  # the request's, when the task was built
    # decode and follow-on rows: the depth budget of a token this row starts, when shedding
    # lowered it (a follow-on's applies only if it resolves to a token's first loop)
    loop_budget: int | None = None
    # token-sparse prefill: a fragment of one window's sparse loop ([token_start, token_end)
    # is the whole window): its active rows of rank [active_start, active_start +
    # active_count) of the window's ``window_active``; 0 for every other task
    active_start: int = 0
    active_count: int = 0
    window_active: int = 0

    @property
    def token_end(self) -> int:
        return self.token_start + self.token_count

    @property
    def is_fragment(self) -> bool:
        return self.window_active > 0

    @property
    def budget_rows(self) -> int:
        """What the task charges against ``max_num_batched_tokens``: its tokens, or a sparse
        fragment's active rows."""
        return self.active_count if self.window_active else self.token_count

    @property
    def core_rows(self) -> int:
        """Hidden-state rows the task's loops compute (token x loop)."""
        return self.active_count if self.window_active else self.token_count * self.num_loops

    def key(self) -> tuple[str, int, int, int]:
        """(request_id, token_start, token_count, depth) as traces and tests print it."""
        return (self.request.request_id, self.token_start, self.token_count, self.depth)


@dataclass(eq=False)
class ScheduledBatch:
    seq: int
    kind: BatchKind
    tasks: list[ScheduledTask]
    wire: Batch
    submitted: bool = False
    progress_applied: bool = False
    outputs_applied: bool = False
    # requests preempted while this batch was selected (or since the last batch)
    preemptions: list[Preemption] = field(default_factory=list)
    # the depth budget new decode tokens started under in this batch (depth_budget.py)
    depth_budget: int = 0

    def rows(self) -> list[tuple[str, int, int, int]]:
        return [t.key() for t in self.tasks]
