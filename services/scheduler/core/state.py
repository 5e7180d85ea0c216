"""What the scheduler's parts share: the request tables, the KV manager, the counters, and
what the next batch carries besides its rows.

The parts (``waiting.py``, ``selection.py``, ``batch_builder.py``, ``progress.py``) each hold
this one object rather than copies of its fields, because some fields are replaced whole
(the KV manager after a worker loss, the pending lists when a batch drains them). Requests
enter and leave ``running`` only through ``running.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from messages.kv_transfer import KVHandoff, KVPull
from services.common.config import ModelLimits, SchedulerConfig
from services.scheduler.core.kv.inflight_prefix import QueueEntry
from services.scheduler.core.kv.kv_admission import Commitment, Preemption
from services.scheduler.core.kv.kv_manager import KVManager
from services.scheduler.core.request import Request


@dataclass
class SchedulerStats:
    num_batches: int = 0
    num_preemptions: int = 0
    num_decode_rows: int = 0
    num_batches_with_mixed_depths: int = 0
    # generated tokens that ran under a depth budget shedding lowered (depth_budget.py)
    num_shed_tokens: int = 0
    # what preemption wastes: prompt positions prefilled again (counted at depth 0), the
    # same in core work (token x loop, the unit of a core pass's rows), and decode loops
    # replayed to rebuild dropped generated tokens
    num_recomputed_prompt_tokens: int = 0
    num_recomputed_prompt_token_loops: int = 0
    num_recomputed_decode_loops: int = 0
    # what reserve admission wastes: blocks reserved (whole footprints) and, of those, the
    # ones never written because the request stopped early (EOS, stop ids, abort)
    num_reserved_blocks: int = 0
    num_reserved_unused_blocks: int = 0
    # waiting requests parked on a prompt block a running prefill was writing
    # (share_inflight_prefill), once per block waited for
    num_prefix_deferrals: int = 0
    # requests admitted ahead of a waiting request the KV policy refused
    # (max_admission_bypasses): passes counted against that request, and backfills (the
    # passer was estimated to finish before the refused one could start: not counted)
    num_admission_bypasses: int = 0
    num_admission_backfills: int = 0
    # prompt core work: hidden-state rows the prompts' loops computed (token x loop), and
    # the rows token-sparse prefill's frozen tokens did not compute
    num_prefill_rows: int = 0
    num_prefill_rows_saved: int = 0


def new_kv(config: SchedulerConfig, limits: ModelLimits) -> KVManager:
    """An empty KV manager (at start, and after the worker's device state was lost)."""
    return KVManager(
        config.num_blocks,
        config.block_size,
        config.num_planes(limits.total_ut_steps),
        enable_prefix_caching=config.enable_prefix_caching,
    )


@dataclass(eq=False)
class SchedulerState:
    """The scheduler's shared state; the parts read and write it, the facade owns it."""

    config: SchedulerConfig
    limits: ModelLimits
    kv: KVManager
    total_ut_steps: int = field(init=False)
    requests: dict[str, Request] = field(default_factory=dict)
    running: list[Request] = field(default_factory=list)  # kept in queue order
    waiting: list[QueueEntry] = field(default_factory=list)  # a heap by priority key
    # the running requests' whole footprints: a bound on what they will still allocate
    # that admission checks first, so the exact sum is only taken when KV is tight
    running_footprints: Commitment = field(default_factory=Commitment)
    stats: SchedulerStats = field(default_factory=SchedulerStats)
    # what the next batch carries besides its rows (drained by ``build_batch``)
    next_seq: int = 0
    pending_new: list[Request] = field(default_factory=list)
    pending_finished: list[str] = field(default_factory=list)
    pending_preemptions: list[Preemption] = field(default_factory=list)
    # prompt KV the worker is to pull from prefill workers (disaggregation.py)
    pending_pulls: list[KVPull] = field(default_factory=list)
    # handoffs this shard will not read (the request ended first, or prefills here): the
    # prefill side frees their blocks as soon as it hears (drained into each output)
    unused_handoffs: list[KVHandoff] = field(default_factory=list)
    # loops a new decode token may run under overload shedding (total_ut_steps: none shed);
    # written only by ``DepthBudget``
    depth_budget: int = field(init=False)

    def __post_init__(self) -> None:
        self.total_ut_steps = self.limits.total_ut_steps
        self.depth_budget = self.total_ut_steps
