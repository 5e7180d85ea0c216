"""Prefix-cache wire contract: chained block hashes and the events/lookups every service shares.

A full block of ``block_size`` token ids hashes as ``h_i = H(h_{i-1}, tokens_i, extra)``:
blake2b-64 with a fixed personalization (the seed), over little-endian packed integers,
so a hash is the same in every process, on every host, whatever PYTHONHASHSEED is.
Only full blocks are ever hashed.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Iterable, Sequence
from hashlib import blake2b
from typing import Annotated

import msgspec

# Bump the personalization if the byte layout ever changes: old and new hashes must never meet.
_PERSON = b"rlt-prefix-v1"
# Stand-in parent of block 0, so ``parent=None`` hashes differently from any small int parent.
ROOT_PARENT_HASH = 0x9E3779B97F4A7C15
# Header = parent hash + token count: the count keeps (tokens, extra) splits unambiguous.
_HEADER = struct.Struct("<QI")
_BASE = blake2b(digest_size=8, person=_PERSON)  # copying a primed object is ~2x cheaper
_SWAP = sys.byteorder != "little"


def _pack_tokens(tokens: Sequence[int]) -> bytes:
    packed = array("q", tokens)
    if _SWAP:  # the byte layout is little-endian everywhere
        packed.byteswap()
    return packed.tobytes()


def encode_extra_keys(*keys: str | bytes | None) -> bytes:
    """Builds ``extra`` from cache salts / model ids; length-prefixed so keys never blur."""
    out = bytearray()
    for key in keys:
        if key is None:
            out += b"\xff\xff\xff\xff"  # distinct from an empty key
            continue
        raw = key.encode() if isinstance(key, str) else key
        out += struct.pack("<I", len(raw)) + raw
    return bytes(out)


def hash_block_tokens(parent: int | None, tokens: Sequence[int], extra: bytes = b"") -> int:
    """Hash of one block given its parent's hash (None for the first block)."""
    h = _BASE.copy()
    parent_hash = ROOT_PARENT_HASH if parent is None else parent
    h.update(_HEADER.pack(parent_hash, len(tokens)) + _pack_tokens(tokens) + extra)
    return int.from_bytes(h.digest(), "little")


def prompt_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    extra: bytes = b"",
    max_blocks: int | None = None,
) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids`` (a partial last block is skipped)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    n = len(token_ids) // block_size
    if max_blocks is not None:
        n = min(n, max(max_blocks, 0))
    if n == 0:
        return []
    # Pack the whole prompt once and slice bytes: per-block packing would dominate the cost.
    packed = _pack_tokens(token_ids[: n * block_size])
    stride = block_size * 8
    pack, from_bytes, copy = _HEADER.pack, int.from_bytes, _BASE.copy
    parent = ROOT_PARENT_HASH
    out: list[int] = []
    for start in range(0, n * stride, stride):
        h = copy()
        h.update(pack(parent, block_size) + packed[start : start + stride] + extra)
        parent = from_bytes(h.digest(), "little")
        out.append(parent)
    return out


def cacheable_prefix_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """Full blocks that can come from the cache: the last prompt token is always recomputed
    (its hidden state feeds the coda), so its block is never a hit."""
    if num_prompt_tokens <= 0:
        return 0
    return (num_prompt_tokens - 1) // block_size


def blocks_digest(block_hashes: Iterable[int]) -> str:
    """A short fingerprint of a set of block hashes: a scheduler's own table and the prefix
    index's view of it compare equal exactly when they hold the same blocks."""
    packed = array("Q", sorted(block_hashes))
    if _SWAP:
        packed.byteswap()
    return blake2b(packed.tobytes(), digest_size=8, person=_PERSON).hexdigest()


# --------------------------------------------------------------------------------- events
# a block hash is 64 unsigned bits (snapshots pack them so): anything else is malformed
BlockHash = Annotated[int, msgspec.Meta(ge=0)]


class BlockStored(msgspec.Struct, kw_only=True, tag="block_stored", tag_field="kind"):
    """Consecutive chained blocks became cached; ``parent_hash`` is the first one's parent.

    The blocks are written by batch ``batch_seq``; others may read them only in later batches.
    """

    block_hashes: list[BlockHash] = msgspec.field(default_factory=list)
    parent_hash: int | None = None
    num_tokens_per_block: int = 0
    batch_seq: int = 0


class BlockRemoved(msgspec.Struct, kw_only=True, tag="block_removed", tag_field="kind"):
    block_hashes: list[BlockHash] = msgspec.field(default_factory=list)


class AllBlocksCleared(msgspec.Struct, kw_only=True, tag="all_blocks_cleared", tag_field="kind"):
    pass


PrefixEvent = BlockStored | BlockRemoved | AllBlocksCleared


class PrefixEventBatch(msgspec.Struct, kw_only=True):
    """One envelope per ``event_seq``; seqs start at 1 in every epoch (a new process = a new
    epoch), so a consumer that has applied nothing of an epoch expects seq 1 next.

    An envelope too big for one bus message travels as ``num_parts`` consecutive parts of
    the same ``event_seq`` (``part`` 0, 1, ...), each a valid run of events in order."""

    producer_id: str
    epoch: str
    event_seq: int
    events: list[PrefixEvent] = msgspec.field(default_factory=list)
    part: int = 0
    num_parts: int = 1


class PrefixLookup(msgspec.Struct, kw_only=True):
    block_hashes: list[int] = msgspec.field(default_factory=list)
    request_id: str = ""
    trace_id: str = ""
    # the router's question: the leading run of EVERY producer, not only the longest
    per_producer: bool = False


class PrefixLookupReply(msgspec.Struct, kw_only=True):
    """Longest leading run cached by one producer, and how far that producer's log is applied;
    with ``per_producer``, also each producer's own leading run (producers with none left
    out)."""

    producer_id: str | None = None
    num_blocks: int = 0
    event_seq: int = 0
    overlaps: dict[str, int] = msgspec.field(default_factory=dict)


class ProducerSnapshot(msgspec.Struct, kw_only=True):
    """One producer's state in an index snapshot: how far its log is applied and the hashes it
    caches, packed as little-endian uint64."""

    producer_id: str
    epoch: str
    event_seq: int = 0  # the last envelope applied whole
    next_part: int = 0  # parts of envelope event_seq + 1 applied already (a split envelope)
    blocks: bytes = b""


class PrefixIndexSnapshot(msgspec.Struct, kw_only=True):
    """The prefix index as of stream sequence ``stream_seq`` of the event stream: a restarted
    index loads it and replays the stream from ``stream_seq + 1``."""

    version: int = 1
    stream_seq: int = 0
    producers: list[ProducerSnapshot] = msgspec.field(default_factory=list)
    # producers dropped as gone -> their epoch then (what is left of it stays ignored)
    dropped: dict[str, str] = msgspec.field(default_factory=dict)
    written_at: float = 0.0  # unix seconds
