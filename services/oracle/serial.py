"""Serial oracle: a plain, single-request, float32 reference for looped LMs (Ouro).

This module is deliberately independent of the serving engine: it reads the checkpoint
itself, does its own layer math and keeps a dense per-depth KV cache (plain tensors indexed
``[plane][layer][position]``), with no paging and no batching. Tests compare the engine's
tokens and exit depths with this implementation, so a shared bug cannot hide in both.

The prompt is processed one matrix per loop with a causal mask; decode runs one token at a
time. Everything is float32, including the exit-policy arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from services.oracle.checkpoint import (
    LayerWeights,
    read_config,
    read_tensors,
    take_tensor,
)
from services.oracle.dense_kv import DenseKV
from services.oracle.exit_tracker import ExitTracker
from services.oracle.results import OracleResult, OracleStep, SparseSetting

KV_LAYOUTS = ("last_exited", "shared")
TOP_LOGPROBS = 20  # alternatives each OracleStep records (the API's most)

Sampler = Callable[[torch.Tensor, int], int]


# --------------------------------------------------------------------------------------------
# The oracle
# --------------------------------------------------------------------------------------------


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class SerialOracle:
    """Single-request float32 reference generator for an Ouro-format checkpoint."""

    def __init__(self, checkpoint_dir: str | Path) -> None:
        ckpt = Path(checkpoint_dir)
        cfg = read_config(ckpt / "config.json")
        self._cfg = cfg
        self.total_ut_steps = cfg.total_ut_steps
        self.vocab_size = cfg.vocab_size
        self.eos_token_ids = cfg.eos_token_ids
        self.max_position_embeddings = cfg.max_position_embeddings

        t = read_tensors(ckpt)
        self._embed = take_tensor(t, "model.embed_tokens.weight")
        self._norm = take_tensor(t, "model.norm.weight")
        self._gate_w = take_tensor(t, "model.early_exit_gate.weight").reshape(1, cfg.hidden_size)
        self._gate_b = take_tensor(t, "model.early_exit_gate.bias").reshape(1)
        if "lm_head.weight" in t:
            self._lm_head = t["lm_head.weight"]
        elif cfg.tie_word_embeddings:
            self._lm_head = self._embed
        else:
            raise KeyError("checkpoint has no lm_head.weight and tie_word_embeddings is false")
        self._layers: list[LayerWeights] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            self._layers.append(
                LayerWeights(
                    wq=take_tensor(t, p + "self_attn.q_proj.weight"),
                    wk=take_tensor(t, p + "self_attn.k_proj.weight"),
                    wv=take_tensor(t, p + "self_attn.v_proj.weight"),
                    wo=take_tensor(t, p + "self_attn.o_proj.weight"),
                    w_gate=take_tensor(t, p + "mlp.gate_proj.weight"),
                    w_up=take_tensor(t, p + "mlp.up_proj.weight"),
                    w_down=take_tensor(t, p + "mlp.down_proj.weight"),
                    norm_in=take_tensor(t, p + "input_layernorm.weight"),
                    norm_attn_out=take_tensor(t, p + "input_layernorm_2.weight"),
                    norm_post=take_tensor(t, p + "post_attention_layernorm.weight"),
                    norm_mlp_out=take_tensor(t, p + "post_attention_layernorm_2.weight"),
                )
            )
        hd = cfg.head_dim
        exponents = torch.arange(0, hd, 2, dtype=torch.int64).to(torch.float32) / hd
        self._inv_freq = 1.0 / (cfg.rope_theta**exponents)

    # ---- math -------------------------------------------------------------------------------

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(dim=-1, keepdim=True)
        return w * (x * torch.rsqrt(var + self._cfg.rms_norm_eps))

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [n, heads, hd]; same rotation at every depth (position only)."""
        freqs = positions.to(torch.float32)[:, None] * self._inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
        return x * cos + _rotate_half(x) * sin

    def _attention(
        self,
        layer: int,
        w: LayerWeights,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv: DenseKV,
        plane: int,
    ) -> torch.Tensor:
        """Causal attention for queries at ``positions`` (ascending) against ``plane``.

        The queries' own K/V are written into the plane first, so each query sees itself and
        every earlier position's current content of that plane.
        """
        cfg = self._cfg
        n = x.shape[0]
        end = int(positions[-1]) + 1
        q = F.linear(x, w.wq).view(n, cfg.num_heads, cfg.head_dim)
        k = F.linear(x, w.wk).view(n, cfg.num_kv_heads, cfg.head_dim)
        v = F.linear(x, w.wv).view(n, cfg.num_kv_heads, cfg.head_dim)
        q = self._rope(q, positions)
        k = self._rope(k, positions)
        kv.write(plane, layer, positions, k, v)

        group = cfg.num_heads // cfg.num_kv_heads

        def heads(t: torch.Tensor) -> torch.Tensor:
            # GQA: query head h uses kv head h // group, hence repeat_interleave.
            return t.repeat_interleave(group, dim=1).transpose(0, 1)

        exact_k, exact_v, read_k, read_v = kv.read(plane, layer, end)
        keys, vals = heads(exact_k), heads(exact_v)
        qt = q.transpose(0, 1)
        scores = qt @ keys.transpose(1, 2) / math.sqrt(cfg.head_dim)
        key_pos = torch.arange(end)
        # int4-delta: a query reads its own group's keys exactly, earlier groups coded
        own = key_pos[None, :] // kv.group_size == positions[:, None] // kv.group_size
        if kv.coded_groups:
            coded = qt @ heads(read_k).transpose(1, 2) / math.sqrt(cfg.head_dim)
            scores = torch.where(own[None], scores, coded)
        hidden = key_pos[None, :] > positions[:, None]  # [n, end]: the future
        window = cfg.windows[layer]
        if window is not None:  # HF's sliding window: the last `window` positions only
            hidden |= key_pos[None, :] <= positions[:, None] - window
        scores = scores.masked_fill(hidden[None], float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        if kv.coded_groups:
            out = (weights * own[None]) @ vals + (weights * ~own[None]) @ heads(read_v)
        else:
            out = weights @ vals  # [heads, n, hd]
        out = out.transpose(0, 1).reshape(n, cfg.num_heads * cfg.head_dim)
        return F.linear(out, w.wo)

    def _loop(
        self, h: torch.Tensor, positions: torch.Tensor, kv: DenseKV, plane: int
    ) -> torch.Tensor:
        """One loop: all L layers, then the final norm (inside the loop)."""
        for i, w in enumerate(self._layers):
            x = self._rms(h, w.norm_in)
            h = h + self._rms(self._attention(i, w, x, positions, kv, plane), w.norm_attn_out)
            x = self._rms(h, w.norm_post)
            mlp = F.linear(F.silu(F.linear(x, w.w_gate)) * F.linear(x, w.w_up), w.w_down)
            h = h + self._rms(mlp, w.norm_mlp_out)
        return self._rms(h, self._norm)

    def _gate_logit(self, h_normed: torch.Tensor) -> torch.Tensor:
        return F.linear(h_normed, self._gate_w, self._gate_b).reshape(())

    def _coda(self, h_normed: torch.Tensor) -> torch.Tensor:
        return F.linear(h_normed, self._lm_head)

    # ---- phases -----------------------------------------------------------------------------

    def _prefill(
        self, prompt: list[int], kv: DenseKV, layout: str, chunk_size: int | None
    ) -> torch.Tensor:
        """Run every prompt token through all D loops; return the final normed hidden [P, H].

        Chunks are atomic: a chunk runs loops 0..D-1 before the next chunk starts. With
        LAST_EXITED loop d uses plane d (chunking is then mathematically irrelevant); with
        SHARED every loop overwrites plane 0, so a later chunk reads earlier chunks' final
        version and its own current-loop version.
        """
        size = chunk_size or len(prompt)
        outs = []
        for start in range(0, len(prompt), size):
            ids = torch.tensor(prompt[start : start + size], dtype=torch.int64)
            h = self._embed[ids]
            positions = torch.arange(start, start + len(ids))
            for depth in range(self.total_ut_steps):
                plane = depth if layout == "last_exited" else 0
                h = self._loop(h, positions, kv, plane)
            outs.append(h)
        return torch.cat(outs, dim=0)

    def _prefill_sparse(
        self, prompt: list[int], kv: DenseKV, sparse: SparseSetting
    ) -> tuple[torch.Tensor, float]:
        """Token-sparse prefill (FlashLoop's LoopFreeze per window), loop by loop over the
        whole prompt; returns the final hidden [P, H] and the selection margin.

        Loops before the first retention below 1 run every token. At a sparse loop l each
        window of W tokens (anchored at 0, W, 2W, ...) keeps ``min(max(1, ceil(len * r_l)),
        kept at l - 1)`` tokens, taken from those kept at l - 1: the prompt's last token when
        the window holds it, then the highest scores ``|h(l-1) - h(l-2)| / |h(l-1)|`` (h(k)
        the output of loop k after its norm, h(-1) the embedding), ties to the lower
        position. A frozen token keeps its hidden state, and its K/V at plane l is its K/V
        at plane l - 1; kept tokens attend over every prompt key of plane l.
        """
        num = len(prompt)
        last = num - 1
        h = self._embed[torch.tensor(prompt, dtype=torch.int64)]
        before = h  # h(l-2) once h is h(l-1)
        first_sparse = next(
            (i for i, r in enumerate(sparse.retention) if r < 1.0), len(sparse.retention)
        )
        windows = [
            list(range(s, min(s + sparse.window, num))) for s in range(0, num, sparse.window)
        ]
        kept = [list(w) for w in windows]
        margin = math.inf
        everything = torch.arange(num)
        for loop in range(self.total_ut_steps):
            if loop < first_sparse:
                before, h = h, self._loop(h, everything, kv, loop)
                continue
            hf = h.float()
            score = torch.linalg.vector_norm(
                hf - before.float(), dim=-1
            ) / torch.linalg.vector_norm(hf, dim=-1).clamp_min(1e-12)
            values = score.tolist()
            for i, window in enumerate(windows):
                count = min(max(1, math.ceil(len(window) * sparse.retention[loop])), len(kept[i]))
                forced = [last] if last in window else []
                ranked = sorted((p for p in kept[i] if p != last), key=lambda p: (-values[p], p))
                take = count - len(forced)
                if 0 < take < len(ranked):
                    margin = min(margin, values[ranked[take - 1]] - values[ranked[take]])
                kept[i] = sorted(forced + ranked[:take])
            # every token's plane-l K/V starts as its plane-(l-1) K/V; kept tokens overwrite it
            for layer in range(len(self._layers)):
                kv.k[loop][layer][:num] = kv.k[loop - 1][layer][:num]
                kv.v[loop][layer][:num] = kv.v[loop - 1][layer][:num]
            active = torch.tensor(sorted(p for group in kept for p in group), dtype=torch.int64)
            frozen = torch.ones(num, dtype=torch.bool)
            frozen[active] = False
            kv.freeze(loop, frozen.nonzero().flatten())
            out = h.clone()
            out[active] = self._loop(h[active], active, kv, loop)
            before, h = h, out
        return h, margin

    def prompt_logits(
        self,
        prompt_token_ids: Sequence[int],
        *,
        kv_layout: str = "last_exited",
        prefill_chunk_size: int | None = None,
        kv_cache_dtype: str = "auto",
        kv_block_size: int = 16,
        kv_int4_anchor_every: int = 0,
    ) -> torch.Tensor:
        """Full-depth logits [P, V] for every prompt position (debug/tests)."""
        prompt = self._check_tokens(prompt_token_ids)
        layout = self._check_layout(kv_layout)
        self._check_positions(len(prompt))
        kv = self._new_kv(layout, len(prompt), kv_cache_dtype, kv_block_size, kv_int4_anchor_every)
        return self._coda(self._prefill(prompt, kv, layout, prefill_chunk_size))

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        *,
        max_tokens: int | None = None,
        min_loops: int = 2,
        max_loops: int | None = None,
        exit_threshold: float | None = None,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        kv_layout: str = "last_exited",
        prefill_chunk_size: int | None = None,
        sampler: Sampler | None = None,
        forced_exit_depths: Sequence[int] | None = None,
        max_loops_per_token: Sequence[int] | None = None,
        sparse_prefill: SparseSetting | None = None,
        kv_cache_dtype: str = "auto",
        kv_block_size: int = 16,
        kv_int4_anchor_every: int = 0,
        kv_jitter_seed: int | None = None,
    ) -> OracleResult:
        """Generate up to ``max_tokens`` tokens for one request.

        ``sampler(logits_f32[V], output_index) -> token`` defaults to greedy argmax (lowest
        index on exact ties). ``forced_exit_depths[i]`` (i >= 1) makes generated token i exit
        after exactly that many loops instead of following the policy; entry 0 is ignored
        because the first token always comes from the full-depth prefill.
        ``max_loops_per_token[i]`` (i >= 1) replaces ``max_loops`` for generated token i (a
        depth budget the engine's overload shedding gave it); entry 0 is ignored too.
        ``sparse_prefill`` runs the prompt token-sparse (``_prefill_sparse``).
        ``kv_cache_dtype`` applies a KV codec (``auto``, ``fp8``, ``int4-delta``: see
        ``services/oracle/dense_kv.py``); int4-delta groups keys by ``kv_block_size``
        positions, the engine's block size, and codes every ``kv_int4_anchor_every``-th
        plane on its own (0: plane 0 only). ``kv_jitter_seed`` perturbs every K/V written
        at float32's resolution (``DenseKV``): tests tell a codec's rounding flip from a
        real difference with it. Unset
        ``max_tokens`` / ``exit_threshold`` take the checkpoint's defaults
        (generation_config.json's max_new_tokens, else 16; config.json's early_exit_threshold).
        """
        D = self.total_ut_steps
        if max_tokens is None:
            max_tokens = self._cfg.default_max_tokens
        if exit_threshold is None:
            exit_threshold = self._cfg.early_exit_threshold
        prompt = self._check_tokens(prompt_token_ids)
        layout = self._check_layout(kv_layout)
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        max_loops = D if max_loops is None else max_loops
        if not 1 <= max_loops <= D:
            raise ValueError(f"max_loops must be in [1, {D}], got {max_loops}")
        if min_loops < 1:
            raise ValueError(f"min_loops must be >= 1, got {min_loops}")
        if not 0.0 <= exit_threshold <= 1.0:
            raise ValueError(f"exit_threshold must be in [0, 1], got {exit_threshold}")
        if prefill_chunk_size is not None and prefill_chunk_size < 1:
            raise ValueError(f"prefill_chunk_size must be >= 1, got {prefill_chunk_size}")
        # The last sampled token is never fed back, so positions reach P + max_tokens - 2.
        self._check_positions(len(prompt) + max_tokens - 1)
        sample = sampler or _greedy
        stops = set(stop_token_ids)
        if not ignore_eos:
            stops.update(self.eos_token_ids)

        capacity = len(prompt) + max_tokens
        kv = self._new_kv(
            layout, capacity, kv_cache_dtype, kv_block_size, kv_int4_anchor_every, kv_jitter_seed
        )
        margin = math.inf
        if sparse_prefill is None:
            h_prompt = self._prefill(prompt, kv, layout, prefill_chunk_size)
        else:
            self._check_sparse(sparse_prefill, layout)
            h_prompt, margin = self._prefill_sparse(prompt, kv, sparse_prefill)
        # Coda on a [1, H] row, the same op shape as every decode step.
        logits = self._coda(h_prompt[-1:])[0]
        token = self._sample(sample, logits, 0)
        steps = [_step(token, D, logits, math.inf)]

        while True:
            if token in stops:
                finish = "stop"
                break
            if len(steps) >= max_tokens:
                finish = "length"
                break
            index = len(steps)
            position = len(prompt) + index - 1
            forced = None
            if forced_exit_depths is not None:
                if index >= len(forced_exit_depths):
                    raise ValueError(f"forced_exit_depths has no entry for token {index}")
                forced = int(forced_exit_depths[index])
                if not 1 <= forced <= D:
                    raise ValueError(f"forced exit depth {forced} not in [1, {D}]")
            cap = max_loops
            if max_loops_per_token is not None:
                if index >= len(max_loops_per_token):
                    raise ValueError(f"max_loops_per_token has no entry for token {index}")
                cap = int(max_loops_per_token[index])
                if not 1 <= cap <= D:
                    raise ValueError(f"max_loops_per_token entry {cap} not in [1, {D}]")
            tracker = ExitTracker(min_loops, cap, exit_threshold)
            h = self._embed[torch.tensor([token])]
            for r in range(1, D + 1):
                plane = r - 1 if layout == "last_exited" else 0
                h = self._loop(h, torch.tensor([position]), kv, plane)
                # Always update the tracker so the margin diagnostic stays meaningful.
                policy_exit = tracker.observe(self._gate_logit(h))
                if (r == forced) if forced is not None else policy_exit:
                    break
            exit_depth = r
            if layout == "last_exited" and exit_depth < D:
                kv.copy_up(position, exit_depth - 1)
            logits = self._coda(h[0])
            token = self._sample(sample, logits, index)
            steps.append(_step(token, exit_depth, logits, tracker.margin))

        return OracleResult(
            token_ids=[s.token_id for s in steps],
            exit_depths=[s.exit_depth for s in steps],
            finish_reason=finish,
            steps=steps,
            selection_margin=margin,
        )

    # ---- helpers ----------------------------------------------------------------------------

    def _new_kv(
        self,
        layout: str,
        capacity: int,
        codec: str,
        block_size: int,
        anchor_every: int = 0,
        jitter_seed: int | None = None,
    ) -> DenseKV:
        planes = self.total_ut_steps if layout == "last_exited" else 1
        cfg = self._cfg
        if block_size < 1:
            raise ValueError(f"kv_block_size must be >= 1, got {block_size}")
        return DenseKV(
            planes,
            cfg.num_layers,
            capacity,
            cfg.num_kv_heads,
            cfg.head_dim,
            codec,
            block_size,
            anchor_every,
            jitter_seed,
        )

    def _check_sparse(self, sparse: SparseSetting, layout: str) -> None:
        if layout != "last_exited":
            raise ValueError("token-sparse prefill needs the last_exited KV layout")
        if sparse.window < 1:
            raise ValueError(f"sparse window must be >= 1, got {sparse.window}")
        ratios = list(sparse.retention)
        if len(ratios) != self.total_ut_steps or ratios[0] != 1.0:
            raise ValueError(f"retention needs {self.total_ut_steps} entries, the first 1")
        if not all(0.0 < r <= 1.0 for r in ratios):
            raise ValueError(f"retention entries must be in (0, 1], got {ratios}")

    def _check_tokens(self, ids: Sequence[int]) -> list[int]:
        tokens = [int(t) for t in ids]
        if not tokens:
            raise ValueError("prompt must contain at least one token")
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        return tokens

    def _check_positions(self, count: int) -> None:
        if count > self.max_position_embeddings:
            raise ValueError(
                f"{count} positions exceed max_position_embeddings={self.max_position_embeddings}"
            )

    @staticmethod
    def _check_layout(kv_layout: str) -> str:
        layout = kv_layout.lower()
        if layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
        return layout

    def _sample(self, sample: Sampler, logits: torch.Tensor, index: int) -> int:
        token = int(sample(logits, index))
        if not 0 <= token < self.vocab_size:
            raise ValueError(f"sampler returned out-of-range token {token}")
        return token


def _greedy(logits: torch.Tensor, _index: int) -> int:
    # torch.argmax returns the first maximal index, i.e. the lowest id on exact ties.
    return int(torch.argmax(logits))


def _step(token: int, exit_depth: int, logits: torch.Tensor, margin: float) -> OracleStep:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values, ids = torch.topk(logprobs, min(TOP_LOGPROBS, logprobs.numel()))
    return OracleStep(
        token,
        exit_depth,
        _top2_gap(logits),
        margin,
        logprob=float(logprobs[token]),
        top_logprobs=list(zip(ids.tolist(), values.tolist(), strict=True)),
    )


def _top2_gap(logits: torch.Tensor) -> float:
    if logits.numel() < 2:
        return math.inf
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])
