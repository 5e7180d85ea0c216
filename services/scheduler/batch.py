"""The scheduler's own view of a batch: tasks that point at live requests."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

import msgspec

from messages.batch import Batch, BatchPhase
from services.scheduler.kv_admission import Preemption
from services.scheduler.request import Request

# the depth a follow-on row shows in traces: it is known only from the results before it
FOLLOW_ON_DEPTH = -1


class TaskKind(StrEnum):
    PRELUDE = "prelude"  # split prefill: embedding of a prompt span
    PREFILL = "prefill"  # prefill recurrent work (split depth task or atomic chunk)
    DECODE = "decode"  # one loop of one generated token


class ScheduledTask(msgspec.Struct, eq=False):
    """One row as the scheduler sees it. Never encoded: a Struct because one is built per
    row per step, and a Struct builds ~4x faster than a slotted dataclass."""

    request: Request
    kind: TaskKind
    token_start: int
    token_count: int
    depth: int = 0
    num_loops: int = 1
    embed: bool = False
    compute_logits: bool = False
    forced_exit: int = 0
    generation: int = 0
    # a follow-on decode row (async): the worker resolves its position and depth, so
    # ``depth`` is FOLLOW_ON_DEPTH and ``token_start`` the furthest position it can reach
    follows: bool = False

    @property
    def token_end(self) -> int:
        return self.token_start + self.token_count

    def key(self) -> tuple[str, int, int, int]:
        """(request_id, token_start, token_count, depth) as traces and tests print it."""
        return (self.request.request_id, self.token_start, self.token_count, self.depth)


@dataclass(eq=False)
class ScheduledBatch:
    seq: int
    phase: BatchPhase
    tasks: list[ScheduledTask]
    wire: Batch
    progress_applied: bool = False
    outputs_applied: bool = False
    # requests preempted while this batch was selected (or since the last batch)
    preemptions: list[Preemption] = field(default_factory=list)

    def rows(self) -> list[tuple[str, int, int, int]]:
        return [t.key() for t in self.tasks]
