"""Self-speculative decoding on the scheduler's side (docs/speculative.md): which requests
send SPECULATIVE rows, how many draft tokens a row asks for (fixed, or chosen per step by
``DraftLength`` under ``auto``), what such a row is charged, and how its committed tokens
and acceptance are taken in.

The cycle itself runs on the worker; the scheduler bounds it (KV, budget) and applies what
it committed through the same token path as plain decoding.
"""

from __future__ import annotations

from collections.abc import Callable

from messages.batch import RowKind, RowResult
from services.common.config import KVLayout
from services.scheduler.core.batch import ScheduledTask
from services.scheduler.core.request import Request, RequestState
from services.scheduler.core.state import SchedulerState

_SPECULATIVE = RowKind.SPECULATIVE
_DECODING = RequestState.RECURRENT

# draft lengths ``auto`` chooses from (0: plain decoding for that row's cycle)
AUTO_CHOICES = (0, 1, 2, 3, 4, 6, 8)
# rows per core pass at which a pass stops being bound by reading the weights: an H100's
# dense bf16 FLOP/s over its HBM bytes/s (990e12 / 3.35e12), for 2-byte weights and 2 FLOPs
# per weight per row
SATURATION_ROWS = 295
# ``auto`` speculates only where the model says it gains at least this much
AUTO_MARGIN = 1.05


class ExitDepths:
    """The running share of committed tokens exiting after 1..D loops (old tokens weigh
    less; before any, every token runs all D loops), and how long a cycle runs under it."""

    WEIGHT = 0.02  # a new token's weight

    def __init__(self, total_loops: int) -> None:
        self.total_loops = total_loops
        self.share = [0.0] * total_loops
        self.share[-1] = 1.0

    def observe(self, loops: int) -> None:
        keep = 1.0 - self.WEIGHT
        self.share = [s * keep for s in self.share]
        self.share[min(max(loops, 1), self.total_loops) - 1] += self.WEIGHT

    @property
    def mean(self) -> float:
        return sum(e * s for e, s in enumerate(self.share, start=1))

    def draft_passes(self, d: int) -> float:
        """Expected passes one position drafts for: until its exit or loop d."""
        return sum(min(e, d) * s for e, s in enumerate(self.share, start=1))

    def decided_after(self, d: int, n: int) -> float:
        """Expected passes until a cycle's first ``n`` positions are all decided. Position i
        starts once its predecessor drafted (i steps of ``draft_passes`` in) and runs a loop
        per pass until its exit e_i: T = max over i < n of (i step + e_i), and P(T <= t) is
        the product over i of F(t - i step), F the exits' distribution."""
        step = self.draft_passes(d)
        exits = [e for e, s in enumerate(self.share, start=1) if s > 0]
        expected = below = 0.0
        for t in sorted({i * step + e for i in range(n) for e in exits}):
            p = 1.0
            for i in range(n):
                p *= sum(s for e, s in enumerate(self.share, start=1) if e <= t - i * step + 1e-9)
            expected += t * (p - below)
            below = p
        return expected


