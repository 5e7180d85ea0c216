"""KV cache codecs: their names, what one paged block of one plane holds, and its bytes.

A codec fixes the tensors a layer's KV storage is made of. Every field below is indexed by
the same block id (one plane's block of ``block_size`` tokens), so block tables, reference
counts and P/D transfers work per block whatever the codec; only a block's bytes change.

* ``auto``: K and V in the model's dtype (float32 in the CPU tests, bfloat16 on a GPU).
* ``fp8``: K and V as e4m3 codes (one byte each) and one float32 scale per (token, kv head),
  ``scale = amax / 448``, written when the token is written.
* ``int4-delta``: 4-bit codes, asymmetric (a scale and a zero point, float16). An *anchor*
  plane (plane 0, and every ``anchor_every``-th plane: ``j % anchor_every == 0``) codes K/V
  itself; each other plane codes its difference from the plane below *as reconstructed*.
  Plane d therefore reads back from its chain, planes ``chain_start(d) .. d``. Keys per
  channel over the block's tokens (the group is the block), values per token over groups of
  ``value_group(head_dim)`` channels. A per-token flag says whether this plane stores the
  token at all: 0 means "the same as the plane below" (a token that exited before this loop,
  or that token-sparse prefill froze at it). An anchor plane stores every token: one that
  exited below it has its K/V copied up there, so the anchor codes that copy on its own and
  a read-back never walks below its chain's anchor. A block is coded once it is full
  (*sealed*); until then its tokens sit in a full-precision *tail* block of the ``auto``
  layout (one per request and plane, plus the blocks a prefill chunk completes in its pass),
  counted by ``tail_bytes``.

The tail rule (``int4-delta``): a query at position q reads a key at position k exactly (from
the tail) when ``k // block_size == q // block_size`` and dequantised otherwise. It depends on
positions only, never on how the tokens were batched or chunked, so the engine and the serial
oracle agree; a block is therefore read only sealed by queries of later blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

AUTO = "auto"
FP8 = "fp8"
INT4_DELTA = "int4-delta"
CODECS = (AUTO, FP8, INT4_DELTA)

FP8_MAX = 448.0  # the largest finite e4m3 (e4m3fn) value
INT4_LEVELS = 15  # codes 0..15
# channels per value scale: FlashLoop's group of 64, or the whole head when it is smaller
VALUE_GROUP = 64

_BYTES = {"uint8": 1, "float16": 2, "float32": 4}
# int4-delta: KV memory keeps at least one full-precision tail block per this many block ids
# (one open block per plane for requests of 32 blocks), and at least what a batch can hold
# open (``open_blocks_bound``); the worker allocates more if it must
TAIL_SHARE = 32


@dataclass(frozen=True)
class Field:
    """One tensor of a block: ``shape`` per block, ``dtype`` a torch dtype name ("model" is
    the model's dtype, ``model_bytes`` wide)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def bytes(self, model_bytes: int) -> int:
        width = model_bytes if self.dtype == "model" else _BYTES[self.dtype]
        return math.prod(self.shape) * width


def chain_start(plane: int, anchor_every: int) -> int:
    """The anchor a read-back of ``plane`` starts from (int4-delta): the last plane at or
    below it that is a multiple of ``anchor_every``; 0 means plane 0 is the only anchor."""
    if anchor_every < 0:
        raise ValueError(f"int4 anchor interval must be >= 0, got {anchor_every}")
    return plane - plane % anchor_every if anchor_every else 0


def chain_planes(plane: int, anchor_every: int) -> int:
    """Planes of codes a pass at ``plane`` reads per sealed block (int4-delta)."""
    return plane - chain_start(plane, anchor_every) + 1


def codec_name(codec: str, anchor_every: int, planes: int) -> str:
    """How reports name a codec: int4-delta with its anchor interval (0 read as ``planes``,
    plane 0 the only anchor)."""
    if codec != INT4_DELTA:
        return codec
    return f"{codec} (anchor every {anchor_every or planes})"


def value_group(head_dim: int) -> int:
    """Channels sharing one value scale and zero point (int4-delta)."""
    return min(VALUE_GROUP, head_dim)


def check(codec: str, head_dim: int, block_size: int) -> None:
    """Raises ValueError, naming the problem, for a codec this shape cannot use."""
    if codec not in CODECS:
        raise ValueError(f"kv cache dtype must be one of {CODECS}, got {codec!r}")
    if codec == INT4_DELTA:
        if head_dim % 2 or head_dim % value_group(head_dim):
            raise ValueError(
                f"int4-delta needs an even head_dim, a multiple of 64 past 64: {head_dim}"
            )
        if block_size < 2:
            raise ValueError(f"int4-delta groups keys by block: block_size {block_size} < 2")


def block_fields(codec: str, block_size: int, kv_heads: int, head_dim: int) -> tuple[Field, ...]:
    """The tensors one block of one plane of one layer holds, in a fixed order."""
    check(codec, head_dim, block_size)
    token = (block_size, kv_heads, head_dim)
    if codec == AUTO:
        return (Field("k", token, "model"), Field("v", token, "model"))
    if codec == FP8:
        scales = (block_size, kv_heads)
        return (
            Field("k_codes", token, "uint8"),
            Field("v_codes", token, "uint8"),
            Field("k_scale", scales, "float32"),
            Field("v_scale", scales, "float32"),
        )
    packed = (block_size, kv_heads, head_dim // 2)
    per_channel = (kv_heads, head_dim)
    per_token = (block_size, kv_heads, head_dim // value_group(head_dim))
    return (
        Field("k_codes", packed, "uint8"),
        Field("v_codes", packed, "uint8"),
        Field("k_scale", per_channel, "float16"),
        Field("k_zero", per_channel, "float16"),
        Field("v_scale", per_token, "float16"),
        Field("v_zero", per_token, "float16"),
        Field("stored", (block_size,), "uint8"),
    )


def block_bytes(codec: str, block_size: int, kv_heads: int, head_dim: int, model_bytes: int) -> int:
    """Bytes of one block of one plane of one layer, scales and flags included."""
    fields = block_fields(codec, block_size, kv_heads, head_dim)
    return sum(f.bytes(model_bytes) for f in fields)


def tail_bytes(
    codec: str,
    block_size: int,
    kv_heads: int,
    head_dim: int,
    model_bytes: int,
    planes: int,
    layers: int = 1,
) -> int:
    """Bytes of one request's full-precision tail (its open block in every plane), on top of
    its blocks: int4-delta only (fp8 codes a token when it is written)."""
    if codec != INT4_DELTA:
        return 0
    return block_bytes(AUTO, block_size, kv_heads, head_dim, model_bytes) * planes * layers


@dataclass(frozen=True)
class BatchLimits:
    """The scheduler's limits on its batches (``SchedulerConfig``'s, whose defaults these
    are): how many requests run at once and how many tokens one batch takes."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048


DEFAULT_BATCH_LIMITS = BatchLimits()


def open_blocks_bound(planes: int, block_size: int, limits: BatchLimits) -> int:
    """The most blocks open at once (int4-delta tails) without token-sparse prefill.

    Per plane: after a batch every block whose tokens are all final is sealed, which leaves
    each running request at most its partial last block, and a batch writes at most
    T = ``max_num_batched_tokens`` positions in a plane (a row's tokens are charged once,
    and written once per loop it runs). A request's row of t tokens starting at offset o of
    its partial block opens ``(o + t - 1) // block_size`` blocks past it: one for each
    ``block_size`` of its tokens, and one more when it straddles a block boundary it does
    not fill up to, which takes two tokens (the last of one block, the first of the next).
    The worst case is every request straddling: ``S + m + (T - 2m) // block_size`` with
    ``m = min(S, T // 2)`` rows of two tokens, the rest of the budget in whole blocks."""
    seqs, tokens = limits.max_num_seqs, limits.max_num_batched_tokens
    straddling = min(seqs, tokens // 2)
    return planes * (seqs + straddling + (tokens - 2 * straddling) // block_size)


def tail_reserve_blocks(codec: str, num_blocks: int, open_bound: int) -> int:
    """Tail blocks (``auto`` layout) that KV memory reserves beside ``num_blocks`` block ids:
    one per ``TAIL_SHARE`` of them, and no fewer than ``open_bound`` (``open_blocks_bound``
    of the scheduler's limits), but never more than one per block id."""
    if codec != INT4_DELTA:
        return 0
    return min(num_blocks, max(-(-num_blocks // TAIL_SHARE), open_bound))


def bytes_per_token(
    codec: str,
    num_kv_heads: int,
    head_dim: int,
    planes: int,
    block_size: int,
    model_bytes: int = 2,
    layers: int = 1,
    context: int | None = None,
) -> float:
    """KV bytes per context token over every plane and layer: blocks (codes, scales, flags)
    and, given ``context``, the request's tail spread over that many tokens (a whole tail
    block per plane: the worst case) and its last block's padding."""
    per_block = block_bytes(codec, block_size, num_kv_heads, head_dim, model_bytes)
    if context is None:
        return per_block * planes * layers / block_size
    blocks = -(-context // block_size)
    tail = tail_bytes(codec, block_size, num_kv_heads, head_dim, model_bytes, planes, layers)
    return (blocks * per_block * planes * layers + tail) / context
