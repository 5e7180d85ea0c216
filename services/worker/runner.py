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

from kernels.ops import copy_kv_slots_masked, exit_rule
from kernels.ops.backends import select_backends
from messages.batch import Batch, BatchKind, BatchResult
from services.common.config import KVLayout
from services.common.sampling import sample_batch
from services.common.sparse_prefill import SparseSchedule
from services.worker.model.ouro import OuroModel, PassAttention
from services.worker.passes.decode_pool import DecodePool
from services.worker.passes.pass_inputs import DevicePass
from services.worker.passes.pass_plan import PassPlan, PassPlanner, RequestView
from services.worker.passes.rows import (
    LiveRow,
    RowCursor,
    RunnerStats,
    batch_result,
    end_loop,
    forget_cursors,
    live_rows,
    row_failed,
    token_sampled,
)
from services.worker.passes.sparse_prefill import SparseFragments, SparseWindows
from services.worker.passes.static_decode import DecodeMode, StaticDecode
from services.worker.passes.transfer import Transfer
from services.worker.sampling.grammar import (
    GrammarBook,
    PassMasks,
    RequestGrammar,
    fill_pass_masks,
    mask_words,
)
from services.worker.sampling.logprobs import logprob_columns, sampled_logprobs, score_prompts

NAN_LOGITS = "the model produced NaN logits"

_log = structlog.get_logger("rlt")


@dataclass
class _WorkerRequest(RowCursor, RequestView):
    prefill_hidden: torch.Tensor | None = None  # [P, H]: hidden of each prompt position
    # token-sparse prefill's window state (scores, active tokens): lives as long as
    # prefill_hidden
    sparse: SparseWindows | None = None


