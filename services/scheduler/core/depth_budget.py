"""Depth shedding under overload (``--overload-policy shed-depth``): the depth budget a new
decode token runs under, and the queue pressure that moves it.

A looped model can trade quality for throughput per token, which a dense model cannot: a
token capped at B of D loops costs B/D of the core passes, and a decode pass costs about the
same whatever the budget (one row per running request). When the waiting queue stays long,
the budget drops one loop at a time (never below ``shed_min_loops``, nor below a request's
own ``min_loops``); when the queue is empty and the running set would still fit its seats
at one loop more, it rises one loop at a time.

Hysteresis: between those two conditions the budget holds, and each change needs its
condition to hold for a run of consecutive steps (a shed dwell, a longer restore dwell),
counted afresh after every change. A load between the capacities at budgets B and B+1
therefore settles at B instead of flipping between them: at B+1 the running set would not
fit its seats, so the restore condition never holds.

Pure: no clock, no I/O. ``update`` runs in every ``schedule()``, after admission, and counts
once per batch built (a ``schedule()`` that builds none, while rows are in flight, leaves the
dwell where it was, however often the engine asks); selection
asks ``token_budget`` when a decode token starts, and every later loop of that token keeps
the budget it started with (``Request.token_loop_budget``), so each token equals the serial
oracle run with its own budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import OverloadPolicy
from services.scheduler.core.request import Request
from services.scheduler.core.state import SchedulerState

# Steps a condition must hold before the budget moves one loop. Shedding reacts within a
# few tokens' worth of passes; restoring waits about a request's lifetime (of the bench's
# short answers), since a premature restore lets the queue grow again and a lull of a
# Poisson load is shorter than that. docs/benchmarks/overload.md runs with these.
SHED_DWELL_STEPS = 16
RESTORE_DWELL_STEPS = 128
# restore only if the running set, staying (budget + 1) / budget times longer, would still
# leave a tenth of the seats free: fuller than that, the queue would form again
RESTORE_OCCUPANCY = 0.9


@dataclass(frozen=True)
class BudgetChange:
    """One move of the depth budget, for the log line the engine writes."""

    batch_seq: int  # the first batch built under the new budget
    old: int
    new: int
    waiting: int
    running: int


class DepthBudget:
    """Owns ``SchedulerState.depth_budget`` (its only writer)."""

    def __init__(self, state: SchedulerState) -> None:
        config = state.config
        self._state = state
        self.enabled = config.overload_policy is OverloadPolicy.SHED_DEPTH
        self.full = state.total_ut_steps
        self.floor = max(1, min(config.shed_min_loops, self.full))
        self._high = config.shed_queue_high
        self._seats = config.max_num_seqs
        self._pressure_steps = 0
        self._relief_steps = 0
        self._changes: list[BudgetChange] = []
        self._looked_at_seq: int | None = None  # the batch seq the last counted look was for

    def update(self) -> None:
        """One step's look at the queue (after admission: who is left could not start)."""
        if not self.enabled:
            return
        state = self._state
        budget = state.depth_budget
        running = len(state.running)
        if not running and all(r.is_finished for _, r in state.waiting):
            # an empty engine has nobody to protect: the next arrival starts at full depth
            # (whether or not a batch was built since the last look)
            self._pressure_steps = self._relief_steps = 0
            if budget < self.full:
                self._set(self.full, 0, 0)
            return
        if state.next_seq == self._looked_at_seq:
            return  # no batch was built since the last look: one count per step
        self._looked_at_seq = state.next_seq
        waiting = sum(1 for _, r in state.waiting if not r.is_finished)
        if waiting and waiting >= self._high * max(1, running):
            self._relief_steps = 0
            self._pressure_steps += 1
            if self._pressure_steps >= SHED_DWELL_STEPS and budget > self.floor:
                self._set(budget - 1, waiting, running)
        elif (
            not waiting
            and budget < self.full
            and running * (budget + 1) <= RESTORE_OCCUPANCY * self._seats * budget
        ):
            self._pressure_steps = 0
            self._relief_steps += 1
            if self._relief_steps >= RESTORE_DWELL_STEPS:
                self._set(budget + 1, waiting, running)
        else:  # the band between the two: hold, and start both counts again
            self._pressure_steps = self._relief_steps = 0

    def take_changes(self) -> list[BudgetChange]:
        changes, self._changes = self._changes, []
        return changes

    def _set(self, budget: int, waiting: int, running: int) -> None:
        state = self._state
        self._changes.append(
            BudgetChange(state.next_seq, state.depth_budget, budget, waiting, running)
        )
        state.depth_budget = budget
        self._pressure_steps = self._relief_steps = 0


def token_budget(request: Request, budget: int) -> int | None:
    """The most loops a token of ``request`` starting now may run, when shedding caps it
    below the request's own ``max_loops``; None when it runs as the request asked."""
    params = request.params
    max_loops = params.max_loops
    assert max_loops is not None  # resolved at add_request
    if budget >= max_loops or not params.shed_depth:
        return None
    capped = max(budget, params.min_loops)
    return capped if capped < max_loops else None
