"""Executes one batch on the model: the worker's pure core (no NATS).

The runner owns device KV and per-request hidden state, and mirrors block tables from the
deltas each batch carries. A batch is a set of rows; a row runs ``num_loops`` loops from
loop index ``depth``. Loops of rows at different depths share one core pass, so a batch
runs max(num_loops) passes over a shrinking set of rows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec
import torch

from kernels import (
    AttentionMetadata,
    Segment,
    build_attention_metadata,
    copy_kv_slots,
    exit_copy_slots,
    select_attention_backend,
    write_kv,
)
from messages.batch import (
    Batch,
    BatchResult,
    BatchRow,
    Phase,
    PromptLogprobs,
    RowKind,
    RowResult,
    SampledLogprobs,
    WorkerSampling,
)
from services.common.config import KVLayout
from services.common.exit_policy import should_exit, update_survival
from services.common.sampling import SamplingError, sample_token
from services.worker.model.ouro import OuroModel


@dataclass
class RunnerStats:
    """What the runner did since it was made: the bench reads these (in-process, or from a
    worker service's health reply) and so can metrics."""

    batches: int = 0
    decode_batches: int = 0  # batches with decode rows: each is one pass that carries them
    core_passes: int = 0
    core_rows: int = 0  # hidden-state rows over all core passes (a decode row is one)
    execute_s: float = 0.0  # time inside execute

    def snapshot(self) -> dict[str, float]:
        return dict(self.__dict__)

    def record_batch(self, batch: Batch, seconds: float) -> None:
        """One executed batch that took ``seconds``."""
        self.execute_s += seconds
        self.batches += 1
        if batch.phase is Phase.RECURRENT and any(
            r.kind is RowKind.DECODE or r.kind is RowKind.FOLLOW_ON for r in batch.rows
        ):
            self.decode_batches += 1


def batch_result(batch: Batch, ran: dict[int, RowResult]) -> BatchResult:
    """The result of ``batch`` from the rows that ran; the others are marked skipped."""
    rows = [ran.get(i) or RowResult(row_index=i, skipped=True) for i in range(len(batch.rows))]
    return BatchResult(seq=batch.seq, rows=rows)


@dataclass
class _WorkerRequest:
    prompt: torch.Tensor  # [P] int64 on device
    sampling: WorkerSampling
    tables: list[list[int]]  # one block table per plane
    prefill_hidden: torch.Tensor | None = None  # [P, H]: hidden of each prompt position
    decode_hidden: torch.Tensor | None = None  # [H]: the token in progress
    # the request's next decode row, known once its last decode/coda row ran: what a
    # follow-on row (sent before the scheduler saw that result) resolves to
    next_decode: BatchRow | None = None


# the least log-probability reported (vLLM's floor): -inf and NaN have no JSON form
LOGPROB_FLOOR = -9999.0
_PROMPT_SLICE = 256  # prompt positions scored at once (the table is positions x vocab)


@dataclass
class _RowState:
    index: int
    row: BatchRow
    depth: int
    loops_left: int
    result: RowResult = field(init=False)

    def __post_init__(self) -> None:
        self.result = RowResult(row_index=self.index)

    @property
    def is_decode(self) -> bool:
        return self.row.kind is RowKind.DECODE


class ModelRunner:
    def __init__(
        self,
        model: OuroModel,
        num_blocks: int,
        block_size: int,
        kv_layout: KVLayout = KVLayout.LAST_EXITED,
        attention_backend: str | None = None,
    ) -> None:
        cfg = model.cfg
        self.model = model
        self.block_size = block_size
        self.kv_layout = kv_layout
        self.total_depths = cfg.total_ut_steps
        shape = (
            cfg.num_hidden_layers,
            num_blocks,
            block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        # KV dtype follows the model (bf16/fp16 on CUDA): attention kernels read it as is.
        self.k_cache = torch.zeros(shape, dtype=model.dtype, device=model.device)
        self.v_cache = torch.zeros(shape, dtype=model.dtype, device=model.device)
        self.scale = cfg.head_dim**-0.5
        # Chosen once (and logged once); the CPU default is the reference kernel.
        self.attention = select_attention_backend(
            model.device, model.dtype, block_size, cfg.head_dim, prefer=attention_backend
        )
        self.requests: dict[str, _WorkerRequest] = {}
        self.last_seq = -1
        self.stats = RunnerStats()
        # (rows, tokens) of each core pass of the last batch (the worker's metrics read it)
        self.last_batch_passes: list[tuple[int, int]] = []

    # ------------------------------------------------------------------ state mirroring
    def _apply_deltas(self, batch: Batch) -> None:
        for request_id in batch.finished_request_ids:
            self.requests.pop(request_id, None)
        num_planes = self.total_depths if self.kv_layout == KVLayout.LAST_EXITED else 1
        for new in batch.new_requests:
            self.requests[new.request_id] = _WorkerRequest(
                prompt=torch.tensor(
                    new.prompt_token_ids, dtype=torch.long, device=self.model.device
                ),
                sampling=new.sampling,
                tables=[[] for _ in range(num_planes)],
            )
        for delta in batch.block_deltas:
            state = self.requests.get(delta.request_id)
            if state is None:
                raise ValueError(f"block delta for unknown request {delta.request_id!r}")
            for table, blocks in zip(state.tables, delta.plane_blocks, strict=True):
                table.extend(blocks)

    def _plane(self, depth: int) -> int:
        return depth if self.kv_layout == KVLayout.LAST_EXITED else 0

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
        states: list[_RowState] = []
        for i, row in enumerate(batch.rows):
            resolved = self._resolve_follow_on(row) if row.kind is RowKind.FOLLOW_ON else row
            if resolved is not None:
                states.append(
                    _RowState(
                        index=i, row=resolved, depth=resolved.depth, loops_left=resolved.num_loops
                    )
                )
        try:
            if batch.phase == Phase.PREFILLING_PRELUDE:
                self._run_prelude(states)
            else:
                self._run_recurrent(states)
        except Exception:
            # a half-run batch leaves no cursor to trust: follow-ons of its requests skip
            for row in batch.rows:
                if (req := self.requests.get(row.request_id)) is not None:
                    req.next_decode = None
            raise
        return batch_result(batch, {state.index: state.result for state in states})

    def _resolve_follow_on(self, row: BatchRow) -> BatchRow | None:
        """The row a follow-on stands for; None (skipped) if its predecessor did not run."""
        req = self.requests.get(row.request_id)
        if req is None or req.next_decode is None:
            return None
        resolved, req.next_decode = req.next_decode, None
        return resolved

    def _run_prelude(self, states: list[_RowState]) -> None:
        if not states:
            return
        spans = [(self.requests[s.row.request_id], s.row) for s in states]
        ids = torch.cat(
            [req.prompt[r.token_start : r.token_start + r.token_count] for req, r in spans]
        )
        hidden = self.model.prelude(ids)
        offset = 0
        for req, row in spans:
            self._prefill_buffer(req)[row.token_start : row.token_start + row.token_count] = hidden[
                offset : offset + row.token_count
            ]
            offset += row.token_count

    def _prefill_buffer(self, req: _WorkerRequest) -> torch.Tensor:
        if req.prefill_hidden is None:
            req.prefill_hidden = torch.empty(
                (req.prompt.numel(), self.model.cfg.hidden_size),
                dtype=self.model.dtype,
                device=self.model.device,
            )
        return req.prefill_hidden

    def _run_recurrent(self, states: list[_RowState]) -> None:
        first_pass = True
        coda_rows: list[tuple[_RowState, torch.Tensor]] = []
        prompt_rows: list[tuple[_RowState, torch.Tensor]] = []  # asked for prompt logprobs
        while True:
            active = [s for s in states if s.loops_left > 0]
            if not active:
                break
            hidden, positions, segments = self._gather_inputs(active, first_pass)
            first_pass = False
            meta = build_attention_metadata(
                segments, self.block_size, hidden.shape[0], device=self.model.device
            )
            out, gates = self.model.core_loop(hidden, positions, self._attend(meta))
            self.stats.core_passes += 1
            self.stats.core_rows += hidden.shape[0]
            self.last_batch_passes.append((len(active), hidden.shape[0]))
            self._scatter_outputs(active, out, gates, coda_rows, prompt_rows)
        self._run_coda(coda_rows)
        if prompt_rows:
            self._prompt_logprobs(prompt_rows)

    def _gather_inputs(
        self, active: list[_RowState], first_pass: bool
    ) -> tuple[torch.Tensor, torch.Tensor, list[Segment]]:
        """The pass's packed hidden rows, their positions and attention segments.

        Rows that start from the prelude (prompt chunks on their first pass, decode rows at
        depth 0) are embedded in one batched call. Decode token ids and all positions are
        gathered as Python ints and sent to the device once each: per-row small tensors
        would cost a host-to-device copy per row on a GPU.
        """
        pieces: list[torch.Tensor] = []
        positions: list[int] = []
        segments: list[Segment] = []
        prompt_ids: list[torch.Tensor] = []  # prompt spans to embed, on the device
        prompt_slots: list[int] = []
        token_ids: list[int] = []  # decode tokens to embed
        token_slots: list[int] = []
        row = 0
        for state in active:
            r = state.row
            req = self.requests[r.request_id]
            count = r.token_count
            if state.is_decode:
                if state.depth == 0:
                    token_ids.append(r.input_token_id)
                    token_slots.append(len(pieces))
                    pieces.append(torch.empty(0))  # filled after one batched embedding call
                else:
                    assert req.decode_hidden is not None, "decode row without hidden state"
                    pieces.append(req.decode_hidden.unsqueeze(0))
            elif r.embed and first_pass:
                prompt_ids.append(req.prompt[r.token_start : r.token_start + count])
                prompt_slots.append(len(pieces))
                pieces.append(torch.empty(0))
            else:
                pieces.append(self._prefill_buffer(req)[r.token_start : r.token_start + count])
            positions.extend(range(r.token_start, r.token_start + count))
            segments.append(
                Segment(
                    row_start=row,
                    num_rows=count,
                    pos_start=r.token_start,
                    block_table=req.tables[self._plane(state.depth)],
                )
            )
            row += count
        device = self.model.device
        if prompt_ids or token_ids:
            ids = prompt_ids + ([torch.tensor(token_ids, device=device)] if token_ids else [])
            embedded = self.model.prelude(torch.cat(ids) if len(ids) > 1 else ids[0])
            offset = 0
            for slot, span in zip(prompt_slots, prompt_ids, strict=True):
                pieces[slot] = embedded[offset : offset + span.numel()]
                offset += span.numel()
            for slot in token_slots:
                pieces[slot] = embedded[offset : offset + 1]
                offset += 1
        hidden = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        return hidden, torch.tensor(positions, device=device), segments

    def _attend(self, meta: AttentionMetadata):
        k_cache, v_cache, scale, backend = self.k_cache, self.v_cache, self.scale, self.attention
        backend.prepare(meta)  # per-pass index tensors, shared by every layer

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            write_kv(k_cache[layer], v_cache[layer], meta.slot_mapping, k, v)
            return backend.forward(q, k_cache[layer], v_cache[layer], meta, scale)

        return attend

    def _scatter_outputs(
        self,
        active: list[_RowState],
        out: torch.Tensor,
        gates: torch.Tensor,
        coda_rows: list[tuple[_RowState, torch.Tensor]],
        prompt_rows: list[tuple[_RowState, torch.Tensor]],
    ) -> None:
        decode_index = [i for i, s in enumerate(active) if s.is_decode]
        offsets: list[int] = []
        row = 0
        for state in active:
            offsets.append(row)
            row += state.row.token_count
        survival: list[float] = []
        if decode_index:
            rows = torch.tensor([offsets[i] for i in decode_index])
            before = torch.tensor(
                [active[i].row.remaining for i in decode_index], dtype=torch.float32
            )
            survival = update_survival(before, gates[rows].cpu()).tolist()
        decode_survival = dict(zip(decode_index, survival, strict=True))
        copy_src: list[int] = []
        copy_dst: list[int] = []
        for i, state in enumerate(active):
            r = state.row
            req = self.requests[r.request_id]
            h = out[offsets[i] : offsets[i] + r.token_count]
            loops_run = state.depth + 1
            state.loops_left -= 1
            if state.is_decode:
                self._finish_decode_loop(
                    state, req, h[0], decode_survival[i], coda_rows, copy_src, copy_dst
                )
            else:
                self._prefill_buffer(req)[r.token_start : r.token_start + r.token_count] = h
                if r.compute_logits and loops_run == self.total_depths:
                    coda_rows.append((state, h[-1]))
                if req.sampling.prompt_logprobs >= 0 and loops_run == self.total_depths:
                    prompt_rows.append((state, h))
                if loops_run == self.total_depths and (
                    r.token_start + r.token_count == req.prompt.numel()
                ):
                    req.prefill_hidden = None  # prompt done: its hidden rows are dead
            state.depth += 1
        if copy_src:
            # every exit of this pass in one copy (decode rows of a pass are distinct requests)
            device = self.k_cache.device
            copy_kv_slots(
                self.k_cache,
                self.v_cache,
                torch.tensor(copy_src, device=device),
                torch.tensor(copy_dst, device=device),
            )

    def _finish_decode_loop(
        self,
        state: _RowState,
        req: _WorkerRequest,
        h: torch.Tensor,
        remaining: float,
        coda_rows: list[tuple[_RowState, torch.Tensor]],
        copy_src: list[int],
        copy_dst: list[int],
    ) -> None:
        r = state.row
        loops_run = state.depth + 1
        s = req.sampling
        if r.forced_exit_loops:
            exited = loops_run >= r.forced_exit_loops
        else:
            exited = should_exit(loops_run, remaining, s.min_loops, s.max_loops, s.exit_threshold)
        state.result.remaining = remaining
        state.result.exited = exited
        if not exited:
            req.decode_hidden = h
            req.next_decode = msgspec.structs.replace(
                r, depth=loops_run, embed=False, remaining=remaining
            )
            return
        state.result.exit_loops = loops_run
        req.decode_hidden = None
        req.next_decode = None  # the coda sets it once the next input token is sampled
        if self.kv_layout == KVLayout.LAST_EXITED and loops_run < self.total_depths:
            # LAST_EXITED: this token's KV at its exit depth fills every higher plane
            src, dst = exit_copy_slots(req.tables, r.token_start, state.depth, self.block_size)
            copy_src.extend(src)
            copy_dst.extend(dst)
        if r.compute_logits:
            coda_rows.append((state, h))

    def _run_coda(self, coda_rows: list[tuple[_RowState, torch.Tensor]]) -> None:
        if not coda_rows:
            return
        logits = self.model.coda(torch.stack([h for _, h in coda_rows]))
        samplings = [self.requests[state.row.request_id].sampling for state, _ in coda_rows]
        tokens = self._sample(logits, samplings, [state.row for state, _ in coda_rows])
        if any(s.logprobs >= 0 for s in samplings):
            _attach_logprobs(logits, samplings, tokens, [state.result for state, _ in coda_rows])
        for (state, _), token in zip(coda_rows, tokens, strict=True):
            r = state.row
            if isinstance(token, str):
                # this row alone failed: its request ends, the batch's other rows go on
                state.result.error = token
                self.requests[r.request_id].next_decode = None
                continue
            state.result.token_id = token
            # the token is fed back at the next position, from depth 0
            self.requests[r.request_id].next_decode = BatchRow(
                request_id=r.request_id,
                kind=RowKind.DECODE,
                token_start=r.token_start + r.token_count,
                token_count=1,
                depth=0,
                embed=True,
                input_token_id=token,
                compute_logits=True,
                output_index=r.output_index + 1,
            )

    def _prompt_logprobs(self, prompt_rows: list[tuple[_RowState, torch.Tensor]]) -> None:
        """Prefill rows at their final depth, for requests that asked for prompt logprobs:
        position p's logits score prompt token p + 1. A coda, a log-softmax and a copy to
        the host per ``_PROMPT_SLICE`` of their positions."""
        hidden: list[torch.Tensor] = []
        targets: list[torch.Tensor] = []
        spans: list[tuple[_RowState, int, int, int]] = []  # row, first scored, count, top
        for state, h in prompt_rows:
            req = self.requests[state.row.request_id]
            start = state.row.token_start
            count = min(h.shape[0], req.prompt.numel() - 1 - start)  # the last has no next
            if count <= 0:
                continue
            hidden.append(h[:count])
            targets.append(req.prompt[start + 1 : start + 1 + count])
            spans.append((state, start + 1, count, req.sampling.prompt_logprobs))
        if not spans:
            return
        hidden_rows, ids = torch.cat(hidden), torch.cat(targets)
        top = max(n for *_, n in spans)
        table: list[_Scored] = []
        # in slices: a [positions, vocab] float32 table of a whole batch could be large
        for lo in range(0, ids.numel(), _PROMPT_SLICE):
            logits = self.model.coda(hidden_rows[lo : lo + _PROMPT_SLICE])
            table += _logprob_table(logits, ids[lo : lo + _PROMPT_SLICE], top)
        row = 0
        for state, start, count, n in spans:
            rows = table[row : row + count]
            row += count
            state.result.prompt_logprobs = PromptLogprobs(
                start=start,
                logprobs=[chosen for chosen, _, _ in rows],
                top_ids=[top_ids[:n] for _, top_ids, _ in rows],
                top_logprobs=[values[:n] for _, _, values in rows],
            )

    def _sample(
        self, logits: torch.Tensor, samplings: list[WorkerSampling], rows: list[BatchRow]
    ) -> list[int | str]:
        """One token per row, or the reason that row could not be sampled (a str). Greedy
        rows take one batched argmax where the logits are, so only their ids (and a NaN flag
        each) leave the device (argmax keeps the first maximum on CPU and CUDA alike, and the
        float32 upcast keeps the order). Sampled rows go to the host sampler, seeded per
        (request, token index)."""
        tokens: list[int | str] = [0] * len(rows)
        greedy = [i for i, s in enumerate(samplings) if s.temperature == 0.0]
        if greedy:
            index = torch.tensor(greedy, device=logits.device)
            chosen = logits.index_select(0, index).float()
            ids = torch.argmax(chosen, dim=-1)
            nan = torch.isnan(chosen).any(dim=-1).to(ids.dtype)
            picked, bad = torch.stack([ids, nan]).tolist()
            for i, token, is_nan in zip(greedy, picked, bad, strict=True):
                tokens[i] = "the model produced NaN logits" if is_nan else int(token)
        sampled = [i for i, s in enumerate(samplings) if s.temperature != 0.0]
        if sampled:
            index = torch.tensor(sampled, device=logits.device)
            host = logits.index_select(0, index).cpu()
            for i, row_logits in zip(sampled, host, strict=True):
                s = samplings[i]
                try:
                    tokens[i] = sample_token(
                        row_logits,
                        temperature=s.temperature,
                        top_k=s.top_k,
                        top_p=s.top_p,
                        seed=s.seed,
                        output_index=rows[i].output_index,
                    )
                except (SamplingError, RuntimeError) as exc:  # torch's own sampling errors
                    tokens[i] = f"sampling failed: {exc}"
        return tokens


def _attach_logprobs(
    logits: torch.Tensor,
    samplings: list[WorkerSampling],
    tokens: list[int | str],
    results: list[RowResult],
) -> None:
    """The sampled token's log-probability and the top alternatives, for the rows whose
    request asked for them (``_logprob_table``)."""
    rows = [i for i, s in enumerate(samplings) if s.logprobs >= 0 and isinstance(tokens[i], int)]
    if not rows:
        return
    index = torch.tensor(rows, device=logits.device)
    chosen = torch.tensor([tokens[i] for i in rows], device=logits.device)
    table = _logprob_table(
        logits.index_select(0, index), chosen, max(samplings[i].logprobs for i in rows)
    )
    for (logprob, top_ids, values), i in zip(table, rows, strict=True):
        n = samplings[i].logprobs
        results[i].logprobs = SampledLogprobs(
            logprob=logprob, top_ids=top_ids[:n], top_logprobs=values[:n]
        )


# per row: the chosen token's log-probability, the best ids and their log-probabilities
_Scored = tuple[float, list[int], list[float]]


def _logprob_table(logits: torch.Tensor, chosen: torch.Tensor, top: int) -> list[_Scored]:
    """Per row of ``logits``: the log-probability of its ``chosen`` token and the ``top``
    best tokens', from one batched log-softmax over the raw logits (before temperature and
    top-k/top-p, as vLLM reports by default) and one copy to the host (ids ride as float64,
    exact below 2**53). Values are floored at ``LOGPROB_FLOOR`` (as vLLM does): JSON has no
    -inf or NaN, and a row with an infinite logit has no finite distribution."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    logprobs = torch.nan_to_num(logprobs, nan=LOGPROB_FLOOR, posinf=0.0).clamp_(min=LOGPROB_FLOOR)
    columns = [logprobs.gather(1, chosen[:, None])]
    k = min(top, logprobs.shape[-1])
    if k:
        values, ids = logprobs.topk(k, dim=-1)
        columns += [values, ids.double()]
    host = torch.cat([c.double() for c in columns], dim=1).tolist()
    return [(r[0], [int(t) for t in r[1 + k :]], r[1 : 1 + k]) for r in host]
