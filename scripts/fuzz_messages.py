"""The fuzzer's messages: a valid one for every subject the system reads, and a seeded
``Mutator`` that breaks them (structural mutations of the decoded message, byte-level
mutations of the encoded one, and plain random bytes). ``scripts/fuzz.py`` drives them.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import msgspec

from messages.api import AbortRequest, GenerateRequest, TokenEvent
from messages.batch import (
    Batch,
    BatchKind,
    BatchResult,
    BatchRow,
    BlockDelta,
    NewRequest,
    RowKind,
    RowResult,
    WorkerSampling,
)
from messages.internal import (
    AbortForward,
    AdmittedRequest,
    FenceQuery,
    RelayBatch,
    RelayedEvent,
    RequestNotice,
    SchedulerLoad,
    ShardAnnounce,
    WorkerBatch,
    WorkerHeartbeat,
    WorkerResult,
)
from messages.prefix import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    PrefixEventBatch,
    PrefixIndexSnapshot,
    PrefixLookup,
    ProducerSnapshot,
)
from messages.sampling import SamplingParams
from services.runtime import subjects

INTERESTING: list[Any] = [
    None, True, False, 0, 1, -1, 2, 3, 4097, 2**31, -(2**31), 2**63 - 1, 2**64, -(2**63),
    0.5, -0.0, 1e300, float("inf"), "", "x", "a" * 300, "rlt.v1.worker.batch", "_INBOX.x",
    "\u0000", "\ud7ff", [], [1, 2, 3], [-1], {}, {"a": 1},
]  # fmt: skip


class Mutator:
    """Seeded mutations of a valid message (``obj`` decoded, ``data`` encoded)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def mutate(self, obj: Any, encode: Callable[[Any], bytes]) -> bytes:
        r = self.rng.random()
        if r < 0.45:
            try:
                return encode(self.structural(obj))
            except (TypeError, ValueError, OverflowError, msgspec.EncodeError):
                return encode(obj)
        if r < 0.9:
            return self.bytewise(encode(obj))
        return self.rng.randbytes(self.rng.randrange(0, 64))

    def structural(self, obj: Any, depth: int = 0) -> Any:
        rng = self.rng
        if isinstance(obj, dict) and obj and depth < 6:
            out = dict(obj)
            key = rng.choice(list(out))
            op = rng.random()
            if op < 0.15:
                del out[key]
            elif op < 0.25:
                out[rng.choice(["extra", "", key + "_"])] = rng.choice(INTERESTING)
            elif op < 0.6:
                out[key] = rng.choice(INTERESTING)
            else:
                out[key] = self.structural(out[key], depth + 1)
            return out
        if isinstance(obj, list) and obj and depth < 6:
            out_list = list(obj)
            i = rng.randrange(len(out_list))
            op = rng.random()
            if op < 0.2:
                del out_list[i]
            elif op < 0.35:
                out_list.insert(i, rng.choice(out_list))
            elif op < 0.6:
                out_list[i] = rng.choice(INTERESTING)
            else:
                out_list[i] = self.structural(out_list[i], depth + 1)
            return out_list
        if isinstance(obj, bool):
            return not obj
        if isinstance(obj, int):
            return rng.choice([obj + 1, obj - 1, -obj, obj * 1000, rng.choice(INTERESTING)])
        if isinstance(obj, float):
            return rng.choice([obj * 2, -obj, float("nan"), rng.choice(INTERESTING)])
        if isinstance(obj, str):
            return rng.choice([obj[:-1], obj + "x", obj * 2, rng.choice(INTERESTING)])
        return rng.choice(INTERESTING)

    def bytewise(self, data: bytes) -> bytes:
        rng = self.rng
        buf = bytearray(data)
        for _ in range(rng.randrange(1, 4)):
            op = rng.random()
            if not buf or op < 0.15:
                buf.extend(rng.randbytes(rng.randrange(1, 8)))
            elif op < 0.4:
                i = rng.randrange(len(buf))
                buf[i] ^= 1 << rng.randrange(8)
            elif op < 0.55:
                i = rng.randrange(len(buf))
                buf[i] = rng.randrange(256)
            elif op < 0.7:
                del buf[rng.randrange(len(buf)) :]
            elif op < 0.85:
                i = rng.randrange(len(buf))
                del buf[i : i + rng.randrange(1, 6)]
            else:
                i, j = sorted(rng.randrange(len(buf) + 1) for _ in range(2))
                buf[i:i] = buf[i:j]
        return bytes(buf)


def _mp(obj: Any) -> bytes:
    return msgspec.msgpack.encode(obj)


def _js(obj: Any) -> bytes:
    return msgspec.json.encode(obj)


def _plain(struct: msgspec.Struct) -> Any:
    return msgspec.to_builtins(struct)


