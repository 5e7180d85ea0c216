"""Shapes of the random checkpoints rlt writes (``rlt toy-checkpoint --size``, ``rlt bench``).

Import-light on purpose: the CLI builds its argument choices from ``CHECKPOINT_SIZES``
without importing torch.
"""

from __future__ import annotations

_COMMON: dict[str, int | float | bool] = {
    "max_position_embeddings": 2048,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "total_ut_steps": 4,
    "early_exit_threshold": 1.0,
    "tie_word_embeddings": False,
}

CHECKPOINT_SIZES: dict[str, dict[str, int | float | bool]] = {
    # seconds-fast on CPU: unit and integration tests
    "toy": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        **_COMMON,
    },
    # large enough that batching shows on CPU: the committed CPU benchmarks
    "small": {
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "vocab_size": 2048,
        **_COMMON,
    },
    # the published Ouro-1.4B shape (head_dim 128), random weights: GPU benchmarks
    "1.4b": {
        **_COMMON,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "vocab_size": 49152,
        "max_position_embeddings": 4096,
    },
}

# dtype a size is written in unless the caller asks otherwise (1.4b in float32 is 5.7 GB)
DEFAULT_DTYPE: dict[str, str] = {"toy": "float32", "small": "float32", "1.4b": "bfloat16"}
