"""``--device sim``: a worker without a model, for scale benchmarks only.

It runs the scheduler's batches exactly as ``ModelRunner`` would account for them (the same
rows, passes, follow-on rows, forced exits and coda rows), but no tensor is computed: a batch
takes the time a cost model gives for it, and tokens and exit depths come from a
deterministic function of (request seed, position). It shows whether the control plane
(admission, router, index, schedulers, NATS) or the devices limit a deployment, on machines
that have no devices. Every result it returns is marked ``simulated``; it is never a default.

Cost model (``SimCostModel``), calibrated for Ouro-1.4B in bfloat16 on one H200:

- a core pass reads every core weight once and, for each row, the K and V of its context at
  its depth's plane: ``bytes = W_core + sum_rows(context_tokens) * kv_bytes_per_token``;
  Ouro-1.4B (24 layers, hidden 2048, 16 KV heads x 128, MLP 5632): W_core = 1.233e9 params x
  2 bytes = 2.47 GB, kv_bytes_per_token = 24 layers x 2 (K, V) x 16 x 128 x 2 bytes = 196,608;
- the coda (final norm + lm_head, 49152 x 2048 x 2 bytes = 0.20 GB) once per batch whose
  rows sample a token;
- a pass takes ``max(bytes / 4.8 TB/s, flops / 989 TFLOP/s)`` (H200 HBM3e bandwidth and dense
  bf16 peak, NVIDIA's published figures; flops = 2 x params x rows + attention), so decode
  is bandwidth-bound (a 1-row pass: 0.51 ms) and long prefill chunks compute-bound;
- ``dilation`` multiplies every time (``RLT_SIM_DILATION``): a pass 100x longer lets many
  simulated shards' schedulers share two CPU cores while keeping the ratio of scheduler CPU
  to device time the bench reports.

It is an optimistic roofline (no kernel launch gaps, perfect overlap), which makes the
control plane's share look larger than on real hardware, not smaller. Beside it, each pass
is charged the worker's measured host work (``HOST_PASS_S`` per pass, ``HOST_ROW_S`` per
token-sparse row: ``services/bench/host_cost.py``), overlapped with the previous pass's
device time as launches are. A prompt chunk reads
its context once. A token-sparse prefill fragment (``BatchRow.fragment``) costs its active
rows and one read of its window's context per query tile of the attention kernel
(``KERNEL_QUERY_TILE`` rows): its active tokens are one segment, each tile of them reads
the context once. Under int4-delta a pass at loop d reads the codes of its chain, planes
from the last anchor at or below d up to d (each plane above the anchor a delta from the
one below), plus its row's full-precision tail block
(``SimCostModel.kv_tokens_read``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kernels.kv_codec import AUTO, INT4_DELTA, bytes_per_token, chain_planes
from messages.batch import Batch, BatchKind, BatchResult, SampledLogprobs, WorkerSampling
from services.common.model_config import OuroConfig
from services.worker.kv_transfer.agent import KVArena
from services.worker.passes.rows import (
    LiveRow,
    RowCursor,
    RunnerStats,
    batch_result,
    end_loop,
    live_rows,
    row_failed,
    token_sampled,
)
from services.worker.passes.speculative import Speculation
from services.worker.sampling.logprobs import LOGPROB_FLOOR

# NVIDIA H200 SXM: 4.8 TB/s HBM3e, 989 TFLOP/s dense bf16 (published datasheet figures)
H200_HBM_BYTES_PER_S = 4.8e12
H200_BF16_FLOPS_PER_S = 989e12
# NVIDIA H100 SXM: 3.35 TB/s HBM3, 989 TFLOP/s dense bf16 (published datasheet figures)
H100_HBM_BYTES_PER_S = 3.35e12
H100_BF16_FLOPS_PER_S = 989e12
_MASK64 = (1 << 64) - 1
# rows per query tile of the tiled attention kernel at its largest (kernels/ops/
# attention_triton.py): a fragment of n active rows reads its context ceil(n / this) times
KERNEL_QUERY_TILE = 64

# The worker's host work per pass and per token-sparse row, measured with
# ``python -c "from services.bench.host_cost import measure_host_cost as m; print(m())"``
# (best of 5; a fragment of 2,048 active tokens over a 2,048-block table; the project's
# shared 2-core CPU machine, 2026-12-07, at git 'pdsoak', a fragment planned as one row of
# positions): 0.16 and 0.10 ms per pass, 0.05 and 0.02 us per row over two runs (one
# Python row object per active token cost ~11 us a row before). Decode rows' host work is
# not charged (not measured here).
HOST_PASS_S = 1.5e-4
HOST_ROW_S = 5e-8


@dataclass(frozen=True)
class SimCostModel:
    core_weight_bytes: float
    coda_weight_bytes: float
    kv_bytes_per_token: float  # K + V of one token over every layer of one plane
    core_params: float
    coda_params: float
    attn_flops_per_query_key: float  # every layer, every head
    bytes_per_s: float = H200_HBM_BYTES_PER_S
    flops_per_s: float = H200_BF16_FLOPS_PER_S
    dilation: float = 1.0
    host_pass_s: float = HOST_PASS_S
    host_row_s: float = HOST_ROW_S
    # int4-delta: a pass at loop d decodes its chain of planes (from the anchor at or below
    # d, every ``anchor_every``-th plane, 0: plane 0 only); each row also reads its open
    # block from the full-precision tail, worth this many context tokens of codes
    plane_chain: bool = False
    tail_tokens: float = 0.0
    anchor_every: int = 0

    @classmethod
    def for_model(
        cls,
        cfg: OuroConfig,
        *,
        dtype_bytes: int = 2,
        dilation: float = 1.0,
        bytes_per_s: float = H200_HBM_BYTES_PER_S,
        flops_per_s: float = H200_BF16_FLOPS_PER_S,
        kv_cache_dtype: str = AUTO,
        block_size: int = 16,
        kv_int4_anchor_every: int = 0,
    ) -> SimCostModel:
        """``kv_cache_dtype``: a context token's K/V are charged the codec's bytes (codes,
        scales and flags of its block, ``kernels/kv_codec.py``; int4-delta's full-precision
        chain of planes and tail are charged per pass by ``kv_tokens_read``)."""
        h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
        kv_dim = cfg.num_key_value_heads * cfg.head_dim
        q_dim = cfg.num_attention_heads * cfg.head_dim
        per_layer = h * q_dim + 2 * h * kv_dim + q_dim * h + 3 * h * inter
        core = per_layer * layers
        coda = cfg.vocab_size * h
        return cls(
            core_weight_bytes=core * dtype_bytes,
            coda_weight_bytes=coda * dtype_bytes,
            kv_bytes_per_token=bytes_per_token(
                kv_cache_dtype,
                cfg.num_key_value_heads,
                cfg.head_dim,
                planes=1,
                block_size=block_size,
                model_bytes=dtype_bytes,
                layers=layers,
            ),
            core_params=core,
            coda_params=coda,
            attn_flops_per_query_key=4 * layers * q_dim,
            bytes_per_s=bytes_per_s,
            flops_per_s=flops_per_s,
            dilation=dilation,
            plane_chain=kv_cache_dtype == INT4_DELTA,
            tail_tokens=block_size
            * bytes_per_token(
                AUTO, cfg.num_key_value_heads, cfg.head_dim, 1, block_size, dtype_bytes
            )
            / bytes_per_token(
                kv_cache_dtype, cfg.num_key_value_heads, cfg.head_dim, 1, block_size, dtype_bytes
            )
            if kv_cache_dtype == INT4_DELTA
            else 0.0,
            anchor_every=kv_int4_anchor_every,
        )

    def kv_tokens_read(self, context: int, depth: int) -> float:
        """Context tokens (at ``kv_bytes_per_token``) one row at loop ``depth`` reads."""
        if not self.plane_chain:
            return context
        return context * chain_planes(depth, self.anchor_every) + self.tail_tokens

    def core_pass_s(self, num_rows: int, context_tokens: float, query_key_pairs: int) -> float:
        """One core pass over ``num_rows`` query tokens reading ``context_tokens`` of KV."""
        read = self.core_weight_bytes + context_tokens * self.kv_bytes_per_token
        flops = 2 * self.core_params * num_rows + self.attn_flops_per_query_key * query_key_pairs
        return max(read / self.bytes_per_s, flops / self.flops_per_s)

    def host_s(self, sparse_rows: int) -> float:
        """The worker's host work for a pass with ``sparse_rows`` rows of token-sparse
        fragments (their expansion and plan: array work per active token)."""
        return self.host_pass_s + self.host_row_s * sparse_rows

    def coda_s(self, num_rows: int) -> float:
        flops = 2 * self.coda_params * num_rows
        return max(self.coda_weight_bytes / self.bytes_per_s, flops / self.flops_per_s)


def mix64(*values: int) -> int:
    """A deterministic 64-bit mix (splitmix64 steps): the same in every process and run."""
    x = 0x9E3779B97F4A7C15
    for v in values:
        x = (x ^ (v & _MASK64)) & _MASK64
        x = (x + 0x9E3779B97F4A7C15) & _MASK64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
        x ^= x >> 31
    return x


SIM_REFUSES_STRUCTURED_OUTPUT = (
    "structured outputs are not supported by the simulated device (--device sim): its tokens "
    "are not a model's"
)


@dataclass
class _SimRequest(RowCursor):
    num_prompt_tokens: int = 0
    sampling: WorkerSampling | None = None


class SimRunner:
    """``ModelRunner``'s interface (``execute``, ``last_seq``, ``stats``) without a model."""

    simulated = True

    @classmethod
    def h200(
        cls,
        cfg: OuroConfig,
        *,
        dilation: float = 1.0,
        kv_cache_dtype: str = AUTO,
        kv_int4_anchor_every: int = 0,
    ) -> SimRunner:
        """Passes timed as Ouro-1.4B's on an H200, whatever checkpoint ``cfg`` comes from
        (it supplies the vocabulary, depths and EOS ids); KV read at the codec's bytes."""
        from services.worker.model.toy import toy_config

        cost = SimCostModel.for_model(
            toy_config("1.4b"),
            dilation=dilation,
            kv_cache_dtype=kv_cache_dtype,
            kv_int4_anchor_every=kv_int4_anchor_every,
        )
        return cls(cfg, cost)

    @classmethod
    def h100(
        cls,
        cfg: OuroConfig,
        *,
        dilation: float = 1.0,
        kv_cache_dtype: str = AUTO,
        kv_int4_anchor_every: int = 0,
    ) -> SimRunner:
        """``h200``'s passes on an H100 SXM (its HBM3 bandwidth, the same bf16 peak)."""
        from services.worker.model.toy import toy_config

        cost = SimCostModel.for_model(
            toy_config("1.4b"),
            dilation=dilation,
            kv_cache_dtype=kv_cache_dtype,
            kv_int4_anchor_every=kv_int4_anchor_every,
            bytes_per_s=H100_HBM_BYTES_PER_S,
            flops_per_s=H100_BF16_FLOPS_PER_S,
        )
        return cls(cfg, cost)

    def __init__(
        self,
        cfg: OuroConfig,
        cost: SimCostModel,
        *,
        sleep: bool = True,
    ) -> None:
        self.cfg = cfg
        self.cost = cost
        self.total_ut_steps = cfg.total_ut_steps
        self.eos = frozenset(cfg.eos_token_ids)
        self.sleep = sleep  # False: only account (tests)
        # self-speculative cycles: a draft agrees with the target with this probability per
        # position (a deterministic draw per (seed, position)), as a model measured it
        self.draft_acceptance = 0.0
        # under an exit gate, where tokens exit: entry e - 1 the share of tokens exiting after
        # e loops, as a model measured it (None: uniform over min_loops..max_loops)
        self.exit_distribution: tuple[float, ...] | None = None
        self.speculation = Speculation(cfg.total_ut_steps, lambda: 0, lambda slot: None)
        self.requests: dict[str, _SimRequest] = {}
        self.last_seq = -1
        self.stats = RunnerStats()
        # (rows, tokens) of each core pass of the last batch, as ModelRunner keeps them
        self.last_batch_passes: list[tuple[int, int]] = []
        self.simulated_s = 0.0  # device time the cost model charged, before dilation
        # host K/V arenas that KV pulls write (disaggregation benches); no pass reads them
        self.kv_arena: KVArena | None = None

    # ------------------------------------------------------------------ the functions
    def token_at(self, seed: int, position: int) -> int:
        """The token a request samples for ``position`` (never an EOS id: a simulated run
        ends by max_tokens or stop ids, as the bench's requests do)."""
        vocab = self.cfg.vocab_size
        token = mix64(seed, position, 1) % vocab
        while token in self.eos:
            token = (token + 1) % vocab
        return token

    def exit_loops_at(self, s: WorkerSampling, position: int, budget: int | None = None) -> int:
        """How many loops the token fed at ``position`` runs before it exits; a shed depth
        ``budget`` (BatchRow.max_loops) caps where the request's own rule would exit, as it
        caps a model's exit gate."""
        high = max(1, min(s.max_loops, self.total_ut_steps))
        if s.exit_threshold >= 1.0:
            natural = high
        else:
            low = min(max(1, s.min_loops), high)
            draw = mix64(s.seed, position, 2)
            if self.exit_distribution is None:
                natural = low + draw % (high - low + 1)
            else:
                natural = min(max(low, _sample_loops(self.exit_distribution, draw)), high)
        return natural if budget is None else min(natural, budget)

    # ------------------------------------------------------------------ execution
    def execute(self, batch: Batch) -> BatchResult:
        t0 = time.perf_counter()
        if batch.seq <= self.last_seq:
            raise ValueError(f"batch {batch.seq} arrived after batch {self.last_seq}")
        self._apply_deltas(batch)
        self.last_seq = batch.seq
        self.last_batch_passes = []
        rows = live_rows(batch, self.requests)
        spec_rows, cycles = self.speculation.resolve(batch, self.requests, lambda rid: 0)
        rows += spec_rows
        seconds = 0.0 if batch.kind is BatchKind.PREFILLING_PRELUDE else self._run(rows)
        self.simulated_s += seconds
        wait = seconds * self.cost.dilation
        if self.sleep and wait > 0:
            time.sleep(max(0.0, wait - (time.perf_counter() - t0)))
        self.stats.record_batch(batch, time.perf_counter() - t0)
        return batch_result(batch, rows, self.speculation.settle(cycles, self.requests))

    def _apply_deltas(self, batch: Batch) -> None:
        for request_id in batch.finished_request_ids:
            self.requests.pop(request_id, None)
            self.speculation.drop(request_id)
        for new in batch.new_requests:
            self.speculation.drop(new.request_id)
            self.requests[new.request_id] = _SimRequest(
                num_prompt_tokens=len(new.prompt_token_ids), sampling=new.sampling
            )

    def _run(self, rows: list[LiveRow]) -> float:
        """Runs the rows' loops pass by pass; returns the device seconds they cost."""
        device: list[float] = []
        host: list[float] = []
        coda_rows = 0
        while True:
            active = [r for r in rows if r.loops_left > 0]
            if not active:
                break
            num_rows = pairs = sparse_rows = 0
            context = 0.0
            for r in active:
                end = r.row.token_start + r.row.token_count
                queries = r.row.num_rows  # a token-sparse fragment: its active tokens only
                num_rows += queries
                if r.row.fragment is not None:
                    sparse_rows += queries
                tiles = -(-queries // KERNEL_QUERY_TILE) if r.row.fragment is not None else 1
                context += tiles * self.cost.kv_tokens_read(end, r.depth)
                pairs += queries * end
            device.append(self.cost.core_pass_s(num_rows, context, pairs))
            host.append(self.cost.host_s(sparse_rows))
            self.stats.record_pass(num_rows)
            self.last_batch_passes.append((len(active), num_rows))
            for r in active:
                coda_rows += self._finish_loop(r)
        if not device:
            return 0.0  # nothing to run (a row whose request already has all its tokens)
        # the host plans pass k + 1 while the device runs pass k (launches do not wait): the
        # first plan is paid alone, then each pass takes the longer of the two
        seconds = (host[0] if host else 0.0) + sum(
            max(d, h) for d, h in zip(device, [*host[1:], 0.0], strict=True)
        )
        if coda_rows:
            seconds += self.cost.coda_s(coda_rows)
        return seconds

    def _finish_loop(self, r: LiveRow) -> int:
        """One loop of a row ran; returns 1 if it reached the coda (samples a token)."""
        row = r.row
        req = self.requests[row.request_id]
        assert req.sampling is not None
        loops_run = r.loops_run
        r.loops_left -= 1
        r.depth += 1
        if not r.is_decode:
            end = row.token_start + row.token_count
            if row.compute_logits and loops_run == self.total_ut_steps and r.loops_left == 0:
                return self._sample(r, req, end - 1)
            return 0
        exit_at = row.forced_exit_loops or self.exit_loops_at(
            req.sampling, row.token_start, row.max_loops
        )
        exited = loops_run >= exit_at
        if r.spec is not None:
            return self._spec_loop(r, req, loops_run, exited)
        end_loop(r, req, loops_run=loops_run, exited=exited, remaining=row.remaining)
        if exited and row.compute_logits:
            return self._sample(r, req, row.token_start)
        return 0

    def _spec_loop(self, r: LiveRow, req: _SimRequest, loops_run: int, exited: bool) -> int:
        """A speculative row's loop: an exit gives the target's token; a draft's end gives
        the target's token with probability ``draft_acceptance``, another one otherwise."""
        assert req.sampling is not None
        Speculation.loop_ended(r, loops_run=loops_run, exited=exited, remaining=r.row.remaining)
        if not exited and r.coda_at != loops_run:
            return 0
        position = r.row.token_start
        token = self.token_at(req.sampling.seed, position + 1)
        if not exited:
            draw = mix64(req.sampling.seed, position, 3) % 1_000_000
            if draw >= self.draft_acceptance * 1_000_000:
                token = (token + 1) % self.cfg.vocab_size
        if req.sampling.structured_output is not None:
            Speculation.coda(r, token, None, SIM_REFUSES_STRUCTURED_OUTPUT)
            return 1
        logprobs = self._logprobs(req.sampling, token) if exited else None
        Speculation.coda(r, token, None, None, logprobs)
        return 1

    def _logprobs(self, s: WorkerSampling, token: int) -> SampledLogprobs | None:
        """Simulated log-probabilities of the asked shape: the token is certain, nothing
        else is possible."""
        n = s.logprobs
        if n is None:
            return None
        return SampledLogprobs(
            logprob=0.0,
            top_ids=[(token + i) % self.cfg.vocab_size for i in range(n)],
            top_logprobs=[0.0, *[LOGPROB_FLOOR] * (n - 1)][:n],
        )

    def _sample(self, r: LiveRow, req: _SimRequest, last_position: int) -> int:
        assert req.sampling is not None
        if req.sampling.structured_output is not None:
            # refused, not ignored: made-up tokens would never follow the format
            row_failed(r, req, SIM_REFUSES_STRUCTURED_OUTPUT)
            return 1
        token = self.token_at(req.sampling.seed, last_position + 1)
        r.result.logprobs = self._logprobs(req.sampling, token)
        token_sampled(r, req, token)
        return 1


def _sample_loops(distribution: tuple[float, ...], draw: int) -> int:
    """The loop count ``draw`` (64 random bits) picks from ``distribution`` (entry e - 1:
    the chance of exiting after e loops)."""
    u = (draw >> 11) / float(1 << 53)
    total = sum(distribution)
    acc = 0.0
    for loops, share in enumerate(distribution, start=1):
        acc += share / total
        if u < acc:
            return loops
    return len(distribution)
