"""Ouro looped LM forward pass, split into prelude / one core loop / coda.

Each fused step of a layer is one op of ``kernels.ops`` (a torch reference on CPU, a Triton
kernel on CUDA), so a layer costs nine kernel launches: two matmuls in, RoPE + the paged KV
write, paged attention, the output matmul, the sandwich norm step, the MLP's two matmuls
around SiLU x mul, and the second sandwich norm step (which also applies the next layer's
input norm, or the final norm after the last layer).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F

from kernels.ops import (
    add_rms_norm,
    paged_attention,
    rms_norm,
    rope_write_kv,
    rope_write_kv_fp8,
    silu_mul,
)
from services.common.model_config import OuroConfig

from .loader import CheckpointError, expected_shapes, load_checkpoint


class PassAttention(NamedTuple):
    """Where one core pass's rows sit in the paged KV cache (device tensors, int32)."""

    slot_mapping: torch.Tensor  # [T] slot receiving each row's K/V (-1: padding, not written)
    block_tables: torch.Tensor  # [S, width] each segment's block table at its plane
    context_lens: torch.Tensor  # [S] positions a segment's last row sees (its own included)
    query_start: torch.Tensor  # [S + 1] first row of each segment
    max_query_len: int
    # [T] each row's position, when some segment holds rows at gathered positions (a
    # token-sparse loop's active tokens); None: a segment's rows end its context
    query_pos: torch.Tensor | None = None


