"""A module written for the tests with the structure of Hugging Face's Ouro code
(``modeling_ouro.py``, remote code on the Hub that cannot be fetched here): the same module
names, forward arguments and cache indexing (``loop * num_layers + layer``), and Ouro's layer
math. It is not HF's file. FlashLoop's reference hooks these modules, and the trained
checkpoint's tests compare rlt's greedy tokens with its ``greedy``.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn


class _RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.clone(), requires_grad=False)
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        x = hidden_states.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


def _linear(weight: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    layer.weight = nn.Parameter(weight.clone(), requires_grad=False)
    return layer


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Attention(nn.Module):
    """HF's OuroAttention interface: q/k/v/o_proj, head_dim, num_key_value_groups, scaling;
    forward(hidden_states, position_embeddings, attention_mask, past_key_value,
    cache_position, current_ut) writing the cache at ``current_ut * layers + layer``."""

    def __init__(self, config: Any, weights: dict[str, torch.Tensor], prefix: str, layer: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        for name in ("q", "k", "v", "o"):
            setattr(self, f"{name}_proj", _linear(weights[f"{prefix}{name}_proj.weight"]))

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        past_key_value: Any = None,
        cache_position: torch.Tensor | None = None,
        current_ut: int = 0,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        batch, tokens, _ = hidden_states.shape
        shape = (batch, tokens, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        cos, sin = (t.unsqueeze(1) for t in position_embeddings)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        index = current_ut * self.config.num_hidden_layers + self.layer_idx
        k, v = past_key_value.update(k, v, index, {"cos": cos, "sin": sin})
        groups = self.num_key_value_groups
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        logits = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        if attention_mask is not None:
            logits = logits + attention_mask[:, :, :, : k.shape[-2]]
        weights = F.softmax(logits, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(weights, v).transpose(1, 2).reshape(batch, tokens, -1)
        return self.o_proj(out), weights


class _MLP(nn.Module):
    def __init__(self, weights: dict[str, torch.Tensor], prefix: str) -> None:
        super().__init__()
        for name in ("gate", "up", "down"):
            setattr(self, f"{name}_proj", _linear(weights[f"{prefix}{name}_proj.weight"]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _DecoderLayer(nn.Module):
    """HF's OuroDecoderLayer: sandwich norms around attention and the MLP."""

    def __init__(self, config: Any, weights: dict[str, torch.Tensor], layer: int) -> None:
        super().__init__()
        p = f"model.layers.{layer}."
        self.self_attn = _Attention(config, weights, p + "self_attn.", layer)
        self.mlp = _MLP(weights, p + "mlp.")
        eps = config.rms_norm_eps
        for name in (
            "input_layernorm",
            "input_layernorm_2",
            "post_attention_layernorm",
            "post_attention_layernorm_2",
        ):
            setattr(self, name, _RMSNorm(weights[f"{p}{name}.weight"], eps))

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_value: Any = None,
        use_cache: bool = False,
        cache_position: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        residual = hidden_states
        attn, _ = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states),
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_value=past_key_value,
            use_cache=use_cache,
            cache_position=cache_position,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states = residual + self.input_layernorm_2(attn)
        residual = hidden_states
        mlp = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + self.post_attention_layernorm_2(mlp)


class _LoopCache:
    """HF's UniversalTransformerCache interface: one K/V entry per (loop, layer)."""

    def __init__(self) -> None:
        self.key_cache: list[torch.Tensor | None] = []
        self.value_cache: list[torch.Tensor | None] = []

    def update(
        self, key: torch.Tensor, value: torch.Tensor, index: int, _kwargs: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        while len(self.key_cache) <= index:
            self.key_cache.append(None)
            self.value_cache.append(None)
        old_k, old_v = self.key_cache[index], self.value_cache[index]
        self.key_cache[index] = key if old_k is None else torch.cat([old_k, key], dim=2)
        self.value_cache[index] = value if old_v is None else torch.cat([old_v, value], dim=2)
        return self.key_cache[index], self.value_cache[index]

    def get_seq_length(self) -> int:
        return 0 if not self.key_cache or self.key_cache[0] is None else self.key_cache[0].shape[2]


class _Backbone(nn.Module):
    """HF's OuroModel: embed_tokens, layers, norm (applied after every loop), the gate."""

    def __init__(self, config: Any, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding.from_pretrained(weights["model.embed_tokens.weight"])
        self.layers = nn.ModuleList(
            _DecoderLayer(config, weights, i) for i in range(config.num_hidden_layers)
        )
        self.norm = _RMSNorm(weights["model.norm.weight"], config.rms_norm_eps)
        hd = config.hidden_size // config.num_attention_heads
        self.inv_freq = 1.0 / (
            config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd)
        )

    def forward(self, input_ids: torch.Tensor, cache: _LoopCache) -> torch.Tensor:
        past = cache.get_seq_length()
        tokens = input_ids.shape[1]
        cache_position = torch.arange(past, past + tokens)
        position_ids = cache_position.unsqueeze(0)
        freqs = (self.inv_freq[None, :, None] @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        position_embeddings = (emb.cos(), emb.sin())
        future = torch.arange(past + tokens)[None, :] > cache_position[:, None]
        mask = torch.zeros(future.shape).masked_fill(future, torch.finfo(torch.float32).min)
        mask = mask[None, None]
        hidden = self.embed_tokens(input_ids)
        for current_ut in range(self.config.total_ut_steps):
            for layer in self.layers:
                hidden = layer(
                    hidden,
                    attention_mask=mask,
                    position_ids=position_ids,
                    past_key_value=cache,
                    use_cache=True,
                    cache_position=cache_position,
                    position_embeddings=position_embeddings,
                    current_ut=current_ut,
                )
            hidden = self.norm(hidden)
        return hidden


class HostedOuro(nn.Module):
    """HF's OuroForCausalLM shape: ``.model`` (the backbone), ``.lm_head``, ``.config``."""

    def __init__(self, checkpoint: Path) -> None:
        super().__init__()
        raw = json.loads((checkpoint / "config.json").read_text())
        self.config = SimpleNamespace(**raw)
        weights = load_file(str(checkpoint / "model.safetensors"))
        weights = {k: v.float() for k, v in weights.items()}
        self.model = _Backbone(self.config, weights)
        # HF ties lm_head to the embedding when the config says so (no lm_head.weight saved)
        tied = getattr(self.config, "tie_word_embeddings", False)
        head = weights["model.embed_tokens.weight"] if tied else weights["lm_head.weight"]
        self.lm_head = _linear(head)

    @torch.no_grad()
    def greedy(self, prompt: list[int], new_tokens: int) -> tuple[torch.Tensor, list[int]]:
        """First-token log-probabilities at full depth, and ``new_tokens`` greedy tokens."""
        cache = _LoopCache()
        hidden = self.model(torch.tensor([prompt]), cache)
        logits = self.lm_head(hidden[0, -1])
        first = torch.log_softmax(logits.float(), dim=-1)
        tokens = [int(torch.argmax(logits))]
        while len(tokens) < new_tokens:
            hidden = self.model(torch.tensor([[tokens[-1]]]), cache)
            tokens.append(int(torch.argmax(self.lm_head(hidden[0, -1]))))
        return first, tokens