def valid_messages(ids: dict[str, str]) -> list[tuple[str, Any, Callable[[Any], bytes]]]:
    """(subject, valid message as plain data, encoder) for every subject the system reads.
    ``ids``: worker, scheduler, scheduler_epoch, admission (instance ids of the live run)."""
    params = SamplingParams(max_tokens=8, temperature=0.0, min_loops=1, exit_threshold=0.7)
    batch = Batch(
        seq=3,
        kind=BatchKind.RECURRENT,
        rows=[
            BatchRow(
                request_id="r1", kind=RowKind.PREFILL, token_start=0, token_count=3, embed=True
            )
        ],
        new_requests=[
            NewRequest(
                request_id="r1",
                prompt_token_ids=[1, 2, 3],
                sampling=WorkerSampling(
                    temperature=0.0,
                    top_p=1.0,
                    top_k=0,
                    seed=1,
                    min_loops=1,
                    max_loops=4,
                    exit_threshold=1.0,
                ),
            )
        ],
        block_deltas=[BlockDelta(request_id="r1", plane_blocks=[[0], [1], [2], [3]])],
    )
    prefix = PrefixEventBatch(
        producer_id="scheduler",
        epoch="0" * 32,
        event_seq=2,
        events=[
            BlockStored(block_hashes=[1, 2]),
            BlockRemoved(block_hashes=[2]),
            AllBlocksCleared(),
        ],
    )
    text_request = GenerateRequest(prompt="hello there", **_params_dict(params))
    return [
        (subjects.GENERATE, _plain(text_request), _js),
        (
            subjects.GENERATE,
            _plain(GenerateRequest(prompt_token_ids=[5, 6, 7], **_params_dict(params))),
            _js,
        ),
        (subjects.ABORT, _plain(AbortRequest(request_id="fuzz-x")), _js),
        # a tenant's subjects (its replies must be in its own inbox: the sink is not, so
        # admission answers nothing there)
        (subjects.tenant_generate("fuzz"), _plain(text_request), _js),
        (subjects.tenant_abort("fuzz"), _plain(AbortRequest(request_id="fuzz-x")), _js),
        (
            subjects.admission_fence(ids["admission"]),
            _plain(FenceQuery(scheduler_id=ids["scheduler"])),
            _mp,
        ),
        (subjects.sched_alive(ids["scheduler"]), b"", lambda _o: b""),
        (  # shaped as admission submits, from an admission nobody runs (its relayed
            # events reach no one, never another request's client)
            subjects.sched_submit("0"),
            _plain(
                AdmittedRequest(
                    request_id="fz-sub",
                    prompt_token_ids=[1, 2, 3],
                    params=params,
                    reply_subject="_INBOX.fuzz-sink",
                    admission_id="fuzz",
                    admission_seq=1,
                    relay_subject=subjects.admission_relay("fuzz"),
                )
            ),
            _mp,
        ),
        (subjects.SCHED_ABORT, _plain(AbortForward(request_id="fz-none", broadcast=True)), _mp),
        (subjects.sched_abort("0"), _plain(AbortForward(request_id="fz-none")), _mp),
        (
            subjects.SCHED_LOAD,
            _plain(
                SchedulerLoad(
                    scheduler_id="fz",
                    shard_id="0",
                    report_seq=5,
                    num_waiting=1,
                    last_admission_seq={"a": 1},
                )
            ),
            _mp,
        ),
        (
            subjects.SHARD_ANNOUNCE,
            _plain(ShardAnnounce(shard_id="fz", scheduler_id="fz", block_size=4)),
            _mp,
        ),
        (subjects.SHARD_DISCOVER, b"", lambda _o: b""),
        (
            subjects.admission_relay(ids["admission"]),
            _plain(
                RelayBatch(
                    shard_id="0",
                    scheduler_id="fz",
                    events=[
                        RelayedEvent(
                            seq=1,
                            event=TokenEvent(
                                request_id="x", index=0, token_id=3, exit_depth=2, text=""
                            ),
                        ),
                        RelayedEvent(seq=2, known_token_ids=[1], known_exit_depths=[4]),
                    ],
                )
            ),
            _mp,
        ),
        (subjects.client_gone(ids["admission"], 1), b"", lambda _o: b""),
        (subjects.SCHED_LOAD_GET, b"", lambda _o: b""),
        (
            subjects.worker_heartbeat("0"),
            _plain(WorkerHeartbeat(worker_id="fz-worker", epoch="e.0", next_seq=3)),
            _mp,
        ),
        (
            subjects.worker_batch(ids["worker"]),
            _plain(
                WorkerBatch(
                    epoch="fz.0",
                    batch=batch,
                    num_blocks=64,
                    block_size=4,
                    kv_layout="last_exited",
                    epoch_start_seq=3,
                    worker_id=ids["worker"],
                )
            ),
            _mp,
        ),
        (
            subjects.worker_result(ids["scheduler_epoch"]),
            _plain(
                WorkerResult(
                    epoch=ids["scheduler_epoch"],
                    result=BatchResult(seq=10**6, rows=[RowResult(row_index=0, token_id=3)]),
                    worker_id="fz",
                )
            ),
            _mp,
        ),
        # the JetStream event stream stores what is published on its subjects: a list of
        # envelopes per message (its consumer must skip whatever it cannot decode)
        (subjects.prefix_events("fz"), [_plain(prefix)], _mp),
        (subjects.PREFIX_LOOKUP, _plain(PrefixLookup(block_hashes=[1, 2, 3])), _mp),
        (
            "$O.RLT_PREFIX_INDEX.snapshot",  # not a live subject: the snapshot decoder only
            _plain(
                PrefixIndexSnapshot(
                    stream_seq=3,
                    producers=[ProducerSnapshot(producer_id="p", epoch="e", blocks=b"\x01" * 8)],
                )
            ),
            _mp,
        ),
        (
            subjects.admission_track(ids["admission"], 1),
            _plain(RequestNotice(request_id="x", scheduler_id="fz", state="done")),
            _mp,
        ),
        (subjects.worker_discover("0"), b"", lambda _o: b""),
    ]


def _params_dict(p: SamplingParams) -> dict[str, Any]:
    return {name: getattr(p, name) for name in SamplingParams.__struct_fields__}