class LayerAttention(Protocol):
    """A codec with KV storage of its own (int4-delta): one layer's KV write and attention,
    given its fused qkv rows; returns the attention output [T, nh, hd]."""

    def layer(
        self,
        idx: int,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: PassAttention,
        num_heads: int,
        num_kv_heads: int,
        scale: float,
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class _Layer:
    # q/k/v and gate/up are fused so each layer does two input matmuls instead of five.
    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    ln_in: torch.Tensor
    ln_in_2: torch.Tensor
    ln_post: torch.Tensor
    ln_post_2: torch.Tensor


class OuroModel:
    cfg: OuroConfig
    dtype: torch.dtype
    device: torch.device

    def __init__(self, cfg: OuroConfig, weights: dict[str, torch.Tensor]) -> None:
        shapes = expected_shapes(cfg)
        weights = dict(weights)
        embed_w = weights.get("model.embed_tokens.weight")
        if cfg.tie_word_embeddings and "lm_head.weight" not in weights and embed_w is not None:
            weights["lm_head.weight"] = embed_w
        for name, shape in shapes.items():
            t = weights.get(name)
            if t is None:
                raise CheckpointError(f"{name}: missing tensor")
            if tuple(t.shape) != shape:
                raise CheckpointError(f"{name}: expected shape {shape}, found {tuple(t.shape)}")
        extra = sorted(set(weights) - set(shapes))
        if extra:
            raise CheckpointError(f"{extra[0]}: unexpected tensor")

        embed = weights["model.embed_tokens.weight"]
        self.cfg = cfg
        self.dtype = embed.dtype
        self.device = embed.device
        for name, t in weights.items():
            if t.dtype != self.dtype or t.device != self.device:
                raise CheckpointError(
                    f"{name}: dtype/device {t.dtype}/{t.device} differs from "
                    f"embedding {self.dtype}/{self.device}"
                )

        self.hidden_size = cfg.hidden_size
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.vocab_size = cfg.vocab_size
        self.eps = cfg.rms_norm_eps

        self.embed = embed
        self.lm_head = weights["lm_head.weight"]
        self.final_norm = weights["model.norm.weight"]
        # Gate in float32: exit decisions threshold a cdf, so keep its logit precise.
        self.gate_w = weights["model.early_exit_gate.weight"].float()
        self.gate_b = weights["model.early_exit_gate.bias"].float()
        self.layers: list[_Layer] = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}"
            self.layers.append(
                _Layer(
                    qkv=torch.cat(
                        [weights[f"{p}.self_attn.{n}_proj.weight"] for n in ("q", "k", "v")]
                    ),
                    o=weights[f"{p}.self_attn.o_proj.weight"],
                    gate_up=torch.cat(
                        [weights[f"{p}.mlp.gate_proj.weight"], weights[f"{p}.mlp.up_proj.weight"]]
                    ),
                    down=weights[f"{p}.mlp.down_proj.weight"],
                    ln_in=weights[f"{p}.input_layernorm.weight"],
                    ln_in_2=weights[f"{p}.input_layernorm_2.weight"],
                    ln_post=weights[f"{p}.post_attention_layernorm.weight"],
                    ln_post_2=weights[f"{p}.post_attention_layernorm_2.weight"],
                )
            )
        # Same formula as the HF rotary embedding (int arange, then float) for bitwise parity.
        hd = cfg.head_dim
        self.inv_freq = 1.0 / (
            cfg.rope_theta
            ** (torch.arange(0, hd, 2, dtype=torch.int64, device=self.device).float() / hd)
        )
        # cos/sin of every position, so a pass looks its rows up (two gathers) instead of
        # computing them; the same float32 products as the HF rotary embedding, then cast
        angles = (
            torch.arange(cfg.max_position_embeddings, device=self.device).float()[:, None]
            * self.inv_freq[None, :]
        )
        emb = torch.cat((angles, angles), dim=-1)
        self.cos_table = emb.cos().to(self.dtype)
        self.sin_table = emb.sin().to(self.dtype)
        self.scale = hd**-0.5

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        max_position_embeddings: int | None = None,
    ) -> OuroModel:
        """``max_position_embeddings``: positions the model serves (its RoPE table), if not
        the checkpoint's (a benchmark at longer contexts than a random checkpoint declares)."""
        cfg, weights = load_checkpoint(path, dtype=dtype)
        if max_position_embeddings is not None:
            cfg = replace(cfg, max_position_embeddings=max_position_embeddings)
        dev = torch.device(device)
        # Preserve tying (one tensor, not two copies) across the device move.
        moved: dict[int, torch.Tensor] = {}
        on_dev: dict[str, torch.Tensor] = {}
        for name, t in weights.items():
            key = id(t)
            if key not in moved:
                moved[key] = t.to(dev)
            on_dev[name] = moved[key]
        return cls(cfg, on_dev)

    def prelude(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, H] hidden states (embedding only; ids must be < vocab_size)."""
        return F.embedding(token_ids.to(self.device), self.embed)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, hd] in the model dtype for int ``positions`` [T] on the device."""
        return self.cos_table.index_select(0, positions), self.sin_table.index_select(0, positions)

    def core_loop(
        self,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        attn: PassAttention,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        int4: LayerAttention | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One loop of all L layers over packed rows, then the final norm and the exit gate.

        ``k_cache`` / ``v_cache``: [L, blocks, block_size, kv_heads, head_dim]; each layer
        writes its rows' K/V there and attends through the block tables. With ``k_scale`` /
        ``v_scale`` [L, blocks, block_size, kv_heads] the caches are the fp8 codec's e4m3 codes:
        K/V are quantised as they are written and dequantised as attention reads them.
        With ``int4`` (int4-delta) that pass's KV writes, sealing and attention replace
        the caches' (``services/worker/kv_int4/paged.py``).
        Returns (normed h [T, H] in the model dtype, gate logits float32 [T]). The normed h is
        both the next loop's input and the coda's input if the row exits here.
        """
        t = h.shape[0]
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        cos, sin = rope
        layers = self.layers
        x = rms_norm(h, layers[0].ln_in, self.eps)
        for idx, layer in enumerate(layers):
            qkv = F.linear(x, layer.qkv)
            ks = vs = None
            if int4 is not None:
                a = int4.layer(idx, qkv, cos, sin, attn, nh, nkv, self.scale)
            elif k_scale is None or v_scale is None:
                q = rope_write_kv(
                    qkv, cos, sin, k_cache[idx], v_cache[idx], attn.slot_mapping, nh, nkv
                )
            else:
                ks, vs = k_scale[idx], v_scale[idx]
                q = rope_write_kv_fp8(
                    qkv, cos, sin, k_cache[idx], v_cache[idx], ks, vs, attn.slot_mapping, nh, nkv
                )
            if int4 is None:
                a = paged_attention(
                    q,
                    k_cache[idx],
                    v_cache[idx],
                    attn.block_tables,
                    attn.context_lens,
                    attn.query_start,
                    self.scale,
                    attn.max_query_len,
                    attn.query_pos,
                    ks,
                    vs,
                )
            a = F.linear(a.view(t, nh * hd), layer.o)
            h, x = add_rms_norm(h, a, layer.ln_in_2, layer.ln_post, self.eps)
            m = F.linear(silu_mul(F.linear(x, layer.gate_up)), layer.down)
            w_next = layers[idx + 1].ln_in if idx + 1 < len(layers) else self.final_norm
            h, x = add_rms_norm(h, m, layer.ln_post_2, w_next, self.eps)
        gate_logits = F.linear(x.float(), self.gate_w, self.gate_b).view(t)
        return x, gate_logits

    def coda(self, h: torch.Tensor) -> torch.Tensor:
        """[N, H] exited (already normed) hidden -> float32 logits [N, V]."""
        return F.linear(h, self.lm_head).float()


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Reference causal attention for one sequence: q [Tq, nh, hd], k/v [Tk, nkv, hd], where the
    queries are the last Tq of the Tk positions (all earlier keys visible)."""
    tq, nh, hd = q.shape
    tk, nkv, _ = k.shape
    num_past = tk - tq
    rep = nh // nkv
    # GQA: query head j reads kv head j // rep.
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) / (hd**0.5)
    qpos = torch.arange(tq, device=q.device)[:, None] + num_past
    kpos = torch.arange(tk, device=q.device)[None, :]
    scores = scores.masked_fill(kpos > qpos, float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float())
    return out.to(q.dtype)
