"""Fuzzing (bounded; ``scripts/fuzz.py --cases 12000`` is the long run):

- every internal decoder and the pure core behind it, with a seeded mutator over valid
  messages and with hypothesis-drawn bytes: only the documented errors come out;
- the public and internal subjects of the four services running as real processes: no
  crash, every generate answered with exactly one terminal event, KV reclaimed.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from messages.internal import (
    AbortForward,
    AdmittedRequest,
    RequestNotice,
    SchedulerLoad,
    WorkerBatch,
    WorkerHeartbeat,
    WorkerResult,
)
from messages.prefix import PrefixEventBatch, PrefixIndexSnapshot, PrefixLookup
from scripts.fuzz import fuzz_decoders, run_live
from services.admission.core import AdmissionConfig, AdmissionCore, AdmissionError
from services.common.checkpoint import load_model_limits
from services.common.tokenizer import TextCodec
from services.launcher import NatsServer, free_port
from services.runtime.bus import decode_json, decode_msgpack
from tests.service_procs import service_procs

DECODER_CASES = 4000
LIVE_CASES = 1500
INTERNAL_TYPES = [
    AdmittedRequest,
    AbortForward,
    SchedulerLoad,
    WorkerBatch,
    WorkerResult,
    WorkerHeartbeat,
    RequestNotice,
    PrefixEventBatch,
    PrefixLookup,
    PrefixIndexSnapshot,
]


@pytest.mark.unit
def test_mutated_messages_into_every_decoder_and_core(toy_checkpoint: Path) -> None:
    report = fuzz_decoders(toy_checkpoint, DECODER_CASES, seed=7)
    assert report.cases == DECODER_CASES
    assert len(report.per_target) >= 15  # every subject the system reads was hit
    assert report.decoded > DECODER_CASES // 10  # mutations that still decode reach the cores


@pytest.mark.unit
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=256), index=st.integers(0, len(INTERNAL_TYPES) - 1))
def test_random_bytes_only_raise_decode_errors(data: bytes, index: int) -> None:
    typ = INTERNAL_TYPES[index]
    for decode in (decode_msgpack, decode_json):
        with contextlib.suppress(msgspec.DecodeError):
            decode(data, typ)


@pytest.fixture(scope="module")
def admission_core(toy_checkpoint: Path) -> AdmissionCore:
    return AdmissionCore(
        load_model_limits(toy_checkpoint),
        TextCodec.from_checkpoint(toy_checkpoint),
        AdmissionConfig(max_payload=1 << 20),
    )


@pytest.mark.unit
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.one_of(
        st.binary(max_size=200),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
            lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids),
            max_leaves=12,
        ).map(lambda v: msgspec.json.encode(v)),
        st.fixed_dictionaries(
            {},
            optional={
                "prompt": st.text(max_size=50),
                "prompt_token_ids": st.lists(st.integers(-5, 600), max_size=20),
                "max_tokens": st.integers(-2, 5000),
                "temperature": st.floats(allow_nan=True),
                "top_p": st.floats(-1, 2),
                "top_k": st.integers(-2, 2**70),
                "priority": st.integers(-(2**65), 2**65),
                "stop_token_ids": st.lists(st.integers(-1, 2**65), max_size=3),
                "min_loops": st.integers(-1, 6),
                "max_loops": st.integers(-1, 6),
                "exit_threshold": st.floats(-1, 2),
                "request_id": st.text(max_size=10),
            },
        ).map(lambda v: msgspec.json.encode(v)),
    )
)
def test_public_request_parser_only_raises_admission_errors(
    admission_core: AdmissionCore, data: bytes
) -> None:
    try:
        admission_core.prepare(data)
    except AdmissionError as exc:
        assert exc.code in ("invalid_request",) and exc.message
    try:
        admission_core.parse_abort(data)
    except AdmissionError as exc:
        assert exc.code == "invalid_request"


@pytest.mark.services
async def test_live_services_survive_fuzzing_and_answer_every_request(
    toy_checkpoint: Path, tmp_path: Path
) -> None:
    args = ["--enable-prefix-caching", "--block-size", "4", "--num-blocks", "1024"]
    env = {"RLT_MAX_REQUEST_S": "30"}  # a mutated request may ask for many tokens
    with (
        NatsServer(port=free_port()) as server,
        service_procs(server.url, toy_checkpoint, tmp_path, args, env) as procs,
    ):
        await procs.start_all()
        report = await run_live(server.url, procs, LIVE_CASES, seed=3, rate=500)
    print(f"\nlive fuzz: {report}")
    assert report.cases == LIVE_CASES
    assert len(report.per_subject) >= 15, report.per_subject
    assert report.generate_with_reply > 100
    assert report.unanswered == 0 and report.duplicates == 0, report
    assert not report.crashes, report.crashes
    assert report.kv_reclaimed and report.valid_after_ok, report
