"""Whether a request can ever run on this model and cache: the one rule that admission (to
refuse early, before the bus) and the scheduler (the last word) both apply."""

from __future__ import annotations

from dataclasses import dataclass

from kernels.kv_codec import INT4_DELTA, TAIL_SHARE, tail_reserve_blocks
from messages.errors import RequestError


def blocks_per_plane(num_tokens: int, block_size: int) -> int:
    """Blocks ``num_tokens`` positions take in one plane."""
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class KVGeometry:
    """The KV cache's shape as far as fitting a request goes."""

    block_size: int
    num_blocks: int
    num_planes: int

    def blocks_per_plane(self, num_tokens: int) -> int:
        return blocks_per_plane(num_tokens, self.block_size)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks ``num_tokens`` positions take over all planes."""
        return blocks_per_plane(num_tokens, self.block_size) * self.num_planes


def blocks_in_memory(
    kv_bytes: int, block_bytes: int, tail_block_bytes: int = 0, open_bound: int = 0
) -> int:
    """Block ids a KV memory of ``kv_bytes`` holds when one block id (one plane's block over
    every layer, codes and scales included) takes ``block_bytes``: a codec's real bytes, so
    fp8 holds ~1.94x the blocks of bf16 ``auto`` in the same memory. ``tail_block_bytes``
    (int4-delta): a full-precision block, of which the memory keeps the reserve of
    ``kernels.kv_codec.tail_reserve_blocks``: one per ``TAIL_SHARE`` block ids, and no fewer
    than ``open_bound`` (``kernels.kv_codec.open_blocks_bound``)."""
    n = kv_bytes // block_bytes
    if tail_block_bytes:
        # the reserve grows with n: the most n under each of its two terms
        by_share = kv_bytes * TAIL_SHARE // (TAIL_SHARE * block_bytes + tail_block_bytes)
        by_open = max(0, (kv_bytes - open_bound * tail_block_bytes) // block_bytes)
        n = min(by_share, by_open)
        while n and n * block_bytes + _tails(n, open_bound) * tail_block_bytes > kv_bytes:
            n -= 1
    return n


def _tails(num_blocks: int, open_bound: int) -> int:
    return tail_reserve_blocks(INT4_DELTA, num_blocks, open_bound)


def kv_tokens(num_prompt: int, max_tokens: int) -> int:
    """KV slots a request can ever write: the last sampled token is never fed back."""
    return num_prompt + max_tokens - 1


def check_request_fits(
    num_prompt: int, max_tokens: int, max_position_embeddings: int, kv: KVGeometry | None
) -> None:
    """Raises RequestError if the request can never run: its positions exceed the model's,
    or its whole KV footprint exceeds the cache (``kv`` None: the cache is not known here)."""
    if num_prompt + max_tokens > max_position_embeddings:
        raise RequestError(
            f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) exceeds the model's "
            f"max_position_embeddings ({max_position_embeddings})"
        )
    if kv is None:
        return
    blocks = kv.blocks_for(kv_tokens(num_prompt, max_tokens))
    if blocks > kv.num_blocks:
        raise RequestError(
            f"request needs {blocks} KV blocks but the cache has only {kv.num_blocks}; "
            "shorten the prompt or max_tokens"
        )
