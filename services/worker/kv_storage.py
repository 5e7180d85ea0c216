"""The runner's KV storage for a codec, and the decode mode it allows.

``auto`` keeps K/V in the model dtype (bf16/fp16 on CUDA), read as is; ``fp8`` keeps codes
and scales (``PagedKV``); ``int4-delta`` keeps codes, scales and full-precision tails for
the open blocks (``Int4KV``)."""

from __future__ import annotations

from kernels.kv_codec import AUTO, DEFAULT_BATCH_LIMITS, INT4_DELTA, BatchLimits
from services.common.config import KVLayout
from services.worker.kv_cache import PagedKV
from services.worker.kv_int4.paged import Int4KV
from services.worker.model.ouro import OuroModel
from services.worker.passes.static_decode import DecodeMode


def build_kv(
    model: OuroModel,
    num_blocks: int,
    block_size: int,
    kv_layout: KVLayout,
    kv_cache_dtype: str,
    kv_int4_anchor_every: int,
    limits: BatchLimits = DEFAULT_BATCH_LIMITS,
) -> PagedKV | Int4KV:
    """KV for ``num_blocks`` of the scheduler's blocks plus one: padding rows of a static
    pass write into the last. ``limits``: the scheduler's (int4-delta's tail reserve)."""
    cfg = model.cfg
    shape = (
        cfg.num_hidden_layers,
        num_blocks + 1,
        block_size,
        cfg.num_key_value_heads,
        cfg.head_dim,
    )
    if kv_cache_dtype == INT4_DELTA:
        planes = cfg.total_ut_steps if kv_layout == KVLayout.LAST_EXITED else 1
        return Int4KV(
            *shape,
            dtype=model.dtype,
            device=model.device,
            planes=planes,
            anchor_every=kv_int4_anchor_every,
            limits=limits,
        )
    return PagedKV(kv_cache_dtype, *shape, dtype=model.dtype, device=model.device)


def decode_mode_for(model: OuroModel, asked: DecodeMode | None, kv_cache_dtype: str) -> DecodeMode:
    """The decode mode a runner uses: ``asked`` (else the device's default), as far as the
    device and the codec allow it."""
    mode = asked or DecodeMode.default_for(model.device)
    if mode is DecodeMode.GRAPHS and model.device.type != "cuda":
        mode = DecodeMode.PADDED  # graphs need CUDA: the same static passes, eagerly
    if kv_cache_dtype == INT4_DELTA:
        return DecodeMode.EAGER  # each pass plans its tails and seals on the host
    if mode is DecodeMode.GRAPHS and kv_cache_dtype != AUTO:
        # fp8's ops are sync-free with Triton (checked under the interpreter), but no GPU
        # run has captured them yet: the same static passes, eagerly, until one does
        mode = DecodeMode.PADDED
    return mode
