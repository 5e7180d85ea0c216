"""Executes one batch on the model: the worker's pure core (no NATS).

The runner owns device KV, the decode hidden-state pool and each prompt's hidden rows, and
mirrors block tables from the deltas each batch carries. A batch is a set of rows; a row
runs ``num_loops`` loops from loop index ``depth``. Loops of rows at different depths share
one core pass, so a batch runs max(num_loops) passes over a shrinking set of rows.

A pass is planned on the host (``pass_plan``), sent to the device in one copy, and runs
there to the end: the exit rule, the LAST_EXITED exit copy, the coda and the sampler
included. What the host needs (survival, exits, tokens, log-probabilities) comes back in
one copy per batch, the only wait for the device. Decode passes may run with static
shapes (``static_decode``), captured as CUDA graphs on a GPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import structlog
import torch

from kernels.kv_codec import AUTO, DEFAULT_BATCH_LIMITS, BatchLimits
from kernels.ops import exit_rule
from kernels.ops.backends import select_backends
from messages.batch import Batch, BatchKind, BatchResult
from services.common.config import KVLayout
from services.common.sampling import sample_batch
from services.common.sparse_prefill import SparseSchedule
from services.worker.kv_int4.paged import Int4KV
from services.worker.kv_storage import build_kv, decode_mode_for
from services.worker.model.ouro import OuroModel, PassAttention
from services.worker.passes.decode_pool import DecodePool
from services.worker.passes.pass_inputs import DevicePass
from services.worker.passes.pass_plan import PassPlan, PassPlanner, RequestView
from services.worker.passes.rows import (
    LiveRow,
    RowCursor,
    RunnerStats,
    batch_result,
    forget_cursors,
    live_rows,
)
from services.worker.passes.sparse_prefill import SparseFragments, SparseWindows
from services.worker.passes.speculative import SpecCycle, Speculation
from services.worker.passes.static_decode import DecodeMode, StaticDecode
from services.worker.passes.transfer import Transfer
from services.worker.results import ResultReader
from services.worker.sampling.grammar import (
    GrammarBook,
    MaskSource,
    PassMasks,
    RequestGrammar,
    fill_pass_masks,
    mask_words,
)
from services.worker.sampling.logprobs import logprob_columns, score_prompts, token_logprob

_log = structlog.get_logger("rlt")


@dataclass
class _WorkerRequest(RowCursor, RequestView):
    prefill_hidden: torch.Tensor | None = None  # [P, H]: hidden of each prompt position
    # token-sparse prefill's window state (scores, active tokens): lives as long as
    # prefill_hidden
    sparse: SparseWindows | None = None


class ModelRunner(ResultReader):
    def __init__(
        self,
        model: OuroModel,
        num_blocks: int,
        block_size: int,
        kv_layout: KVLayout = KVLayout.LAST_EXITED,
        *,
        decode_mode: DecodeMode | None = None,
        grammars: GrammarBook | None = None,
        kv_cache_dtype: str = AUTO,
        kv_int4_anchor_every: int = 0,
        batch_limits: BatchLimits = DEFAULT_BATCH_LIMITS,
    ) -> None:
        """``grammars``: structured outputs (the checkpoint's tokenizer); without it a
        request with one fails. ``kv_cache_dtype``: the KV codec (``services/worker/kv_cache.py``;
        ValueError for one the worker cannot store). ``kv_int4_anchor_every``: int4-delta's
        anchor interval (``kernels/kv_codec.py``). ``batch_limits``: the scheduler's
        (int4-delta reserves the tails its batches can hold open)."""
        cfg = model.cfg
        self.model = model
        self.block_size = block_size
        self.kv_layout = kv_layout
        self.total_loops = cfg.total_ut_steps
        self.kv = build_kv(
            model,
            num_blocks,
            block_size,
            kv_layout,
            kv_cache_dtype,
            kv_int4_anchor_every,
            batch_limits,
        )
        self.int4: Int4KV | None = self.kv if isinstance(self.kv, Int4KV) else None
        self.k_cache, self.v_cache = self.kv.k, self.kv.v
        self.transfer = Transfer(model.device)
        mode = decode_mode_for(model, decode_mode, kv_cache_dtype)
        # Captured graphs read the pool's rows where they are: a pool with a row per KV block
        # never has to grow (each live request holds a block of its own), so nothing is
        # captured again while serving.
        capacity = max(DecodePool.DEFAULT_CAPACITY, num_blocks + 1)
        self.pool = DecodePool(
            cfg.hidden_size,
            model.dtype,
            model.device,
            capacity if mode is DecodeMode.GRAPHS else DecodePool.DEFAULT_CAPACITY,
        )
        self.planner = PassPlanner(
            block_size,
            self.total_loops,
            kv_layout == KVLayout.LAST_EXITED,
            scratch_slot=num_blocks * block_size,
            scratch_pool_slot=DecodePool.SCRATCH,
            host_words=self.transfer.host_words,
        )
        self.requests: dict[str, _WorkerRequest] = {}
        self.sparse = SparseFragments(
            self.planner,
            self.transfer,
            self.kv.copy_slots,
            self.total_loops,
            None if self.int4 is None else self.int4.freeze,
        )
        self.grammars = grammars
        # the live requests with a structured output (empty: passes skip every mask step)
        self.constrained: dict[str, RequestGrammar] = {}
        # self-speculative cycles (docs/speculative.md): extra hidden rows from the pool
        self.speculation = Speculation(
            self.total_loops, self.pool.allocate, self.pool.free, self.constrained, token_logprob
        )
        self.last_seq = -1
        self.stats = RunnerStats()
        # (rows, tokens) of each core pass of the last batch (the worker's metrics read it)
        self.last_batch_passes: list[tuple[int, int]] = []
        # each op's CUDA kernel, chosen on this machine before any graph captures it
        for choice in select_backends(
            model.device,
            vocab_size=cfg.vocab_size,
            num_heads=cfg.num_attention_heads,
            kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            block_size=block_size,
            dtype=model.dtype,
        ):
            _log.info("cuda_backend", op=choice.op, backend=choice.backend, reason=choice.reason)
        self.static = StaticDecode(self, mode) if mode is not DecodeMode.EAGER else None
        if self.static is not None and mode is DecodeMode.GRAPHS:
            self.static.capture_all()

    # ------------------------------------------------------------------ state mirroring
    def _apply_deltas(self, batch: Batch) -> None:
        for request_id in batch.finished_request_ids:
            self.speculation.drop(request_id)
            if (req := self.requests.pop(request_id, None)) is not None:
                self.pool.free(req.pool_slot)
                if self.int4 is not None:
                    self.int4.release(request_id, req.tables)
            self.constrained.pop(request_id, None)
        num_planes = self.total_loops if self.kv_layout == KVLayout.LAST_EXITED else 1
        for new in batch.new_requests:
            self.speculation.drop(new.request_id)
            old = self.requests.get(new.request_id)
            if old is not None and self.int4 is not None:  # preempted: its blocks are gone
                self.int4.release(new.request_id, old.tables)
            self.requests[new.request_id] = _WorkerRequest(
                prompt=list(new.prompt_token_ids),
                sampling=new.sampling,
                tables=[[] for _ in range(num_planes)],
                pool_slot=old.pool_slot if old is not None else self.pool.allocate(),
                sparse=None
                if new.sparse_prefill is None
                else SparseWindows.new(
                    SparseSchedule.from_wire(new.sparse_prefill),
                    len(new.prompt_token_ids),
                    self.model.device,
                ),
            )
            sparse = self.requests[new.request_id].sparse
            if sparse is not None and self.int4 is not None:
                schedule = sparse.schedule
                self.int4.expect_freezes(
                    new.request_id, schedule.first_sparse_loop, sparse.prompt_len, schedule.window
                )
            constraint = new.sampling.structured_output
            if constraint is not None:
                book = self.grammars
                compiled = book.compile(constraint) if book is not None else None
                self.constrained[new.request_id] = RequestGrammar(
                    book, compiled, new.generated_token_ids
                )
        if self.int4 is not None:
            for pull in batch.kv_pulls:
                self.int4.receive(pull.local_blocks)
        for delta in batch.block_deltas:
            state = self.requests.get(delta.request_id)
            if state is None:
                raise ValueError(f"block delta for unknown request {delta.request_id!r}")
            for table, blocks in zip(state.tables, delta.plane_blocks, strict=True):
                table.extend(blocks)

    # ------------------------------------------------------------------ execution
    @property
    def num_core_passes(self) -> int:
        return self.stats.core_passes

    def execute(self, batch: Batch) -> BatchResult:
        t0 = time.perf_counter()
        try:
            return self._execute(batch)
        finally:
            self.stats.record_batch(batch, time.perf_counter() - t0)

    @torch.inference_mode()
    def _execute(self, batch: Batch) -> BatchResult:
        if batch.seq <= self.last_seq:
            raise ValueError(f"batch {batch.seq} arrived after batch {self.last_seq}")
        self._apply_deltas(batch)
        self.last_seq = batch.seq
        self.last_batch_passes = []
        rows = live_rows(batch, self.requests)
        spec_rows, cycles = self.speculation.resolve(
            batch, self.requests, lambda rid: self.requests[rid].pool_slot
        )
        self._book_cycles(cycles)
        try:
            if batch.kind == BatchKind.PREFILLING_PRELUDE:
                self._run_prelude(rows)
            else:
                self._run_recurrent(rows + spec_rows)
        except Exception:
            if self.int4 is not None:
                self.int4.abandon_pass()
            forget_cursors(batch, self.requests)
            for row in batch.rows:
                self.speculation.drop(row.request_id)
            self._book_cycles(cycles)
            raise
        settled = self.speculation.settle(cycles, self.requests)
        self._book_cycles(cycles)
        return batch_result(batch, rows, settled)

    def _book_cycles(self, cycles: dict[int, SpecCycle]) -> None:
        if self.int4 is not None:  # what a cycle may write again is never sealed for good
            self.int4.book_cycles(cycles.values(), self.speculation.cycles)

    def _run_prelude(self, rows: list[LiveRow]) -> None:
        if not rows:
            return
        ids: list[int] = []
        for live in rows:
            r = live.row
            ids += self.requests[r.request_id].prompt[r.token_start : r.token_start + r.token_count]
        words = self.transfer.host_words(len(ids))
        words[:] = ids
        hidden = self.model.prelude(self.transfer.to_device(words))
        offset = 0
        for live in rows:
            r = live.row
            buffer = self._prefill_buffer(self.requests[r.request_id])
            buffer[r.token_start : r.token_start + r.token_count] = hidden[
                offset : offset + r.token_count
            ]
            offset += r.token_count

    def _prefill_buffer(self, req: _WorkerRequest) -> torch.Tensor:
        if req.prefill_hidden is None:
            req.prefill_hidden = torch.empty(
                (len(req.prompt), self.model.cfg.hidden_size),
                dtype=self.model.dtype,
                device=self.model.device,
            )
        return req.prefill_hidden

    def _run_recurrent(self, rows: list[LiveRow]) -> None:
        if any(live.row.fragment is not None for live in rows):
            rows = self.sparse.expand(rows, self.requests)  # only their active tokens run
        first_pass = True
        plans: list[PassPlan] = []
        results: list[torch.Tensor] = []
        prompt_rows: list[tuple[LiveRow, torch.Tensor]] = []  # asked for prompt logprobs
        while active := [live for live in rows if live.loops_left > 0]:
            if plans and plans[-1].padded:
                # a static pass's results live in its graph's output until the next replay
                results[-1] = results[-1].clone()
            plan, packed = self._run_pass(active, first_pass)
            first_pass = False
            plans.append(plan)
            results.append(packed)
            self.stats.record_pass(plan.shape.num_tokens if not plan.padded else len(active))
            tokens = sum(live.row.token_count for live in active)
            self.last_batch_passes.append((len(active), tokens))
            for live in active:
                live.loops_left -= 1
                live.depth += 1
                if (
                    not live.is_decode
                    and live.depth == self.total_loops
                    and self.requests[live.row.request_id].sampling.prompt_logprobs is not None
                ):
                    prompt_rows.append((live, self._prompt_hidden(live)))
        self.sparse.choose_ahead()  # before the wait below, which then covers it
        if results:
            host = self.transfer.to_host(torch.cat(results) if len(results) > 1 else results[0])
            self._read_results(plans, host.tolist())
        if self.int4 is not None:
            self.int4.after_batch(rows, self.requests)
        if prompt_rows:
            score_prompts(self.model, self.transfer, self.requests, prompt_rows)
        for live in rows:  # a prompt done at full depth: its hidden rows are dead
            r = live.row
            req = self.requests[r.request_id]
            if (
                not live.is_decode
                and live.depth == self.total_loops
                and live.end == len(req.prompt)
            ):
                req.prefill_hidden = None
                req.sparse = None

    def _prompt_hidden(self, live: LiveRow) -> torch.Tensor:
        r = live.row
        buffer = self._prefill_buffer(self.requests[r.request_id])
        return buffer[r.token_start : r.token_start + r.token_count]

    def _run_pass(self, active: list[LiveRow], first_pass: bool) -> tuple[PassPlan, torch.Tensor]:
        """Plans one pass and starts it on the device; returns the plan and its packed
        results (still on the device)."""
        if self.static is not None and (ran := self.static.try_run(active)) is not None:
            return ran
        plan = self.planner.plan(active, self.requests, first_pass)  # type: ignore[arg-type]
        words = self.transfer.to_device(plan.host.buffer)
        device = DevicePass(plan.shape, words)
        masks = self.token_masks(plan) if self.constrained else None
        hidden = self.pass_inputs(plan, device)
        packed, out = self.run_core(plan, device, hidden, masks)
        if len(plan.decode) < len(plan.rows):  # prompt rows may feed a sparse loop's choice
            self.sparse.record_scores(plan, hidden, out, self.requests)
        self._store_prompt_rows(plan, device, out)
        return plan, packed

    def token_masks(self, plan: PassPlan) -> PassMasks | None:
        """The masks of the pass's coda rows with a structured output, filled on the host
        and sent in one copy; None when it has none."""
        # a speculative row's mask is its position's (the grammar after the drafts before it)
        rows: list[tuple[int, MaskSource]] = [
            (j, grammar if live.spec is None else live.spec.mask)
            for j, (live, wanted) in enumerate(zip(plan.coda, plan.coda_wanted, strict=True))
            if wanted and (grammar := self.constrained.get(live.row.request_id)) is not None
        ]
        if not rows:
            return None
        per_mask = mask_words(self.model.vocab_size)
        host = self.transfer.host_words(len(rows) * (1 + per_mask))
        fill_pass_masks(host, rows, per_mask)
        # then row i is coda row i (a padded pass has more coda rows than live ones)
        every_row = len(rows) == plan.shape.num_coda
        return PassMasks(len(rows), self.transfer.to_device(host), every_row)

    def _store_prompt_rows(self, plan: PassPlan, device: DevicePass, out: torch.Tensor) -> None:
        """Prompt rows keep their hidden rows for their next loop (and the coda): one
        gather and one scatter per request, whatever the pass's row count."""
        if not plan.shape.num_stores:
            return
        rows, positions = device["store.row"].long(), device["store.position"].long()
        for group in plan.prompt_groups:
            a, b = group.stores
            buffer = self._prefill_buffer(self.requests[group.request_id])
            buffer.index_copy_(0, positions[a:b], out.index_select(0, rows[a:b]))

    def pass_inputs(self, plan: PassPlan, device: DevicePass) -> torch.Tensor:
        """The pass's packed hidden rows [T, H]: decode rows from the prelude (loop 0) or
        the pool, prompt rows from the prelude (their first pass) or their buffer (one
        gather per request)."""
        embedded = self.model.prelude(device["token.token_id"])
        pooled = self.pool.rows.index_select(0, device["token.pool_slot"])
        hidden = torch.where(device["token.embed"].bool()[:, None], embedded, pooled)
        if plan.shape.num_loads:
            rows, positions = device["load.row"].long(), device["load.position"].long()
            for group in plan.prompt_groups:
                a, b = group.loads
                if a < b:
                    buffer = self._prefill_buffer(self.requests[group.request_id])
                    hidden.index_copy_(0, rows[a:b], buffer.index_select(0, positions[a:b]))
        return hidden

    def run_core(
        self,
        plan: PassPlan,
        device: DevicePass,
        hidden: torch.Tensor,
        masks: PassMasks | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One core pass and everything after it on the device: the exit rule, the pool
        write, the exit copy, the coda, the structured outputs' token masks and the
        sampler. Returns (packed float32 results, the pass's output rows)."""
        packed, logits, out = self.core_to_logits(plan, device, hidden)
        if logits is not None:
            packed += self.finish_coda(plan, device, logits, masks)
        if not packed:
            return out.new_zeros(0, dtype=torch.float32), out
        return (torch.cat(packed) if len(packed) > 1 else packed[0]), out

    def core_to_logits(
        self, plan: PassPlan, device: DevicePass, hidden: torch.Tensor
    ) -> tuple[list[torch.Tensor], torch.Tensor | None, torch.Tensor]:
        """The part of a pass that a CUDA graph holds whatever its rows ask: the core loop,
        the exit rule, the pool write, the exit copy and the coda's logits. Returns (the
        decode rows' packed results, the coda rows' logits or None, the output rows)."""
        model = self.model
        int4 = self.int4.pass_attention(plan, self.requests) if self.int4 is not None else None
        attn = PassAttention(
            device["token.slot"],
            device["segment.table"],
            device["segment.context_len"],
            device["segment.query_start"],
            plan.max_query_len,
            device["token.position"] if plan.gathered else None,
        )
        out, gates = model.core_loop(
            hidden,
            model.rope(device["token.position"]),
            self.k_cache,
            self.v_cache,
            attn,
            self.kv.k_scale,
            self.kv.v_scale,
            int4,
        )
        packed: list[torch.Tensor] = []
        if plan.shape.num_decode:
            decode_rows = device["decode.row"]
            survived, exited = exit_rule(
                gates.index_select(0, decode_rows),
                device["decode.remaining"],
                device["decode.loops_run"],
                device["decode.min_loops"],
                device["decode.max_loops"],
                device["decode.threshold"],
                device["decode.forced"],
            )
            pool_slots = device["token.pool_slot"].index_select(0, decode_rows)
            self.pool.rows.index_put_((pool_slots,), out.index_select(0, decode_rows))
            if plan.shape.num_pairs:
                self.kv.copy_slots(
                    device["pair.src"],
                    device["pair.dst"],
                    exited.index_select(0, device["pair.decode_row"]),
                )
            packed += [survived, exited.float()]
        if not plan.shape.num_coda:
            return packed, None, out
        return packed, model.coda(out.index_select(0, device["coda.row"])), out

    def finish_coda(
        self,
        plan: PassPlan,
        device: DevicePass,
        logits: torch.Tensor,
        masks: PassMasks | None,
    ) -> list[torch.Tensor]:
        """From the coda rows' logits: the token masks, the sampler and the log-probability
        columns, packed (token ids, could-not-sample flags, columns), on the device."""
        allowed = logits if masks is None else masks.apply(logits)
        ids, bad = self._sample(plan, device, allowed)
        if plan.keep_logits:  # the rejection rule of sampled speculative rows reads them
            plan.logits = allowed.float().clone()
            if plan.logprobs_top >= 0:  # a token it commits is scored on the raw logits
                plan.raw_logits = logits.float().clone()
        packed = [ids.float(), bad.float()]
        if plan.logprobs_top >= 0:
            packed.append(logprob_columns(logits, ids, plan.logprobs_top).flatten())
        return packed

    def _sample(
        self, plan: PassPlan, device: DevicePass, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and a could-not-sample flag per coda row, on the device. All-greedy
        passes (known on the host) take one argmax; others the counter-based sampler."""
        if plan.all_greedy:
            return torch.argmax(logits, dim=-1), torch.isnan(logits).any(dim=-1)
        return sample_batch(
            logits,
            device["coda.temperature"],
            device["coda.top_k"],
            device["coda.top_p"],
            device["coda.seed"],
            device["coda.output_index"],
            filters=plan.filters,
        )
