"""Admission keys a token-sparse request's prefix lookups the way its shard keys the blocks:
each scheduler announces its token-sparse defaults, admission hashes the prompt under the
setting that shard would resolve (window and retention in the key, blocks before the last
window only) and rounds a hit to whole windows, so a sparse request goes where its prefix is
cached instead of by load alone."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import structlog

from messages.internal import SchedulerLoad, ShardAnnounce
from messages.prefix import PrefixLookup, cacheable_prefix_blocks
from messages.sampling import SamplingParams
from services.admission.config import AdmissionConfig
from services.admission.membership import ShardMembership
from services.admission.prefix_keys import PrefixKeys
from services.admission.routing import Routing
from services.admission.shards import ShardTable
from services.admission.tables import OpenRequests
from services.admission.validation import Prepared
from services.common.config import ModelLimits, SchedulerConfig
from services.common.sparse_prefill import prefill_setting
from services.prefix_cache.core import PrefixIndex
from services.runtime.bus import decode_msgpack, encode_msgpack
from services.scheduler.core.scheduler import Scheduler
from tests.helpers import fake_result

pytestmark = pytest.mark.unit

BS = 4
LIMITS = ModelLimits(
    total_ut_steps=4, vocab_size=500, max_position_embeddings=4096, eos_token_ids=(0,)
)
SHARED = list(range(1, 41))  # 40 tokens: windows of 8 end at 8, 16, 24, 32, 40


def _config(**overrides: object) -> SchedulerConfig:
    base: dict[str, object] = dict(
        block_size=BS, num_blocks=256, prefill_chunk_size=8, enable_prefix_caching=True,
        async_scheduling=False, sparse_window=12,
    )  # fmt: skip
    return SchedulerConfig(**(base | overrides))  # type: ignore[arg-type]


def _run(s: Scheduler) -> None:
    for _ in range(10_000):
        if not s.has_unfinished_requests():
            return
        batch = s.schedule()
        if batch is not None:
            s.update_after_submission(batch)
            s.update_from_output(batch, fake_result(batch))
    raise AssertionError("no progress")


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=1),  # the shard's default
        SamplingParams(max_tokens=1, token_sparse_prefill=True),
        SamplingParams(max_tokens=1, prefill_retention=[1, 0.5, 0.5, 0.2]),
        SamplingParams(max_tokens=1, token_sparse_prefill=False),
        SamplingParams(max_tokens=1, prompt_logprobs=1),  # the default gives way to it
    ],
    ids=["default", "asked", "own-retention", "dense", "prompt-logprobs"],
)
@pytest.mark.parametrize("default_on", [True, False])
def test_admission_computes_the_keys_the_scheduler_uses(
    params: SamplingParams, default_on: bool
) -> None:
    s = Scheduler(_config(token_sparse_prefill=default_on), LIMITS)
    table = ShardTable("adm", block_size=BS)
    table.announce(_announce("0", s), 0.0)
    prompt = [*SHARED, 90, 91, 92]
    request = s.add_request("r", prompt, params)
    keys = PrefixKeys.of(prompt, BS, params, None, table.shards.values())
    usable = cacheable_prefix_blocks(len(prompt), BS)
    assert keys.of_shard("0") == request.block_hashes[:usable]
    # a request carrying its first shard's setting is keyed by it, whatever the defaults
    carried = prefill_setting(request.sparse)
    other = Scheduler(_config(token_sparse_prefill=not default_on, sparse_window=40), LIMITS)
    table.announce(_announce("0", other, scheduler_id="s1"), 1.0)
    moved = other.add_request("r", prompt, params, prefill_setting=carried)
    keys = PrefixKeys.of(prompt, BS, params, carried, table.shards.values())
    assert keys.of_shard("0") == moved.block_hashes[:usable]


def test_a_sparse_request_is_routed_to_the_shard_that_caches_its_windows() -> None:
    shards = {
        sid: Scheduler(_config(token_sparse_prefill=True), LIMITS, producer_id=f"p{sid}")
        for sid in "01"
    }
    index = PrefixIndex()
    # shard 0 ran a sparse prompt: its blocks before the last window ([60, 70)) are in the
    # index, 10 of them the shared prefix's
    writer = [*SHARED, *range(100, 130)]
    shards["0"].add_request("w", writer, SamplingParams(max_tokens=1))
    _run(shards["0"])
    events = shards["0"].take_prefix_events()
    assert events is not None
    index.apply(events)
    routing = _routing(index)
    for sid, scheduler in shards.items():
        routing.shards.announce(_announce(sid, scheduler), time.monotonic())
        # shard 0 is busier: by load alone the request would go to shard 1
        load = SchedulerLoad(
            scheduler_id=f"s{sid}", shard_id=sid, producer_id=f"p{sid}", report_seq=1,
            time=time.time(), num_running=3 if sid == "0" else 0, num_blocks=256,
            num_free_blocks=200,
        )  # fmt: skip
        assert routing.shards.apply(load, time.monotonic(), time.time()) is None
    prompt = [*SHARED, 80, 81, 82]
    prepared = Prepared("r", prompt, SamplingParams(max_tokens=4), "t")
    shard, overlap = _await(routing.route(prepared, lambda *_: None))
    # 10 blocks cached: 9 of them end a window of 12 (a hit stops at a window boundary)
    assert (shard, overlap) == ("0", 9)
    # a dense request sharing the prefix finds none of them: by load
    dense = Prepared("d", prompt, SamplingParams(max_tokens=4, token_sparse_prefill=False), "t")
    assert _await(routing.route(dense, lambda *_: None)) == ("1", 0)


# ------------------------------------------------------------------ helpers
def _announce(sid: str, s: Scheduler, scheduler_id: str = "") -> ShardAnnounce:
    return ShardAnnounce(
        shard_id=sid, scheduler_id=scheduler_id or f"s{sid}", producer_id=f"p{sid}",
        block_size=BS, enable_prefix_caching=True, sparse_prefill=s.sparse_prefill_offer(),
        sparse_prefill_default=s.config.token_sparse_prefill,
    )  # fmt: skip


class _IndexBus:
    """NATS as far as a prefix lookup uses it: the index answers in process."""

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index

    async def request(self, subject: str, data: bytes, timeout: float) -> SimpleNamespace:
        lookup = decode_msgpack(data, PrefixLookup)
        reply = self.index.lookup(lookup.block_hashes, per_producer=lookup.per_producer)
        return SimpleNamespace(data=encode_msgpack(reply))


def _routing(index: PrefixIndex) -> Routing:
    actor = SimpleNamespace(nc=_IndexBus(index), log=structlog.get_logger(), instance_id="adm")
    table = ShardTable("adm", block_size=BS)
    membership = ShardMembership(actor, table, OpenRequests(scheduler_lost_s=5.0))  # type: ignore[arg-type]
    return Routing(actor, AdmissionConfig(block_size=BS), membership, BS)  # type: ignore[arg-type]


def _await(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)