class DraftLength:
    """``auto``'s K per step: the K that maximises modelled decode throughput from the
    running per-position acceptance rate, the running exit depths and the batch's rows.

    Model: each draft is accepted with probability a (independently), so a cycle of K
    drafts commits (1 - a^(K+1)) / (1 - a) tokens. It ends once the positions up to its
    first rejected draft (or all K + 1) are decided (``ExitDepths.decided_after``): each
    position starts when its predecessor has drafted and runs to its exit beside the
    later ones. A pass of r rows costs max(1, r / SATURATION_ROWS). Plain decoding: L
    passes of one row per token (L: the mean exit depth)."""

    PRIOR_ACCEPTANCE = 0.6
    PRIOR_WEIGHT = 8.0
    DECAY = 0.995  # old cycles weigh less; with no cycles the estimate drifts to the prior
    REFRESH = 32  # exits observed before a cycle's modelled length is worked out again

    def __init__(self, max_k: int, draft_loops: int, total_loops: int) -> None:
        self.max_k = max_k
        self.d = draft_loops
        self.total_loops = total_loops
        self._accepted = self.PRIOR_ACCEPTANCE * self.PRIOR_WEIGHT
        self._trials = self.PRIOR_WEIGHT
        self.exits = ExitDepths(total_loops)
        self._lengths: list[float] = []  # entry n - 1: passes until n positions are decided
        self._since_refresh = 0

    @property
    def acceptance(self) -> float:
        return self._accepted / self._trials

    def observe_cycle(self, drafted: int, accepted: int) -> None:
        """A cycle accepted ``accepted`` of ``drafted``: that many successes, and one failure
        unless all were accepted."""
        self._accepted = self._accepted * self.DECAY + accepted
        self._trials = self._trials * self.DECAY + accepted + (1 if accepted < drafted else 0)

    def observe_exit(self, loops: int) -> None:
        self.exits.observe(loops)
        self._since_refresh += 1

    def idle(self) -> None:
        """A step without cycles: the estimate drifts back to the prior (so a phase of poor
        acceptance does not turn speculation off for good)."""
        w = self.PRIOR_WEIGHT * (1 - self.DECAY)
        self._accepted = self._accepted * self.DECAY + self.PRIOR_ACCEPTANCE * w
        self._trials = self._trials * self.DECAY + w

    def _cycle_lengths(self) -> list[float]:
        if not self._lengths or self._since_refresh >= self.REFRESH:
            top = max(AUTO_CHOICES) + 1
            self._lengths = [self.exits.decided_after(self.d, n) for n in range(1, top + 1)]
            self._since_refresh = 0
        return self._lengths

    def cycle_rate(self, k: int, batch: int) -> float:
        """Modelled tokens per unit of device time of a cycle of ``k`` drafts."""
        a = min(self.acceptance, 0.999)
        loops = max(1.0, self.exits.mean)
        step = self.exits.draft_passes(self.d)
        lengths = self._cycle_lengths()
        # the cycle decides positions 0..i: i the first rejected draft, or k
        decided = [a**i * (1 - a) for i in range(k)] + [a**k]
        tokens = (1 - a ** (k + 1)) / (1 - a)
        passes = sum(p * lengths[i] for i, p in enumerate(decided))
        # rows: each position that starts before the cycle ends runs to its exit or the end
        rows = sum(min(loops, max(0.0, passes - i * step)) for i in range(k + 1))
        return (tokens / passes) / max(1.0, batch * rows / (passes * SATURATION_ROWS))

    def plain_rate(self, batch: int) -> float:
        return (1.0 / max(1.0, self.exits.mean)) / max(1.0, batch / SATURATION_ROWS)

    def choose(self, batch: int) -> int:
        best, best_k = self.plain_rate(batch) * AUTO_MARGIN, 0
        for k in AUTO_CHOICES:
            if k == 0 or k > self.max_k:
                continue
            rate = self.cycle_rate(k, batch)
            if rate > best:
                best, best_k = rate, k
        return best_k


