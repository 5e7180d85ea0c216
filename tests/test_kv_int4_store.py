"""The worker's int4-delta storage (services/worker/kv_int4/store.py): sealing a block plane
by plane from its tails reads back exactly what the oracle's own codec computes
(services/oracle/kv_codec.py), tokens without a delta included; tails are taken and given
back per open block."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.oracle.kv_codec import int4_delta_group
from services.worker.kv_int4.book import RequestBook
from services.worker.kv_int4.store import Int4Store, SealBatch

pytestmark = pytest.mark.unit

LAYERS, BLOCKS, BS, NKV, HD, PLANES = 2, 9, 4, 2, 128, 4


def _store(tails: int = 1) -> Int4Store:
    return Int4Store(LAYERS, BLOCKS, BS, NKV, HD, torch.float32, torch.device("cpu"), tails)


@pytest.mark.parametrize("seed", range(3))
def test_sealed_planes_read_back_as_the_oracle_codes_them(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    store = _store()
    chain = [2, 5, 7, 1]  # the block's id at planes 0..3
    store.open(np.asarray(chain))
    # exact K/V per plane; the token at offset 1 exits after 2 loops (top plane 1): its
    # K/V above are copies of plane 1, as the exit copy leaves them
    book = RequestBook(PLANES)
    book.exited(1, 2)
    k = [torch.randn(BS, NKV, HD, generator=g) * (j + 1) for j in range(PLANES)]
    v = [torch.randn(BS, NKV, HD, generator=g) for _ in range(PLANES)]
    for j in (2, 3):
        k[j][1], v[j][1] = k[1][1], v[1][1]
    for layer in range(LAYERS):
        for j, block in enumerate(chain):
            tail = int(store.tail_of[block])
            store.k_tail[layer, tail] = k[j] + layer
            store.v_tail[layer, tail] = v[j] - layer
    entries = [
        (j, block, int(store.tail_of[block]), chain[:j], book.stored(0, j, BS))
        for j, block in enumerate(chain)
    ]
    seal = SealBatch(entries[::-1], PLANES, BS, store.device)  # sorted by plane inside
    for layer in range(LAYERS):
        store.seal_layer(layer, seal)
    top = torch.tensor([PLANES - 1, 1, PLANES - 1, PLANES - 1])
    assert store.stored[0, chain[3]].tolist() == [1, 0, 1, 1]
    for layer in range(LAYERS):
        want_k = int4_delta_group([x + layer for x in k], top, keys=True, group=64)
        want_v = int4_delta_group([x - layer for x in v], top, keys=False, group=64)
        cache = store.layer(layer)
        for j in range(PLANES):
            tables = torch.tensor(chain)[:, None]
            got_k, got_v = cache.read_back(tables, j)
            assert torch.equal(got_k, want_k[j]), (layer, j)
            assert torch.equal(got_v, want_v[j]), (layer, j)
    # the exited token reads back as plane 1 in every plane above
    planes_k = [store.layer(0).read_back(torch.tensor(chain)[:, None], j)[0] for j in range(4)]
    assert torch.equal(planes_k[3][1], planes_k[1][1])
    assert not torch.equal(planes_k[3][0], planes_k[1][0])


def test_tails_are_taken_per_open_block_and_the_pool_grows() -> None:
    store = _store(tails=2)
    assert store.pool_blocks == store.reserved_tails == 2
    store.open(np.asarray([3, 3, 4, 6]))
    assert store.open_blocks == 3 and store.pool_blocks == 4  # grew past the reserve, once
    assert store.growths == 1
    tail = int(store.tail_of[4])
    store.close([4])
    assert store.tail_of[4] == -1 and store.open_blocks == 2
    store.open(np.asarray([8]))
    assert int(store.tail_of[8]) == tail  # given back, taken again
    store.sealed[6] = True
    store.open(np.asarray([6]))  # a sealed block written again was reused: open once more
    assert not store.sealed[6]
    slots = torch.tensor([3 * BS + 1, -1, 8 * BS + 3])
    store.sync_tail_map()
    mapped = store.tail_slots(slots).tolist()
    assert mapped == [int(store.tail_of[3]) * BS + 1, -1, tail * BS + 3]


def test_the_pool_never_outgrows_one_tail_per_block() -> None:
    store = _store()
    store.open(np.arange(BLOCKS))
    assert store.k_tail.shape[1] == BLOCKS
    store.close([0])
    store.open(np.asarray([0]))
    with pytest.raises(RuntimeError, match="tail pool exhausted"):
        store._take_tail()


def test_the_worker_refuses_blocks_too_small_to_group() -> None:
    from services.worker.kv_int4.paged import Int4KV

    with pytest.raises(ValueError, match="block_size 1 < 2"):
        Int4KV(LAYERS, BLOCKS, 1, NKV, HD, torch.float32, torch.device("cpu"), PLANES)
