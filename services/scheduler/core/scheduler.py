"""The scheduler core: a facade over admission, depth-major selection, batch building and
one shared progress path.

Pure Python, no NATS and no torch. One ``schedule()`` returns one batch (of one ``BatchKind``; a
RECURRENT batch holds decode rows first, then split-prefill recurrent rows). Progress is
applied by ``update_after_submission`` (async scheduling) or ``update_from_output`` (sync);
both go through one path (``progress.py``) so they cannot diverge.

The parts, one concept each, share one ``SchedulerState`` (``state.py``):
``waiting.py`` (who leaves the waiting queue: KV policy, in-flight prefixes, prefix claims),
``selection.py`` (the batch's tasks and the preemption that makes room for them),
``batch_builder.py`` (tasks to the wire ``Batch``), ``progress.py`` (submissions and
results), ``running.py`` (joining and leaving the running set), ``depth_budget.py`` (depth
shedding under overload) and ``intake.py`` (validation).
"""

from __future__ import annotations

import heapq
import random

from messages.api import StreamEvent
from messages.batch import BatchKind, BatchResult
from messages.errors import ErrorCode, RequestError
from messages.kv_transfer import KVBlockFormat, KVHandoff
from messages.prefix import PrefixEventBatch
from messages.sampling import PrefillSetting, SamplingParams, SparsePrefill
from services.common.config import ModelLimits, SchedulerConfig
from services.common.fit import check_request_fits
from services.common.sparse_prefill import prefix_block_hashes, resolve_sparse_prefill
from services.scheduler.core.batch import ScheduledBatch
from services.scheduler.core.batch_builder import build_batch
from services.scheduler.core.depth_budget import BudgetChange, DepthBudget
from services.scheduler.core.disaggregation import Handoffs, Pulls
from services.scheduler.core.intake import KnownOutputs, validate_known_outputs, validate_prompt
from services.scheduler.core.kv.kv_admission import Commitment
from services.scheduler.core.kv.kv_manager import KVManager
from services.scheduler.core.kv.prefix_events import PrefixEventLog
from services.scheduler.core.progress import Progress, SchedulerInvariantError
from services.scheduler.core.request import Request
from services.scheduler.core.running import finish, preempt
from services.scheduler.core.selection import Selector
from services.scheduler.core.spec_stats import SpecStats
from services.scheduler.core.speculation import Speculator
from services.scheduler.core.state import SchedulerState, SchedulerStats, new_kv
from services.scheduler.core.waiting import Admission