class ModelRunner:
    def __init__(
        self,
        model: OuroModel,
        num_blocks: int,
        block_size: int,
        kv_layout: KVLayout = KVLayout.LAST_EXITED,
        *,
        decode_mode: DecodeMode | None = None,
        grammars: GrammarBook | None = None,
    ) -> None:
        """``grammars``: structured outputs (the checkpoint's tokenizer); without it a
        request with one fails."""
        cfg = model.cfg
        self.model = model
        self.block_size = block_size
        self.kv_layout = kv_layout
        self.total_loops = cfg.total_ut_steps
        # one block past the scheduler's pool: padding rows of a static pass write there
        shape = (
            cfg.num_hidden_layers,
            num_blocks + 1,
            block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        # KV dtype follows the model (bf16/fp16 on CUDA): attention kernels read it as is.
        self.k_cache = torch.zeros(shape, dtype=model.dtype, device=model.device)
        self.v_cache = torch.zeros(shape, dtype=model.dtype, device=model.device)
        self.transfer = Transfer(model.device)
        mode = decode_mode or DecodeMode.default_for(model.device)
        if mode is DecodeMode.GRAPHS and model.device.type != "cuda":
            mode = DecodeMode.PADDED  # graphs need CUDA: the same static passes, eagerly
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
            self.planner, self.transfer, self.k_cache, self.v_cache, self.total_loops
        )
        self.grammars = grammars
        # the live requests with a structured output (empty: passes skip every mask step)
        self.constrained: dict[str, RequestGrammar] = {}
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
            if (req := self.requests.pop(request_id, None)) is not None:
                self.pool.free(req.pool_slot)
            self.constrained.pop(request_id, None)
        num_planes = self.total_loops if self.kv_layout == KVLayout.LAST_EXITED else 1
        for new in batch.new_requests:
            old = self.requests.get(new.request_id)
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
            constraint = new.sampling.structured_output
            if constraint is not None:
                book = self.grammars
                compiled = book.compile(constraint) if book is not None else None
                self.constrained[new.request_id] = RequestGrammar(
                    book, compiled, new.generated_token_ids
                )
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
        try:
            if batch.kind == BatchKind.PREFILLING_PRELUDE:
                self._run_prelude(rows)
            else:
                self._run_recurrent(rows)
        except Exception:
            forget_cursors(batch, self.requests)
            raise
        return batch_result(batch, rows)

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
        if results:
            host = self.transfer.to_host(torch.cat(results) if len(results) > 1 else results[0])
            self._read_results(plans, host.tolist())
        if prompt_rows:
            score_prompts(self.model, self.transfer, self.requests, prompt_rows)
        for live in rows:  # a prompt done at full depth: its hidden rows are dead
            r = live.row
            req = self.requests[r.request_id]
            if (
                not live.is_decode
                and live.depth == self.total_loops
                and r.token_start + r.token_count == len(req.prompt)
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
        masks = self._token_masks(plan) if self.constrained else None
        hidden = self.pass_inputs(plan, device)
        packed, out = self.run_core(plan, device, hidden, masks)
        if len(plan.decode) < len(plan.rows):  # prompt rows may feed a sparse loop's choice
            self.sparse.record_scores(plan, hidden, out, self.requests)
        self._store_prompt_rows(plan, out)
        return plan, packed

    def _token_masks(self, plan: PassPlan) -> PassMasks | None:
        """The masks of the pass's coda rows with a structured output, filled on the host
        and sent in one copy; None when it has none."""
        rows = [
            (j, grammar)
            for j, (live, wanted) in enumerate(zip(plan.coda, plan.coda_wanted, strict=True))
            if wanted and (grammar := self.constrained.get(live.row.request_id)) is not None
        ]
        if not rows:
            return None
        per_mask = mask_words(self.model.vocab_size)
        host = self.transfer.host_words(len(rows) * (1 + per_mask))
        fill_pass_masks(host, rows, per_mask)
        every_row = len(rows) == len(plan.coda)  # then row i is coda row i
        return PassMasks(len(rows), self.transfer.to_device(host), every_row)

    def _store_prompt_rows(self, plan: PassPlan, out: torch.Tensor) -> None:
        """Prompt rows keep their hidden rows for their next loop (and the coda)."""
        for offset, live in zip(plan.row_offsets, plan.rows, strict=True):
            r = live.row
            if not live.is_decode:
                self._prefill_buffer(self.requests[r.request_id])[
                    r.token_start : r.token_start + r.token_count
                ] = out[offset : offset + r.token_count]

    def pass_inputs(self, plan: PassPlan, device: DevicePass) -> torch.Tensor:
        """The pass's packed hidden rows [T, H]: decode rows from the prelude (loop 0) or
        the pool, prompt rows from the prelude (their first pass) or their buffer."""
        embedded = self.model.prelude(device["token.token_id"])
        pooled = self.pool.rows.index_select(0, device["token.pool_slot"])
        hidden = torch.where(device["token.embed"].bool()[:, None], embedded, pooled)
        if plan.from_prefill:
            for offset, live in plan.from_prefill:
                r = live.row
                hidden[offset : offset + r.token_count] = self._prefill_buffer(
                    self.requests[r.request_id]
                )[r.token_start : r.token_start + r.token_count]
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
        model = self.model
        attn = PassAttention(
            device["token.slot"],
            device["segment.table"],
            device["segment.context_len"],
            device["segment.query_start"],
            plan.max_query_len,
            device["token.position"] if plan.gathered else None,
        )
        out, gates = model.core_loop(
            hidden, model.rope(device["token.position"]), self.k_cache, self.v_cache, attn
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
                copy_kv_slots_masked(
                    self.k_cache,
                    self.v_cache,
                    device["pair.src"],
                    device["pair.dst"],
                    exited.index_select(0, device["pair.decode_row"]),
                )
            packed += [survived, exited.float()]
        if plan.shape.num_coda:
            logits = model.coda(out.index_select(0, device["coda.row"]))
            allowed = logits if masks is None else masks.apply(logits)
            ids, bad = self._sample(plan, device, allowed)
            packed += [ids.float(), bad.float()]
            if plan.logprobs_top >= 0:
                packed.append(logprob_columns(logits, ids, plan.logprobs_top).flatten())
        if not packed:
            return out.new_zeros(0, dtype=torch.float32), out
        return (torch.cat(packed) if len(packed) > 1 else packed[0]), out

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

    # ------------------------------------------------------------------ results
    def _read_results(self, plans: list[PassPlan], values: list[float]) -> None:
        """Applies every pass's results in order: survival and exits, then tokens."""
        at = 0
        for plan in plans:
            n, c = plan.shape.num_decode, plan.shape.num_coda
            exited: set[int] = set()
            for j, (live, loops) in enumerate(zip(plan.decode, plan.decode_loops, strict=True)):
                did_exit = values[at + n + j] != 0.0
                cursor = self.requests[live.row.request_id]
                end_loop(live, cursor, loops_run=loops, exited=did_exit, remaining=values[at + j])
                if did_exit:
                    exited.add(id(live))
            at += 2 * n
            tokens, bad = values[at : at + c], values[at + c : at + 2 * c]
            at += 2 * c
            top = plan.logprobs_top
            width = 1 + 2 * min(top, self.model.vocab_size) if top >= 0 else 0
            scored = values[at : at + c * width]
            at += c * width
            for j, (live, wanted) in enumerate(zip(plan.coda, plan.coda_wanted, strict=True)):
                if not wanted:
                    continue
                if live.is_decode and id(live) not in exited:
                    continue
                cursor = self.requests[live.row.request_id]
                if bad[j]:
                    sampling = cursor.sampling
                    row_failed(
                        live,
                        cursor,
                        NAN_LOGITS
                        if sampling.temperature == 0.0
                        else "sampling failed: the row's logits or probabilities are not finite",
                    )
                    continue
                token = int(tokens[j])
                grammar = self.constrained.get(live.row.request_id) if self.constrained else None
                if grammar is not None:
                    problem = grammar.accept(token, live.row.output_index)
                    if problem is not None:
                        row_failed(live, cursor, problem)
                        continue
                token_sampled(live, cursor, token)
                n_top = cursor.sampling.logprobs
                if n_top is not None and width:
                    columns = scored[j * width : (j + 1) * width]
                    live.result.logprobs = sampled_logprobs(columns, n_top)
