"""The prefix-event plane on JetStream with REAL processes on a real nats-server.

- kill -9 the prefix-cache service mid-run and start it again: it loads its snapshot from the
  object store and replays only the stream's tail, and within 5 s of its restart its index
  equals the scheduler's own block table again; the scheduler is not restarted (same epoch,
  no rebase) and nobody asks it to replay anything;
- the stream's limits (age, size) and replicas are what the docs say.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import structlog

from messages.prefix import BlockStored, PrefixEventBatch
from services.launcher import NatsServer, free_port
from services.prefix_cache import PrefixIndex
from services.prefix_cache.stream import EventReader, SnapshotStore
from services.runtime import jetstream, subjects

pytest.register_assert_rewrite("tests.conftest_nats")

from tests.service_cases import (  # noqa: E402
    PREFIX_ARGS,
    as_request,
    index_matches_scheduler,
    make_cases,
    prefix_prompt,
)
from tests.service_procs import (  # noqa: E402
    StreamCollector,
    client,
    health,
    service_procs,
    wait_for,
)

pytestmark = pytest.mark.services

ENV = {
    "RLT_WORKER_HEARTBEAT_TIMEOUT_S": "1.5",
    "RLT_WORKER_HEARTBEAT_S": "0.25",
    "RLT_PREFIX_SNAPSHOT_S": "0.5",
}


async def test_prefix_cache_killed_mid_run_rebuilds_from_snapshot_and_tail(
    toy_checkpoint: Path, tmp_path: Path
) -> None:
    with (
        NatsServer(port=free_port()) as server,
        service_procs(server.url, toy_checkpoint, tmp_path, PREFIX_ARGS, ENV) as procs,
    ):
        await procs.start_all()
        async with client(server.url) as nc:
            replay_asks = await nc.subscribe("rlt.v1.prefix.replay.>")
            col = await StreamCollector(nc).start()
            first = make_cases(11, 6, max_tokens=8)
            for i, (_, p) in enumerate(first):
                await col.send(i, as_request(f"warm-{i}", prefix_prompt(i), p))
            await col.wait_done(range(6), 60)
            await wait_for(lambda: index_matches_scheduler(nc), 10, "index == scheduler")
            before = await health(nc, "scheduler")
            assert before["prefix_blocks"] >= 6
            await wait_for(
                lambda: _snapshot_written(nc), 10, "a snapshot of the index in the object store"
            )

            # more requests; the index dies while they run
            second = make_cases(12, 6, max_tokens=60)
            for i, (_, p) in enumerate(second):
                await col.send(10 + i, as_request(f"tail-{i}", prefix_prompt(20 + i), p))
            await wait_for(lambda: all(col.tokens(10 + i) for i in range(6)), 60, "tokens")
            procs.kill("prefix-cache")  # SIGKILL: no final snapshot
            await asyncio.sleep(0.3)  # blocks keep being stored while it is down
            restarted_at = time.monotonic()
            new = procs.start("prefix-cache", key="prefix-cache-2")
            await procs.wait_ready(new)
            await wait_for(lambda: index_matches_scheduler(nc), 10, "index rebuilt")
            took = time.monotonic() - restarted_at
            index = await health(nc, "prefix-cache")
            await col.wait_done([10 + i for i in range(6)], 60)
            await wait_for(lambda: index_matches_scheduler(nc), 5, "index follows the tail")
            after = await health(nc, "scheduler")

            # the producer was not restarted and never rebased or asked to replay
            assert after["prefix_epoch"] == before["prefix_epoch"]
            assert after["prefix_events"]["rebases"] == 0
            with pytest.raises(asyncio.TimeoutError):
                await replay_asks.next_msg(timeout=0.1)
            # it loaded a snapshot and replayed only the stream after it
            assert index["snapshot_loaded_seq"] > 0
            assert index["replayed_messages"] < index["stream_seq"]
            assert index["lost"] == 0 and index["gaps"] == 0
        print(
            f"\nindex restart: equal to the scheduler's table {took:.2f}s after the restart "
            f"(snapshot at stream seq {index['snapshot_loaded_seq']}, "
            f"{index['replayed_messages']} tail messages replayed, "
            f"snapshot load {index['snapshot_load_s']}s)"
        )
        assert took < 5.0, took


async def _snapshot_written(nc: Any) -> bool:
    return (await health(nc, "prefix-cache")).get("snapshot_seq", -1) > 0


async def test_event_stream_limits_and_replicas_on_a_single_server(
    toy_checkpoint: Path, tmp_path: Path
) -> None:
    env = {**ENV, "RLT_PREFIX_STREAM_MAX_AGE_S": "120", "RLT_PREFIX_STREAM_MAX_BYTES": "1048576"}
    with (
        NatsServer(port=free_port()) as server,
        service_procs(server.url, toy_checkpoint, tmp_path, PREFIX_ARGS, env) as procs,
    ):
        await procs.start_all(["prefix-cache"])
        async with client(server.url) as nc:
            info = await nc.jetstream().stream_info(jetstream.EVENT_STREAM)
            assert info.config.num_replicas == 1  # one server: R1
            assert info.config.max_age == 120 and info.config.max_bytes == 1 << 20
            assert info.config.subjects == ["rlt.v1.prefix.events.>"]
            assert info.config.duplicate_window == 120


async def test_a_message_deleted_mid_stream_is_skipped_once_not_retried_forever() -> None:
    """A hole in the middle of the event stream (``nats stream rmm``, or JetStream losing a
    message): the consumer restarts once to rule out a delivery hiccup, then drops what
    the index cannot vouch for and reads on, instead of restarting at the hole forever."""
    with NatsServer(port=free_port()) as server:
        async with client(server.url) as nc:
            await jetstream.ensure_event_stream(nc)
            js = nc.jetstream()
            for seq in (1, 2, 3):
                stored = BlockStored(block_hashes=[seq * 100], num_tokens_per_block=16)
                batch = PrefixEventBatch(producer_id="p", epoch="e", event_seq=seq, events=[stored])
                body = msgspec.msgpack.encode([batch])
                await js.publish(subjects.prefix_events("p"), body)
            await js.delete_msg(jetstream.EVENT_STREAM, 2)
            index = PrefixIndex()
            reader = EventReader(nc, index, "hole-test", structlog.get_logger())
            task = asyncio.create_task(reader.run())
            try:
                await wait_for(lambda: index.stream_seq == 3, 15, "read past the hole")
            finally:
                task.cancel()
            assert reader.num_lost == 1 and reader.num_resyncs == 2
            # what came after the hole is there; what came before it was dropped with it
            assert index.lookup([300]).num_blocks == 1
            assert index.lookup([100]).num_blocks == 0


async def test_a_dropped_producer_is_saved_though_no_stream_message_moved() -> None:
    """Dropping a dead shard's producer changes the index without a stream message: the next
    snapshot must still be written, or an index restart brings the dead shard back."""
    with NatsServer(port=free_port()) as server:
        async with client(server.url) as nc:
            index = PrefixIndex()
            stored = BlockStored(block_hashes=[7], num_tokens_per_block=16)
            index.apply(PrefixEventBatch(producer_id="p", epoch="e", event_seq=1, events=[stored]))
            index.stream_seq = 1
            store = SnapshotStore(nc, "drop-test", structlog.get_logger())
            assert await store.save(index) and not await store.save(index)
            index.drop_producer("p")
            assert await store.save(index)  # the same stream_seq, a new state
            restored = await SnapshotStore(nc, "drop-test", structlog.get_logger()).load()
            assert restored is not None
            assert PrefixIndex.from_snapshot(restored).producers() == []
