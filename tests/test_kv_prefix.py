"""Prefix caching in the depth-aware KV manager (services/scheduler/core/kv/kv_manager.py)."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from messages.prefix import AllBlocksCleared, BlockRemoved, BlockStored, PrefixEvent
from services.scheduler.core.kv.kv_manager import KVManager

pytestmark = pytest.mark.unit

BS, PLANES = 4, 3


def _kv(num_blocks: int = 30) -> KVManager:
    return KVManager(num_blocks, BS, PLANES, enable_prefix_caching=True)


def _publish_all(kv: KVManager, rid: str, hashes: list[int], batch_seq: int = 0) -> None:
    parent = None
    for i, h in enumerate(hashes):
        kv.publish(rid, i, h, parent, batch_seq)
        parent = h


def _truly_free(kv: KVManager) -> int:
    return kv.num_free_blocks - kv.num_evictable_blocks


def test_claim_after_publish_shares_every_plane() -> None:
    kv = _kv()
    assert kv.ensure("a", 3 * BS)
    _publish_all(kv, "a", [11, 12, 13])
    kv.take_deltas()
    assert kv.lookup_prefix([11, 12, 99]) == 2
    assert kv.claim_prefix("b", [11, 12, 99]) == 2
    a, b = kv.tables("a"), kv.tables("b")
    assert all(b[p] == a[p][:2] for p in range(PLANES))
    # the worker learns claimed blocks from the deltas, like appended ones
    (delta,) = kv.take_deltas()
    assert delta.request_id == "b" and delta.plane_blocks == b
    assert kv.ensure("b", 3 * BS)  # grows past the shared prefix with private blocks
    assert kv.tables("b")[0][2] != a[0][2]
    kv.check_consistency()


def test_free_parks_cached_groups_instead_of_freeing() -> None:
    kv = _kv()
    kv.ensure("a", 3 * BS)
    _publish_all(kv, "a", [11, 12])  # block 2 stays private
    kv.free("a")
    assert kv.num_evictable_blocks == 2 * PLANES
    assert _truly_free(kv) == 30 - 2 * PLANES
    assert kv.num_free_blocks == 30  # free + evictable: what ensure can hand out
    assert kv.cached_block_hashes() == {11, 12}
    kv.check_consistency()
    assert kv.claim_prefix("b", [11, 12]) == 2  # a parked group comes back into use
    assert kv.num_evictable_blocks == 0
    kv.check_consistency()


def test_shared_group_parks_only_when_last_holder_frees() -> None:
    kv = _kv()
    kv.ensure("a", BS)
    _publish_all(kv, "a", [11])
    kv.claim_prefix("b", [11])
    kv.free("a")
    assert kv.num_evictable_blocks == 0
    kv.free("b")
    assert kv.num_evictable_blocks == PLANES
    kv.check_consistency()


def test_releasable_blocks_count_only_what_freeing_them_all_gives_back() -> None:
    kv = _kv()
    kv.ensure("a", 3 * BS)
    _publish_all(kv, "a", [11, 12])  # block 2 stays private to a
    kv.claim_prefix("b", [11, 12])
    kv.ensure("b", 3 * BS)  # b's block 2 is private too
    kv.claim_prefix("c", [11])
    # a alone: its private block; the groups stay with b (and c)
    assert kv.releasable_blocks(["a"]) == PLANES
    # a and b: both private blocks and group 12; group 11 stays with c
    assert kv.releasable_blocks(["a", "b"]) == 3 * PLANES
    assert kv.releasable_blocks(["a", "b", "c"]) == 4 * PLANES
    assert kv.releasable_blocks(["nobody"]) == 0
    before = kv.num_free_blocks
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks - before == 3 * PLANES  # what the count promised
    kv.check_consistency()


def test_eviction_is_lru_among_cache_only_groups() -> None:
    kv = _kv(num_blocks=4 * PLANES)
    for rid, h in (("a", 1), ("b", 2), ("c", 3)):
        kv.ensure(rid, BS)
        _publish_all(kv, rid, [h])
    kv.free("b")
    kv.free("a")
    kv.free("c")  # LRU order now b, a, c
    kv.take_prefix_events()
    assert kv.claim_prefix("x", [1]) == 1  # touches a: order b, c (a in use)
    kv.free("x")  # a back at the MRU end: b, c, a
    assert kv.ensure("y", 2 * BS)  # 1 free group + evict b
    assert kv.cached_block_hashes() == {1, 3}
    assert kv.ensure("y", 3 * BS)  # evict c
    assert kv.cached_block_hashes() == {1}
    assert kv.take_prefix_events() == [BlockRemoved(block_hashes=[2, 3])]
    kv.check_consistency()


def test_tail_of_one_request_is_evicted_before_its_prefix() -> None:
    kv = _kv(num_blocks=3 * PLANES)
    kv.ensure("a", 3 * BS)
    _publish_all(kv, "a", [1, 2, 3])
    kv.free("a")
    assert kv.ensure("b", BS)
    assert kv.cached_block_hashes() == {1, 2}
    assert kv.lookup_prefix([1, 2, 3]) == 2


def test_blocks_in_use_are_never_evicted_and_impossible_allocation_evicts_nothing() -> None:
    kv = _kv(num_blocks=4 * PLANES)
    kv.ensure("a", BS)
    _publish_all(kv, "a", [1])  # in use by a
    kv.ensure("b", BS)
    _publish_all(kv, "b", [2])
    kv.free("b")  # 2 parked
    kv.take_prefix_events()
    # needs 4 groups: 2 free + 1 evictable is not enough -> nothing evicted, nothing allocated
    assert not kv.ensure("c", 4 * BS)
    assert kv.cached_block_hashes() == {1, 2}
    assert kv.take_prefix_events() == []
    assert kv.tables("c") == []
    assert kv.ensure("c", 3 * BS)  # 2 free + evict 2, never a's group
    assert kv.cached_block_hashes() == {1}
    assert kv.tables("a")[0][0] not in kv.tables("c")[0]
    assert not kv.ensure("d", BS)
    assert kv.cached_block_hashes() == {1}
    kv.check_consistency()


def test_claim_degrades_to_shorter_hit_after_eviction() -> None:
    kv = _kv(num_blocks=3 * PLANES)
    kv.ensure("a", 3 * BS)
    _publish_all(kv, "a", [1, 2, 3])
    kv.free("a")
    hashes = [1, 2, 3]
    assert kv.lookup_prefix(hashes) == 3
    kv.ensure("z", BS)  # evicts the tail (3), then z goes away with its private block
    kv.free("z")
    assert kv.claim_prefix("b", hashes) == 2
    assert kv.tables("b")[0] == kv.tables("b")[0][:2]
    kv.check_consistency()


def test_claim_respects_before_batch_seq_and_needs_empty_tables() -> None:
    kv = _kv()
    kv.ensure("a", 2 * BS)
    kv.publish("a", 0, 1, None, batch_seq=4)
    kv.publish("a", 1, 2, 1, batch_seq=7)
    assert kv.lookup_prefix([1, 2], before_batch_seq=7) == 1
    assert kv.claim_prefix("b", [1, 2], before_batch_seq=8) == 2
    with pytest.raises(ValueError):
        kv.claim_prefix("b", [1])
    with pytest.raises(ValueError):
        kv.publish("b", 5, 9, None, 0)


def test_events_match_what_happened() -> None:
    kv = _kv(num_blocks=4 * PLANES)
    kv.ensure("a", 3 * BS)
    _publish_all(kv, "a", [1, 2], batch_seq=5)
    kv.publish("a", 2, 3, 2, batch_seq=6)
    assert kv.take_prefix_events() == [
        BlockStored(block_hashes=[1, 2], parent_hash=None, num_tokens_per_block=BS, batch_seq=5),
        BlockStored(block_hashes=[3], parent_hash=2, num_tokens_per_block=BS, batch_seq=6),
    ]
    kv.ensure("b", BS)
    kv.publish("b", 0, 1, None, 9)  # already cached by a's group: b's copy stays private
    assert kv.take_prefix_events() == []
    kv.free("b")
    kv.free("a")
    assert kv.num_evictable_blocks == 3 * PLANES
    assert kv.ensure("c", 3 * BS)  # 1 free group + the 2 least recent parked ones
    assert kv.take_prefix_events() == [BlockRemoved(block_hashes=[3, 2])]
    kv.check_consistency()


def test_reset_frees_parked_and_detaches_groups_in_use() -> None:
    kv = _kv()
    kv.ensure("a", 2 * BS)
    _publish_all(kv, "a", [1, 2])
    kv.claim_prefix("b", [1])
    kv.ensure("c", BS)
    _publish_all(kv, "c", [7])
    kv.free("c")
    kv.reset_prefix_cache()
    assert kv.take_prefix_events() == [AllBlocksCleared()]
    assert kv.cached_block_hashes() == set()
    assert kv.num_evictable_blocks == 0
    assert kv.claim_prefix("d", [1]) == 0
    kv.publish("a", 0, 1, None, 3)  # a detached group is never cached again
    assert kv.cached_block_hashes() == set()
    kv.check_consistency()
    kv.free("a")
    kv.free("b")
    assert _truly_free(kv) == 30
    kv.check_consistency()


def test_snapshot_events_describe_the_cache() -> None:
    kv = _kv()
    kv.ensure("a", 2 * BS)
    _publish_all(kv, "a", [1, 2], batch_seq=3)
    snap = kv.snapshot_prefix_events()
    assert isinstance(snap[0], AllBlocksCleared)
    stored = {h for e in snap[1:] if isinstance(e, BlockStored) for h in e.block_hashes}
    assert stored == {1, 2}


# ------------------------------------------------------------------ caching off
class _OriginalKV:
    """The pre-caching semantics, as a reference: FIFO free list, plane-major release."""

    def __init__(self, num_blocks: int) -> None:
        self.free_list: deque[int] = deque(range(num_blocks))
        self.tables: dict[str, list[list[int]]] = {}

    def ensure(self, rid: str, num_tokens: int) -> bool:
        tables = self.tables.get(rid)
        have = len(tables[0]) if tables else 0
        want = -(-num_tokens // BS)
        if want <= have:
            return True
        if (want - have) * PLANES > len(self.free_list):
            return False
        tables = self.tables.setdefault(rid, [[] for _ in range(PLANES)])
        for plane in range(PLANES):
            tables[plane].extend(self.free_list.popleft() for _ in range(want - have))
        return True

    def free(self, rid: str) -> None:
        for table in self.tables.pop(rid, []):
            self.free_list.extend(table)


_RIDS = ["a", "b", "c", "d"]
_OPS = st.lists(
    st.tuples(
        st.sampled_from(["ensure", "free", "publish", "claim"]),
        st.sampled_from(_RIDS),
        st.integers(0, 6),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(_OPS)
def test_caching_off_behaves_exactly_as_before(ops: list[tuple[str, str, int]]) -> None:
    kv = KVManager(24, BS, PLANES)
    ref = _OriginalKV(24)
    for op, rid, n in ops:
        if op == "ensure":
            assert kv.ensure(rid, n * BS + 1) == ref.ensure(rid, n * BS + 1)
        elif op == "free":
            kv.free(rid)
            ref.free(rid)
        elif op == "publish" and kv.tables(rid) and n < len(kv.tables(rid)[0]):
            kv.publish(rid, n, 100 + n, None, 0)
        elif op == "claim" and not kv.tables(rid):
            assert kv.lookup_prefix([100, 101]) == 0
            assert kv.claim_prefix(rid, [100, 101]) == 0
        assert kv.tables(rid) == ref.tables.get(rid, [])
        assert kv.num_free_blocks == len(ref.free_list)
        assert list(kv._free) == list(ref.free_list)
        kv.check_consistency()
    assert kv.take_prefix_events() == []
    assert kv.cached_block_hashes() == set()


# ------------------------------------------------------------------ random sequences
# Prompts share prefixes so claims hit; hashes are fake but chain-shaped (a prefix of a
# prompt's hashes identifies its content).
_PROMPTS = [[1, 2, 3, 4], [1, 2, 5, 6], [1, 7, 8, 9], [10, 11, 12, 13]]
_SEQ_OPS = st.lists(
    st.tuples(
        # weighted: mostly start/publish/free so claims and evictions both happen often
        st.sampled_from(["start"] * 3 + ["grow"] * 2 + ["publish"] * 3 + ["free"] * 3 + ["reset"]),
        st.sampled_from(_RIDS),
        st.integers(0, len(_PROMPTS) - 1),
        st.integers(1, 6),
    ),
    min_size=20,
    max_size=80,
)


def _apply_events(mirror: set[int], events: list[PrefixEvent]) -> None:
    for event in events:
        if isinstance(event, BlockStored):
            mirror.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            mirror.difference_update(event.block_hashes)
        else:
            mirror.clear()


@settings(max_examples=120, deadline=None)
@given(_SEQ_OPS)
def test_random_sequences_keep_every_invariant(ops: list[tuple[str, str, int, int]]) -> None:
    kv = _kv(num_blocks=6 * PLANES)
    prompt_of: dict[str, list[int]] = {}
    content: dict[int, int | None] = {}  # physical block -> hash of the KV it holds
    mirror: set[int] = set()  # the cache as seen through the events

    def allocate(rid: str, num_blocks: int) -> bool:
        before = len(kv.tables(rid)[0]) if kv.tables(rid) else 0
        if not kv.ensure(rid, num_blocks * BS):
            return False
        for table in kv.tables(rid):
            for block in table[before:]:
                content[block] = None  # freshly allocated: to be written by rid
        return True

    for batch_seq, (op, rid, prompt_idx, n) in enumerate(ops):
        live = rid in prompt_of
        if op == "start" and not live:
            hashes = _PROMPTS[prompt_idx]
            expect = kv.lookup_prefix(hashes)
            claimed = kv.claim_prefix(rid, hashes)
            assert claimed == expect
            for j in range(claimed):  # never wrong KV: every plane holds that block's content
                assert all(content[t[j]] == hashes[j] for t in kv.tables(rid))
            prompt_of[rid] = hashes
            if not allocate(rid, max(n, claimed)):
                kv.free(rid)
                del prompt_of[rid]
        elif op == "grow" and live:
            have = len(kv.tables(rid)[0]) if kv.tables(rid) else 0
            allocate(rid, have + 1)
        elif op == "publish" and live and kv.tables(rid):
            idx = min(n, len(kv.tables(rid)[0]), len(prompt_of[rid])) - 1
            hashes = prompt_of[rid]
            for j in range(idx + 1):
                group = [t[j] for t in kv.tables(rid)]
                for b in group:
                    assert content[b] in (None, hashes[j])
                    content[b] = hashes[j]  # rid wrote it (or claimed it with that content)
                kv.publish(rid, j, hashes[j], hashes[j - 1] if j else None, batch_seq)
        elif op == "free" and live:
            kv.free(rid)
            del prompt_of[rid]
        elif op == "reset":
            kv.reset_prefix_cache()
        kv.check_consistency()
        _apply_events(mirror, kv.take_prefix_events())
        assert mirror == kv.cached_block_hashes()
    for rid in list(prompt_of):
        kv.free(rid)
    kv.check_consistency()
    assert kv.num_free_blocks == kv.num_blocks
