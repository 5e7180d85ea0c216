"""The looped model as a trainable module: every loop over whole sequences at once.

Parameter names are those of Hugging Face's Ouro checkpoints, so ``state_dict()`` is the
checkpoint. The math is the serving model's (sandwich norms, split-half RoPE at the same
position in every loop, the final norm inside each loop, whose output both feeds the next
loop and is read by the exit gate and lm_head); ``tests/test_train.py`` holds it equal to
the serial oracle on an exported checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from services.common.model_config import OuroConfig


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class Attention(nn.Module):
    def __init__(self, cfg: OuroConfig) -> None:
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            hd,
        )
        self.q_proj = nn.Linear(h, self.heads * hd, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.heads * hd, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: OuroConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: OuroConfig) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(h, eps)
        self.input_layernorm_2 = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm_2 = RMSNorm(h, eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(h), cos, sin)
        h = h + self.input_layernorm_2(attn)
        return h + self.post_attention_layernorm_2(self.mlp(self.post_attention_layernorm(h)))


class Backbone(nn.Module):
    """``model.*`` of the checkpoint: embedding, the shared layers, final norm, exit gate."""

    def __init__(self, cfg: OuroConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.early_exit_gate = nn.Linear(cfg.hidden_size, 1)


@dataclass
class LoopOutputs:
    hidden: list[torch.Tensor]  # per loop: the normed loop output [B, T, H]
    gate_logits: torch.Tensor  # [loops, B, T]


class LoopedLM(nn.Module):
    def __init__(self, cfg: OuroConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )
        exponents = torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim
        self.register_buffer("inv_freq", 1.0 / (cfg.rope_theta**exponents), persistent=False)

    @classmethod
    def from_checkpoint(cls, checkpoint: Path) -> LoopedLM:
        """A single-file float32 checkpoint (what ``rlt train`` writes), strictly loaded."""
        model = cls(OuroConfig.from_checkpoint(checkpoint))
        model.load_state_dict(load_file(str(Path(checkpoint) / "model.safetensors")), strict=True)
        return model.eval()

    def init_weights(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            with torch.no_grad():
                if "layernorm" in name or name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name == "model.early_exit_gate.bias":
                    p.fill_(-1.0)  # exit hazard ~0.27 per loop: every loop gets weight at first
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)

    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def loops(self, ids: torch.Tensor, num_loops: int | None = None) -> LoopOutputs:
        t = ids.shape[1]
        freqs = torch.arange(t, dtype=torch.float32, device=ids.device)[:, None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        h = self.model.embed_tokens(ids)
        hidden, gates = [], []
        for _ in range(num_loops or self.cfg.total_ut_steps):
            for layer in self.model.layers:
                h = layer(h, cos, sin)
            h = self.model.norm(h)
            hidden.append(h)
            gates.append(self.model.early_exit_gate(h).squeeze(-1))
        return LoopOutputs(hidden, torch.stack(gates))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.head_weight())


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