class Speculator:
    """Builds SPECULATIVE tasks and applies their results."""

    def __init__(self, state: SchedulerState) -> None:
        self._state = state
        config = state.config
        self.max_k = config.speculative_tokens
        self.d = config.draft_loops
        # the shared KV layout keeps one version of a token's K/V, its final one, which a
        # later position reads: while a cycle drafts and verifies, the version there is not
        # final yet, so drafts would read what plain decoding never does. Off for it.
        # fp8 and int4-delta run it: a rejected draft's K/V is rewritten before anything
        # reads it (int4-delta keeps the blocks a cycle may write again open to that,
        # services/worker/kv_int4/book.py).
        self.enabled = self.max_k > 0 and config.kv_layout is KVLayout.LAST_EXITED
        if self.enabled and self.d >= state.total_ut_steps:
            raise ValueError(
                f"draft_loops ({self.d}) must be below the model's total_ut_steps "
                f"({state.total_ut_steps})"
            )
        self.auto = DraftLength(self.max_k, self.d, state.total_ut_steps)
        self._auto = config.speculative_auto
        self._step_k = self.max_k
        self._sampled_k = min(self.max_k, config.max_num_batched_tokens - 1)

    def start_step(self) -> None:
        """Once per batch: ``auto`` picks this step's K from the decoding batch's size."""
        if not self.enabled or not self._auto:
            return
        decoding = sum(1 for r in self._state.running if r.state is _DECODING)
        self._step_k = self.auto.choose(max(1, decoding))
        if self._step_k == 0:
            self.auto.idle()

    def applies(self, request: Request) -> bool:
        """Whether the request's next decode row is a SPECULATIVE one. Off for what the
        cycle does not carry yet (a shed depth budget, replayed exits); a request switches
        only at a token boundary with no plain row in flight, and, once it speculates, stays
        so (a K of 0 is plain decoding)."""
        if request.speculating:
            return True
        if not self.enabled:
            return False
        params = request.params
        if not params.speculative or request.hand_off:
            return False
        if request.pending_decode_loops or request.decode_depth:
            return False  # mid-token, or a plain decode row's result is still to come
        if request.forced_exit_loops_at(request.num_computed_tokens):
            return False  # replaying recorded exits
        return self._state.depth_budget >= self._state.total_ut_steps

    def task(
        self,
        request: Request,
        budget_left: int,
        ensure: Callable[[Request, int], bool],
    ) -> ScheduledTask | None:
        """The request's SPECULATIVE task, charged the most rows its pass can have, or None
        when the budget or KV cannot take it now."""
        # a sampled token depends on where cycles start (which positions draft): its K
        # depends on the request alone, never on the load (auto) or the budget left
        sampled = bool(request.params.temperature)
        k = self._sampled_k if sampled else min(self._step_k, budget_left - 1)
        if k < 0:
            return None
        bound = max([k, request.spec_open_k, *request.spec_inflight])
        charge = bound + 1
        if charge > budget_left:
            return None
        # furthest position: each row in flight may commit up to bound + 1 tokens, and the
        # next cycle drafts up to bound positions past its start (capped at the footprint:
        # the worker never drafts past max_tokens)
        reach = request.num_computed_tokens + (len(request.spec_inflight) + 1) * (bound + 1)
        if not ensure(request, min(reach, request.kv_footprint_tokens)):
            return None
        request.speculating = True
        self._state.spec_stats.num_spec_rows += 1
        # a new cycle starts from here if nothing of the request is in flight: the row says
        # where (else the worker continues its cycle, or starts one where the last ended)
        known = (
            not request.spec_inflight and request.spec_open_k < 0 and not request.pending_token_rows
        )
        return ScheduledTask(
            request=request,
            kind=_SPECULATIVE,
            token_start=request.num_computed_tokens,
            token_count=charge,
            depth=0,
            num_loops=1,
            embed=known,
            incarnation=request.incarnation,
            # the K a cycle started by this row drafts (carried in loop_budget's place:
            # speculation never runs under a shed budget)
            loop_budget=k,
        )

    def submitted(self, task: ScheduledTask) -> None:
        task.request.spec_inflight.append(_row_k(task))

    def apply(
        self,
        task: ScheduledTask,
        row: RowResult,
        append: Callable[[Request, RowResult, int], None],
    ) -> None:
        """A SPECULATIVE row's result: its committed tokens, one by one through ``append``
        (plain decoding's path, which finishes the request on a stop or max_tokens: the
        tokens after that are dropped), and the cycle's acceptance."""
        request = task.request
        k = request.spec_inflight.pop(0)
        request.spec_open_k = max(request.spec_open_k, k) if row.cycle_open else -1
        if not row.cycle_open and row.drafted:  # before the tokens: they may finish it
            request.num_draft_tokens += row.drafted
            request.num_accepted_draft_tokens += row.accepted
            self._state.spec_stats.record_cycle(row.drafted, row.accepted)
            self.auto.observe_cycle(row.drafted, row.accepted)
        scored = row.token_logprobs or [None] * len(row.token_ids)
        for token, loops, logprobs in zip(row.token_ids, row.token_exit_loops, scored, strict=True):
            if request.is_finished:
                break
            request.num_computed_tokens += 1
            self.auto.observe_exit(loops)
            one = RowResult(row_index=row.row_index, token_id=token, logprobs=logprobs)
            append(request, one, loops)


def _row_k(task: ScheduledTask) -> int:
    assert task.loop_budget is not None
    return task.loop_budget
