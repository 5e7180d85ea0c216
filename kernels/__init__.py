"""Attention and KV-cache kernels (torch reference implementations plus SDPA / flash-attn)."""

from kernels.backends import (
    BACKEND_NAMES,
    AttentionBackend,
    FlashBackend,
    ReferenceBackend,
    SdpaBackend,
    select_attention_backend,
)
from kernels.flash import flash_attn_available, flash_attn_version, flash_unsupported_reason
from kernels.kv_ops import copy_kv_slots, exit_copy_slots, slot_of, write_kv
from kernels.paged_attention import (
    AttentionMetadata,
    Segment,
    build_attention_metadata,
    check_cache_shape,
    paged_attention,
)
from kernels.sdpa_attention import sdpa_paged_attention

__all__ = [
    "BACKEND_NAMES",
    "AttentionBackend",
    "AttentionMetadata",
    "FlashBackend",
    "ReferenceBackend",
    "SdpaBackend",
    "Segment",
    "build_attention_metadata",
    "check_cache_shape",
    "copy_kv_slots",
    "exit_copy_slots",
    "flash_attn_available",
    "flash_attn_version",
    "flash_unsupported_reason",
    "paged_attention",
    "sdpa_paged_attention",
    "select_attention_backend",
    "slot_of",
    "write_kv",
]
