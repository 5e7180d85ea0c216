"""Ouro looped LM forward pass, split into prelude / one core loop / coda.

The caller (worker) owns KV storage and attention: each layer hands its rotated q/k and v to an
``attend`` callback, so the same math serves paged batched serving and a dense test oracle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from services.common.model_config import OuroConfig

from .loader import CheckpointError, expected_shapes, load_checkpoint

# attend(layer_idx, q [T, n_heads, hd], k [T, n_kv_heads, hd], v [T, n_kv_heads, hd])
#   -> attention output [T, n_heads, hd]; q and k are already rotated by RoPE.
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, cast back before the weight multiply (as the HF reference does)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


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
        self._q_dim = cfg.q_dim
        self._kv_dim = cfg.kv_dim

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> OuroModel:
        cfg, weights = load_checkpoint(path, dtype=dtype)
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
        """cos, sin [T, 1, hd] in the model dtype, computed in float32."""
        angles = positions.to(self.device, torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((angles, angles), dim=-1)
        return emb.cos().to(self.dtype)[:, None, :], emb.sin().to(self.dtype)[:, None, :]

    def core_loop(
        self, h: torch.Tensor, positions: torch.Tensor, attend: AttendFn
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One loop of all L layers over packed rows, then the final norm and the exit gate.

        Returns (normed h [T, H] in the model dtype, gate logits float32 [T]). The normed h is
        both the next loop's input and the coda's input if the row exits here.
        """
        t = h.shape[0]
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        cos, sin = self.rope(positions)
        for idx, layer in enumerate(self.layers):
            x = rms_norm(h, layer.ln_in, self.eps)
            q, k, v = F.linear(x, layer.qkv).split([self._q_dim, self._kv_dim, self._kv_dim], -1)
            q = q.view(t, nh, hd)
            k = k.view(t, nkv, hd)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            a = attend(idx, q, k, v.reshape(t, nkv, hd).contiguous())
            a = F.linear(a.reshape(t, nh * hd), layer.o)
            h = h + rms_norm(a, layer.ln_in_2, self.eps)
            x = rms_norm(h, layer.ln_post, self.eps)
            gate, up = F.linear(x, layer.gate_up).chunk(2, dim=-1)
            m = F.linear(F.silu(gate) * up, layer.down)
            h = h + rms_norm(m, layer.ln_post_2, self.eps)
        h = rms_norm(h, self.final_norm, self.eps)
        gate_logits = F.linear(h.float(), self.gate_w, self.gate_b).squeeze(-1)
        return h, gate_logits

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
