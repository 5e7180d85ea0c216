"""Attention and KV-cache kernels (torch reference implementations)."""

from kernels.flash import flash_attn_available
from kernels.kv_ops import copy_kv_slots, exit_copy_slots, slot_of, write_kv
from kernels.paged_attention import (
    AttentionMetadata,
    Segment,
    build_attention_metadata,
    check_cache_shape,
    paged_attention,
)

__all__ = [
    "AttentionMetadata",
    "Segment",
    "build_attention_metadata",
    "check_cache_shape",
    "copy_kv_slots",
    "exit_copy_slots",
    "flash_attn_available",
    "paged_attention",
    "slot_of",
    "write_kv",
]
