"""Chained block hashes and the prefix wire contract (messages/prefix.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import msgspec
import pytest

from messages.prefix import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    PrefixEventBatch,
    PrefixLookupReply,
    cacheable_prefix_blocks,
    encode_extra_keys,
    hash_block_tokens,
    prompt_block_hashes,
)

pytestmark = pytest.mark.unit

BS = 16
TOKENS = [(i * 7919 + 13) % 151_000 for i in range(5 * BS + 3)]


def test_stable_across_processes_and_hash_seeds() -> None:
    code = (
        "import json, sys; from messages.prefix import prompt_block_hashes, encode_extra_keys;"
        "t = json.loads(sys.argv[1]);"
        "print(json.dumps(prompt_block_hashes(t, 16, encode_extra_keys('salt', 'model'))))"
    )
    outs = []
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        run = subprocess.run(
            [sys.executable, "-c", code, json.dumps(TOKENS)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        outs.append(json.loads(run.stdout))
    here = prompt_block_hashes(TOKENS, BS, encode_extra_keys("salt", "model"))
    assert outs[0] == outs[1] == here


def test_chain_matches_single_block_hashing_and_fits_uint64() -> None:
    hashes = prompt_block_hashes(TOKENS, BS)
    parent = None
    for i, h in enumerate(hashes):
        assert h == hash_block_tokens(parent, TOKENS[i * BS : (i + 1) * BS])
        assert 0 <= h < 2**64
        parent = h
    assert len(set(hashes)) == len(hashes)


def test_chain_property() -> None:
    base = prompt_block_hashes(TOKENS, BS)
    first = list(TOKENS)
    first[3] += 1  # block 0 changes -> every later hash changes
    changed = prompt_block_hashes(first, BS)
    assert all(a != b for a, b in zip(base, changed, strict=True))
    third = list(TOKENS)
    third[2 * BS + 5] += 1  # block 2 changes -> blocks 0, 1 keep their hash
    changed = prompt_block_hashes(third, BS)
    assert changed[:2] == base[:2]
    assert all(a != b for a, b in zip(base[2:], changed[2:], strict=True))


def test_extra_keys_change_every_hash() -> None:
    base = prompt_block_hashes(TOKENS, BS)
    for extra in (b"x", encode_extra_keys("salt"), encode_extra_keys("model-a")):
        other = prompt_block_hashes(TOKENS, BS, extra)
        assert all(a != b for a, b in zip(base, other, strict=True))
    # keys are length-prefixed, so splitting them differently is a different extra
    assert encode_extra_keys("ab", "c") != encode_extra_keys("a", "bc")
    assert encode_extra_keys(None) != encode_extra_keys("")


def test_partial_last_block_not_hashed_and_max_blocks() -> None:
    assert len(prompt_block_hashes(TOKENS, BS)) == 5  # 83 tokens -> 5 full blocks
    assert prompt_block_hashes(TOKENS[: BS - 1], BS) == []
    assert prompt_block_hashes(TOKENS, BS, max_blocks=2) == prompt_block_hashes(TOKENS, BS)[:2]
    assert prompt_block_hashes(TOKENS, BS, max_blocks=0) == []
    # extending a prompt never changes the hashes of blocks it already had
    assert prompt_block_hashes(TOKENS[: 3 * BS + 1], BS) == prompt_block_hashes(TOKENS, BS)[:3]
    with pytest.raises(ValueError):
        prompt_block_hashes(TOKENS, 0)


def test_root_parent_differs_from_zero_parent() -> None:
    block = TOKENS[:BS]
    assert hash_block_tokens(None, block) != hash_block_tokens(0, block)


@pytest.mark.parametrize(
    ("num_tokens", "expected"),
    [(0, 0), (1, 0), (16, 0), (17, 1), (32, 1), (33, 2), (48, 2), (49, 3)],
)
def test_cacheable_prefix_blocks_excludes_last_token(num_tokens: int, expected: int) -> None:
    assert cacheable_prefix_blocks(num_tokens, BS) == expected


def test_events_roundtrip_as_tagged_maps() -> None:
    batch = PrefixEventBatch(
        producer_id="sched-0",
        epoch="e1",
        event_seq=1,
        events=[
            BlockStored(block_hashes=[2**64 - 1, 5], parent_hash=None, num_tokens_per_block=BS),
            BlockRemoved(block_hashes=[5]),
            AllBlocksCleared(),
        ],
    )
    wire = msgspec.msgpack.encode(batch)
    raw = msgspec.msgpack.decode(wire)
    assert [e["kind"] for e in raw["events"]] == [
        "block_stored",
        "block_removed",
        "all_blocks_cleared",
    ]
    assert msgspec.msgpack.decode(wire, type=PrefixEventBatch) == batch
    # fields added later have defaults, so an older, shorter message still decodes
    assert msgspec.msgpack.decode(msgspec.msgpack.encode({}), type=PrefixLookupReply) == (
        PrefixLookupReply()
    )