__all__ = ["Scheduler", "SchedulerInvariantError", "SchedulerStats"]


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        limits: ModelLimits,
        seed: int = 0,
        producer_id: str = "scheduler-0",
        cache_salt: bytes = b"",
    ) -> None:
        self.config = config
        self.limits = limits
        self.total_ut_steps = limits.total_ut_steps
        self._state = SchedulerState(config, limits, new_kv(config, limits))
        # prefix events leave in envelopes with a per-producer event_seq and a fresh epoch
        self.prefix_log = PrefixEventLog(producer_id)
        self.cache_salt = cache_salt
        self._arrivals = 0
        self._rng = random.Random(seed)
        self._admission = Admission(self._state)
        self.speculator = Speculator(self._state)
        self._selector = Selector(self._state, self.speculator)
        self._progress = Progress(self._state, self.speculator)
        self._depth_budget = DepthBudget(self._state)
        # disaggregation: requests handed to decode shards, prompt KV pulled from prefill ones
        self.handoffs = Handoffs(self._state, producer_id)
        self.pulls = Pulls(self._state, self.block_format)

    @property
    def block_format(self) -> KVBlockFormat:
        """What a block is here: shards that hand requests over must agree on it."""
        config = self.config
        return KVBlockFormat(
            kv_layout=str(config.kv_layout),
            block_size=config.block_size,
            num_planes=config.num_planes(self.total_ut_steps),
            kv_cache_dtype=config.kv_cache_dtype,
            kv_int4_anchor_every=config.kv_int4_anchor_every if config.kv_int4 else 0,
        )

    # the shared state, read by the engine, the driver, telemetry and tests
    @property
    def kv(self) -> KVManager:
        return self._state.kv

    @property
    def requests(self) -> dict[str, Request]:
        return self._state.requests

    @property
    def running(self) -> list[Request]:
        """Running requests in queue order (priority, arrival)."""
        return self._state.running

    @property
    def stats(self) -> SchedulerStats:
        return self._state.stats

    @property
    def spec_stats(self) -> SpecStats:
        """What self-speculative decoding did (vLLM's spec_decode_* counters)."""
        return self._state.spec_stats

    @property
    def depth_budget(self) -> int:
        """Loops a new decode token may run (total_ut_steps unless overload shedding lowered
        it; a request's own max_loops and min_loops still bound its tokens)."""
        return self._state.depth_budget

    @property
    def _running_footprints(self) -> Commitment:
        return self._state.running_footprints

    # ------------------------------------------------------------------ requests in/out
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        trace_id: str = "",
        known_outputs: KnownOutputs | None = None,
        *,
        hand_off: bool = False,
        kv_source: KVHandoff | None = None,
        prefill_setting: PrefillSetting | None = None,
    ) -> Request:
        """Validates and queues a request; raises RequestError and changes nothing on failure.

        ``known_outputs`` (token ids, exit loops, depth budgets) resumes a request another
        shard started:
        it is queued as a preempted request is, so its prompt is prefilled and the known
        tokens are replayed with their recorded exits (never streamed again).

        Disaggregation: ``hand_off`` stops it after its first token, for a decode shard
        (``Handoffs``); ``kv_source`` (with its first token known) pulls its prompt's KV
        from a prefill worker instead of computing it (``Pulls``), if the blocks fit here.
        ``prefill_setting`` (or the handoff's): how the shard that first ran it prefilled
        its prompt, which a resumed request keeps (token-sparse prefill)."""
        if not isinstance(request_id, str) or not request_id:
            raise RequestError("request_id must be a non-empty string")
        if request_id in self._state.requests:
            raise RequestError(f"request id {request_id!r} is already live")
        validate_prompt(prompt_token_ids, self.limits)
        resolved = self.limits.resolve(params)
        check_request_fits(
            len(prompt_token_ids),
            resolved.max_tokens,
            self.limits.max_position_embeddings,
            self.kv.geometry,
        )
        known = known_outputs or KnownOutputs([], [])
        validate_known_outputs(known, resolved, self.limits)
        if prefill_setting is None and kv_source is not None:
            prefill_setting = kv_source.prefill_setting
        sparse = resolve_sparse_prefill(
            resolved,
            self.config.sparse_defaults(),
            self.total_ut_steps,
            split_prefill=bool(self.config.split_prefill),
            carried=prefill_setting,
        )
        seed = resolved.seed if resolved.seed is not None else self._rng.getrandbits(63)
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=resolved,
            seed=seed,
            arrival_seq=self._arrivals,
            total_ut_steps=self.total_ut_steps,
            trace_id=trace_id,
            output_token_ids=list(known.token_ids),
            output_exit_loops=list(known.exit_loops),
            # the budgets the other shard ran them under (shed ones count as shed here too)
            output_loop_budgets=list(known.depth_budgets) or [None] * len(known.token_ids),
            sparse=sparse,
            hand_off=hand_off,
            kv_source=kv_source if known.token_ids else None,
        )
        if kv_source is not None and request.kv_source is None:
            self._state.unused_handoffs.append(kv_source)  # no first token: it prefills
        if self.config.enable_prefix_caching:
            request.block_hashes = self._block_hashes(request)
        if resolved.prompt_logprobs is not None and not known.token_ids:
            request.prompt_logprobs = [None] * request.num_prompt_tokens
        self._arrivals += 1
        self._state.requests[request_id] = request
        heapq.heappush(self._state.waiting, (request.priority_key, request))
        return request

    def sparse_prefill_offer(self) -> SparsePrefill | None:
        """What a request that asks for token-sparse prefill without a retention runs under
        here (None: this engine runs atomic prefill, which cannot)."""
        if not self.config.split_prefill:
            return None
        return self.config.sparse_defaults().offer(self.total_ut_steps)

    def _block_hashes(self, request: Request) -> list[int]:
        """The prompt blocks the request may publish and claim (under token-sparse prefill,
        keyed by its setting and only before its last window: ``prefix_block_hashes``)."""
        return prefix_block_hashes(
            request.prompt_token_ids,
            self.config.block_size,
            request.sparse,
            self.cache_salt,
            self.config.kv_cache_dtype,
        )

    def finish_if_complete(self, request_id: str) -> list[StreamEvent]:
        """A resumed request whose known outputs already end it (its last token was a stop,
        or it has max_tokens of them) finishes at once, without running anything."""
        return self._progress.finish_if_complete(request_id)

    def abort_request(self, request_id: str) -> list[StreamEvent]:
        request = self._state.requests.get(request_id)
        if request is None:
            raise RequestError(f"unknown request id {request_id!r}", ErrorCode.NOT_FOUND)
        events: list[StreamEvent] = []
        finish(self._state, request, "abort", events)
        return events

    def fail_request(
        self, request_id: str, message: str, code: ErrorCode = ErrorCode.INTERNAL
    ) -> list[StreamEvent]:
        """Ends a live request with an error event (e.g. the worker failed its batch), freeing
        its KV; [] if it already ended."""
        return self._progress.fail_request(request_id, message, code)

    def reset_after_worker_loss(self) -> list[str]:
        """The worker's device state is gone (it died or was replaced). Every running request
        returns to the waiting queue with its outputs kept; on the next worker it is prefilled
        again and its known tokens are replayed with their recorded exit depths, so its KV and
        its further outputs equal an uninterrupted run. Results of batches sent before this
        call are stale (incarnation bumped) and are ignored if they still arrive.
        Returns the ids of the requests that will be recomputed."""
        state = self._state
        affected = [r.request_id for r in state.running]
        for request in list(state.running):
            request.inflight_batches = 0
            preempt(state, request)
        # the new worker starts empty: nothing to free there, and no cached prefix survives
        state.pending_finished = []
        state.pending_pulls = []
        self.handoffs.clear()  # their blocks went with the worker
        self.pulls.clear()
        state.kv = new_kv(self.config, self.limits)
        state.kv.reset_prefix_cache()  # consumers forget every block of the lost worker
        return affected

    def take_unused_handoffs(self) -> list[KVHandoff]:
        """Handoffs this shard will not read, since the last call (for their release)."""
        out, self._state.unused_handoffs = self._state.unused_handoffs, []
        return out

    def has_unfinished_requests(self) -> bool:
        return bool(self._state.requests)

    def num_waiting(self) -> int:
        return self._admission.num_waiting()

    def num_prefill_tokens_due(self) -> int:
        """Prompt tokens the waiting requests will compute (the load a router weighs)."""
        return self._admission.num_prefill_tokens_due()

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> ScheduledBatch | None:
        self._admission.admit_waiting()
        if self._state.pending_new:
            self.pulls.start_pending()
        self._depth_budget.update()
        self.speculator.start_step()
        selected = self._selector.select()
        if selected is None:
            if not self._state.pending_pulls:
                return None
            selected = (BatchKind.RECURRENT, [])  # a batch that only starts KV pulls
        kind, tasks = selected
        return build_batch(self._state, kind, tasks)

    def take_depth_budget_changes(self) -> list[BudgetChange]:
        """Moves of the depth budget since the last call (the engine logs each)."""
        return self._depth_budget.take_changes()

    def take_prefix_events(self) -> PrefixEventBatch | None:
        """Drains the KV manager's prefix events (the one buffer) into the next envelope of
        the producer log."""
        if not self.config.enable_prefix_caching:
            return None
        return self.prefix_log.emit(self.kv.take_prefix_events())

    # ------------------------------------------------------------------ progress
    def update_after_submission(self, batch: ScheduledBatch) -> None:
        """Marks the batch's rows in flight; with async scheduling also applies its prefill
        progress, so the next batch can be built before this one finishes."""
        self._progress.update_after_submission(batch)

    def update_from_output(self, batch: ScheduledBatch, result: BatchResult) -> list[StreamEvent]:
        """Applies a worker result: prefill progress (if not applied at submission), exit
        decisions, sampled tokens, stops. Results of preempted/aborted requests are dropped."""
        return self._progress.update_from_output(batch, result)

    def fail_batch(self, batch: ScheduledBatch, message: str) -> list[StreamEvent]:
        """``batch`` failed: every live request in it ends with an error (``progress.py``)."""
        return self._progress.fail_batch(batch, message)
