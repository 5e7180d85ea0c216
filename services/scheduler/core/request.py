"""Per-request scheduling state: its state, prefill frontiers, decode cursor, outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from messages.api import TokenLogprobs
from messages.kv_transfer import KVHandoff
from messages.sampling import SamplingParams
from services.common.fit import kv_tokens
from services.common.sparse_prefill import SparseSchedule


class RequestState(StrEnum):
    """Where a request is in its life (``Request.state``); only the scheduler knows it.
    What a batch serves is a ``BatchKind`` and what one of its rows does a ``RowKind``
    (messages/batch.py): a RECURRENT batch carries the DECODE and FOLLOW_ON rows of
    RECURRENT requests and the PREFILL rows of PREFILLING_RECURRENT ones."""

    WAITING = "waiting"
    PREFILL = "prefill"  # atomic chunked prefill: prelude + every depth of a chunk in one task
    # split prefill: prelude spans still to embed (depth tasks may already run behind them)
    PREFILLING_PRELUDE = "prefilling_prelude"
    PREFILLING_RECURRENT = "prefilling_recurrent"  # split prefill: only depth tasks are left
    RECURRENT = "recurrent"  # decoding
    # disaggregation: its prompt KV is being pulled from a prefill worker (no rows run)
    RECEIVING_KV = "receiving_kv"
    FINISHED = "finished"


# read per row per step: an Enum class attribute costs ~75 ns a lookup on Python 3.11
_FINISHED = RequestState.FINISHED

PREFILL_STATES = (
    RequestState.PREFILL,
    RequestState.PREFILLING_PRELUDE,
    RequestState.PREFILLING_RECURRENT,
)


@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # resolved: max_loops is set
    seed: int
    arrival_seq: int
    total_ut_steps: int
    trace_id: str = ""
    state: RequestState = RequestState.WAITING
    # 0, then +1 at each preemption (or worker loss): rows carry the incarnation they were
    # built for, so results of batches sent before a preemption are ignored
    incarnation: int = 0

    output_token_ids: list[int] = field(default_factory=list)
    output_exit_loops: list[int] = field(default_factory=list)
    # overload shedding: each output token's depth budget (the most loops it could run)
    # where shedding lowered it below params.max_loops; None where it did not
    output_loop_budgets: list[int | None] = field(default_factory=list)
    finish_reason: str | None = None
    # asked for prompt logprobs and not sent yet: one slot per prompt token, filled in by
    # position as final-depth prefill rows come back (sent with the first token). While
    # set, the request claims no cached prefix: every prompt position must be computed
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    # disaggregation: leave for a decode shard once the first token is out (prefill role);
    # the prefill worker's blocks to pull the prompt's KV from instead of computing it
    hand_off: bool = False
    kv_source: KVHandoff | None = None

    # prefill (split / wavefront): prelude frontier and one [origin, right_d) per depth
    prefill_window_origin: int = 0
    num_preluded_tokens: int = 0
    prefill_depth_ranges: list[tuple[int, int]] = field(default_factory=list)
    prefill_reclaimable_tokens: int = 0
    num_cached_tokens: int = 0
    # token-sparse prefill (None: dense): the schedule, and per sparse depth how many active
    # rows of the window at that depth's frontier have been run (the frontier itself moves
    # over the whole window with its last fragment); written by progress alone
    sparse: SparseSchedule | None = None
    sparse_rows_done: list[int] = field(default_factory=list)
    # hidden-state rows the prompt's loops computed (recomputes included): the prompt's core
    # work, token x loop, fewer than prompt x loops under token-sparse prefill
    num_prefill_rows: int = 0
    # prefix caching: chain hashes of the prompt's full blocks, and how many are published
    block_hashes: list[int] = field(default_factory=list)
    num_published_blocks: int = 0

    # preemption accounting: per depth, the furthest prompt frontier whose KV a preemption
    # dropped (empty until the first one), so recomputed prompt work can be counted
    prefill_high_water: list[int] = field(default_factory=list)

    # decode: next position to compute, its loop cursor and survival so far
    num_computed_tokens: int = 0
    decode_depth: int = 0
    decode_remaining: float = 1.0
    # the depth budget of the token being decoded when shedding lowered it (None: the
    # request's own max_loops), fixed when its first loop ran
    token_loop_budget: int | None = None
    # decode rows and the prompt's coda row in flight: until their results are applied the
    # scheduler does not know the next position and depth (the worker does)
    pending_token_rows: int = 0
    pending_decode_loops: int = 0
    inflight_batches: int = 0

    # fixed at creation; plain attributes because the selection loop reads them per row
    num_prompt_tokens: int = field(init=False)
    priority_key: tuple[int, int] = field(init=False)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.priority_key = (self.params.priority, self.arrival_seq)

    # ------------------------------------------------------------------ derived views

    @property
    def awaiting_output(self) -> bool:
        return self.pending_token_rows > 0

    @property
    def is_finished(self) -> bool:
        return self.state is _FINISHED

    @property
    def kv_footprint_tokens(self) -> int:
        """Positions whose KV the request may write."""
        return kv_tokens(self.num_prompt_tokens, self.params.max_tokens)

    @property
    def num_shed_tokens(self) -> int:
        """Output tokens that ran under a depth budget shedding lowered."""
        return sum(1 for b in self.output_loop_budgets if b is not None)

    def shed_depth_budgets(self) -> list[int | None]:
        """``output_loop_budgets`` as the wire sends them: empty when none was lowered."""
        return list(self.output_loop_budgets) if self.num_shed_tokens else []

    def prefill_right(self, depth: int) -> int:
        """Right end of depth ``depth``'s frontier (0-based depth)."""
        return self.prefill_depth_ranges[depth][1]

    def ready_end(self, depth: int) -> int:
        """How far depth ``depth`` may run: what the level above it has done (the prelude
        frontier for depth 0, else depth - 1's frontier)."""
        if depth == 0:
            return self.num_preluded_tokens
        return self.prefill_depth_ranges[depth - 1][1]

    def token_at(self, position: int) -> int:
        if position < self.num_prompt_tokens:
            return self.prompt_token_ids[position]
        return self.output_token_ids[position - self.num_prompt_tokens]

    def forced_exit_loops_at(self, position: int) -> int:
        """Recorded exit (a loop count) of the token fed at ``position``; 0 = decide by the
        policy. Feeding output i at position P+i produced output i+1, so a position whose
        output is already known replays that token's recorded exit."""
        index = position - self.num_prompt_tokens + 1
        if index < len(self.output_token_ids):
            return self.output_exit_loops[index]
        return 0

    def note_dropped_prefill(self) -> None:
        """Before a preemption reset: remembers how far each depth's prompt KV had got."""
        rights = [right for _, right in self.prefill_depth_ranges]
        if self.prefill_high_water:
            rights = [max(a, b) for a, b in zip(rights, self.prefill_high_water, strict=True)]
        self.prefill_high_water = rights

    def recomputed_prompt_work(self, depth: int, loops: int, start: int, end: int) -> int:
        """Token-loops of the prompt task [start, end) at depths depth..depth+loops-1 that a
        preemption had already computed once (0 for a request never preempted)."""
        high = self.prefill_high_water
        if not high:
            return 0
        return sum(max(0, min(end, high[d]) - start) for d in range(depth, depth + loops))

    def reset_prefill(self, origin: int) -> None:
        """Admission / preemption reset: the only writers of the frontiers besides progress."""
        self.prefill_window_origin = origin
        self.num_preluded_tokens = origin
        self.prefill_depth_ranges = [(origin, origin) for _ in range(self.total_ut_steps)]
        self.sparse_rows_done = [0] * self.total_ut_steps
        self.prefill_reclaimable_tokens = origin
        self.num_computed_tokens = origin
        self.decode_depth = 0
        self.decode_remaining = 1.0
        self.token_loop_budget = None
        self.pending_token_rows = 0
        self.pending_decode_loops = 0
