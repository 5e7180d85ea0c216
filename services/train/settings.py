"""``rlt train``'s settings: the model's shape and the run's (no torch, so the CLI's parser
can read them without loading it)."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.model_config import OuroConfig


@dataclass(frozen=True)
class TrainSettings:
    minutes: float = 60.0
    seed: int = 0
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    total_ut_steps: int = 4
    seq_len: int = 512
    batch_size: int = 8
    lr: float = 3e-3
    warmup_steps: int = 100
    weight_decay: float = 0.05
    # stage 1's entropy weight, annealed from beta_start to beta (the exit distribution's
    # optimum is ~exp(-loss/beta): a small beta while deep loops still trail would leave them
    # without weight, and since loops share weights they would never catch up)
    beta_start: float = 1.0
    beta: float = 0.1
    stage2_share: float = 0.1  # the last share of the minutes trains the gate alone
    threads: int = 2
    bf16: bool = True
    save_every_s: float = 180.0
    eval_every_s: float = 240.0
    max_position_embeddings: int = 2048
    max_steps: int = 0  # stop after this many steps too (0: only minutes bound the run)

    def model_config(self) -> OuroConfig:
        return OuroConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            vocab_size=self.vocab_size,
            rms_norm_eps=1e-6,
            rope_theta=1_000_000.0,
            max_position_embeddings=self.max_position_embeddings,
            total_ut_steps=self.total_ut_steps,
            early_exit_threshold=1.0,
            tie_word_embeddings=True,
            eos_token_ids=(0,),
            bos_token_id=0,
            head_dim=self.hidden_size // self.num_attention_heads,
        )
