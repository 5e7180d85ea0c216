"""Isolation and fencing, the parts that need no NATS: one request's numeric
failure ends that request only; values float32 sampling cannot compute are refused; the
permission model is the one deploy/nats.conf ships; tenants' subjects and inboxes; the
fence log, abort tombstones, reassembly and result bounds."""

from __future__ import annotations

import math
from pathlib import Path

import msgspec
import pytest
import torch

from messages.api import ErrorEvent, FinishedEvent
from messages.batch import BatchResult, WorkerSampling
from messages.errors import RequestError
from messages.internal import AdmittedRequest, WorkerResult
from messages.sampling import SamplingParams
from services.admission.core import FenceLog, OpenRequests, clean_trace_id, parse_priority_tenants
from services.common.checkpoint import load_model_limits
from services.common.config import SchedulerConfig
from services.common.sampling import SamplingError, sample_token
from services.engine.engine import LLMEngine
from services.runtime import permissions, subjects
from services.runtime.bus import HEADER_CHUNK, Reassembler, redact_url, split_credentials
from services.scheduler.driver.driver import SchedulerDriver
from services.scheduler.driver.nats_executor import NatsExecutor
from services.scheduler.driver.tombstones import AbortTombstones
from tests.helpers import relayed_events

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------- numeric failures
@pytest.mark.parametrize(
    "bad",
    [{"temperature": 1e-300}, {"temperature": 1e-5}, {"top_p": 1e-46}, {"top_p": 0.0}],
)
def test_values_float32_sampling_cannot_compute_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(RequestError):
        SamplingParams(**bad).validate()  # type: ignore[arg-type]


def test_the_smallest_accepted_values_sample() -> None:
    SamplingParams(temperature=1e-4, top_p=1.2e-38).validate()
    logits = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 30
    best = int(torch.argmax(logits))
    assert (
        sample_token(logits, temperature=1e-4, top_k=0, top_p=1.0, seed=1, output_index=0) == best
    )
    assert (
        sample_token(logits, temperature=1.0, top_k=0, top_p=1.2e-38, seed=1, output_index=0)
        == best
    )


def test_a_row_that_cannot_be_sampled_raises_a_sampling_error() -> None:
    logits = torch.randn(64, generator=torch.Generator().manual_seed(0))
    with pytest.raises(SamplingError):
        sample_token(logits, temperature=1e-300, top_k=0, top_p=1.0, seed=1, output_index=0)
    with pytest.raises(SamplingError):
        sample_token(logits, temperature=1.0, top_k=0, top_p=1e-46, seed=1, output_index=0)
    with pytest.raises(SamplingError):
        sample_token(logits * math.nan, temperature=0.0, top_k=0, top_p=1.0, seed=1, output_index=0)


def test_a_poisoned_row_fails_its_request_only(toy_model) -> None:  # type: ignore[no-untyped-def]
    """A request whose sampling overflows (its params forced past validation, as a bug or a
    newer client could) shares batches with honest ones: it ends with an error, every other
    request finishes with exactly the tokens it gets alone."""
    config = SchedulerConfig(block_size=4, num_blocks=256)
    honest = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=6, temperature=0.9, seed=3, ignore_eos=True)
    prompts = {f"r{i}": [3 + i, 50 + i, 7, 9] for i in range(5)}

    def run(ids: list[str], poison: str | None) -> dict[str, FinishedEvent | ErrorEvent]:
        engine = LLMEngine(toy_model, config)
        for rid in ids:
            engine.add_request(rid, prompts[rid], sampled if rid == "r1" else honest)
        if poison is not None:
            engine.add_request(poison, [8, 8, 8], honest)
            # past validation: the worker gets a temperature float32 turns into inf logits
            engine.scheduler.requests[poison].params.temperature = 1e-300
        events = engine.run_until_done()
        assert engine.scheduler.kv.num_free_blocks == config.num_blocks
        return {e.request_id: e for e in events if isinstance(e, FinishedEvent | ErrorEvent)}

    together = run(list(prompts), poison="bad")
    assert isinstance(together["bad"], ErrorEvent) and "sampling" in together["bad"].message
    for rid in prompts:
        alone = run([rid], poison=None)[rid]
        got = together[rid]
        assert isinstance(got, FinishedEvent) and isinstance(alone, FinishedEvent)
        assert (got.token_ids, got.exit_depths) == (alone.token_ids, alone.exit_depths)


def test_a_row_result_error_is_carried_and_old_results_decode() -> None:
    old = msgspec.msgpack.encode({"seq": 1, "rows": [{"row_index": 0, "token_id": 5}]})
    result = msgspec.msgpack.decode(old, type=BatchResult)
    assert result.rows[0].error is None
    WorkerSampling(
        temperature=1e-300, top_p=1.0, top_k=0, seed=0, min_loops=1, max_loops=1, exit_threshold=1
    )


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_a_negative_logprobs_count_does_not_decode(field: str) -> None:
    """None means "no log-probabilities"; a -1 (the old sentinel) would reach torch's topk
    and fail the whole batch, so it is refused at decode."""
    sampling = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0, "min_loops": 1,
                "max_loops": 4, "exit_threshold": 1.0}  # fmt: skip
    for count, ok in ((-1, False), (0, True), (5, True)):
        data = msgspec.msgpack.encode({**sampling, field: count})
        if ok:
            assert getattr(msgspec.msgpack.decode(data, type=WorkerSampling), field) == count
        else:
            with pytest.raises(msgspec.ValidationError):
                msgspec.msgpack.decode(data, type=WorkerSampling)


# ---------------------------------------------------------------------- fencing (pure)
def test_results_must_name_the_bound_worker_and_the_epoch() -> None:
    ex = NatsExecutor(SchedulerConfig(), "s1")
    ex.worker_id = "w1"
    good = WorkerResult(epoch=ex.epoch, result=BatchResult(seq=0), worker_id="w1")
    for bad in (
        msgspec.structs.replace(good, worker_id=""),
        msgspec.structs.replace(good, worker_id="w2"),
        msgspec.structs.replace(good, epoch="s1.99"),
    ):
        assert not ex.deliver(bad)
    assert ex.deliver(good)


def test_open_requests_are_suspects_until_declared() -> None:
    table = OpenRequests(scheduler_lost_s=2.0)
    table.opened(1, "a", "_INBOX.x.1", "t", now=0.0)
    table.heard_from("s1", 0.0)
    assert table.suspects(1.0, 0.0) == {}
    suspects = table.suspects(3.0, 0.0)
    assert list(suspects) == [1] and len(table) == 1  # not removed: confirm first
    assert [e.request_id for e in table.declare(suspects)] == ["a"] and len(table) == 0


def test_fence_log_is_per_scheduler_bounded_and_expires() -> None:
    log = FenceLog(keep_s=10.0, max_entries=3)
    log.add("s1", "a", 1, 0.0)
    log.add("s2", "b", 2, 0.0)
    log.add(None, "c", 3, 1.0)  # never accepted: any scheduler may hold it
    assert log.for_scheduler("s1", 2.0) == [("a", 1), ("c", 3)]
    assert log.for_scheduler("s2", 2.0) == [("b", 2), ("c", 3)]
    for i in range(3):
        log.add("s1", f"x{i}", 10 + i, 3.0)
    assert len(log) == 3 and [r for r, _ in log.for_scheduler("s1", 3.0)] == ["x0", "x1", "x2"]
    assert log.for_scheduler("s1", 14.0) == []
    # a scheduler names the tries it holds: the answer is bounded by them
    log.add("s1", "y", 20, 15.0)
    log.add("s1", "z", 21, 15.0)
    assert log.for_scheduler("s1", 15.0, seqs=[21, 99]) == [("z", 21)]


def test_abort_tombstones_are_per_tenant_short_lived_and_bounded() -> None:
    t = AbortTombstones(keep_s=5.0, max_entries=2)
    t.add("", "r1", 0.0)
    assert not t.take("acme", "r1", 1.0)  # another tenant's request of the same id
    assert t.take("", "r1", 1.0) and not t.take("", "r1", 1.0)  # used up
    t.add("", "r2", 0.0)
    assert not t.take("", "r2", 6.0)  # expired
    for i in range(5):
        t.add("", f"x{i}", 10.0)
    assert len(t) == 2
    # aimed at one copy (admission seq): another copy of the same request is not ended
    t = AbortTombstones(keep_s=5.0)
    t.add("", "m", 0.0, ("a1", 7))
    assert not t.take("", "m", 1.0, ("a1", 8)) and not t.take("", "m", 1.0, ("a2", 7))
    assert t.take("", "m", 1.0, ("a1", 7))
    t.add("", "m", 2.0)  # any copy, and a later copy-aimed abort does not narrow it
    t.add("", "m", 2.0, ("a1", 9))
    assert t.take("", "m", 3.0, ("a1", 8))


def test_reassembly_is_bounded_in_bytes_and_parts() -> None:
    class Msg:
        def __init__(self, data: bytes, header: str) -> None:
            self.data, self.headers = data, {HEADER_CHUNK: header}

    r = Reassembler(max_partial=8, max_parts=16, max_bytes=10_000)
    for i in range(50):  # 50 half-messages of 1 kB each: never more than 10 kB held
        assert r.feed(Msg(b"x" * 1000, f"m{i} 0 2")) is None  # type: ignore[arg-type]
        assert r.bytes <= 10_000
    assert r.feed(Msg(b"x", "big 0 17")) is None and "big" not in r._partial  # type: ignore[arg-type]
    assert r.feed(Msg(b"A", "ok 0 2")) is None  # type: ignore[arg-type]
    assert r.feed(Msg(b"B", "ok 1 2")) == b"AB"  # type: ignore[arg-type]


def test_trace_ids_and_priority_tenants() -> None:
    assert clean_trace_id("abc-123") == "abc-123"
    assert clean_trace_id("x" * 600_000) is None and clean_trace_id("a b") is None
    assert parse_priority_tenants("default, acme") == frozenset({"", "acme"})
    with pytest.raises(ValueError):
        parse_priority_tenants("Not A Tenant")


# ---------------------------------------------------------------------- the permission model
def test_deploy_nats_conf_is_the_generated_model() -> None:
    """One model, not two: the shipped file is exactly what the generator prints."""
    assert (ROOT / "deploy" / "nats.conf").read_text() == permissions.deploy_config()


def test_internal_subjects_are_published_by_their_owner_only() -> None:
    roles = permissions.SERVICE_ROLES
    owners = {
        f"{subjects.SCHED_SUBMIT}.>": {"admission"},
        subjects.SCHED_ABORT: {"admission"},
        f"{subjects.SCHED_ABORT}.>": {"admission"},
        subjects.SHARD_ANNOUNCE: {"scheduler"},
        f"{subjects.WORKER_BATCH}.>": {"scheduler"},
        f"{subjects.WORKER_RESULT}.>": {"worker"},
        subjects.SCHED_LOAD: {"scheduler"},
        f"{subjects.PREFIX_EVENTS}.>": {"scheduler"},
    }
    for subject, owner in owners.items():
        assert {name for name, p in roles.items() if subject in p.publish} == owner, subject
    for tenant in ("", "acme"):
        client = permissions.client_permissions(tenant)
        assert set(client.publish) == {
            subjects.tenant_generate(tenant),
            subjects.tenant_abort(tenant),
        }
    assert permissions.client_permissions("acme").subscribe == ("_INBOX.tenant.acme.>",)
    assert permissions.client_permissions("").subscribe_deny == ("_INBOX.tenant.>",)


def test_tenant_subjects() -> None:
    assert subjects.tenant_of("rlt.v1.generate") == ""
    assert subjects.tenant_of("rlt.v1.tenant.acme.abort") == "acme"
    assert subjects.tenant_of("rlt.v1.tenant.ACME.abort") is None
    assert subjects.tenant_of("rlt.v1.sched.submit") is None
    assert subjects.tenant_generate("acme") == "rlt.v1.tenant.acme.generate"
    with pytest.raises(ValueError):
        subjects.check_tenant("a.b")


def test_a_tracking_subject_names_its_try() -> None:
    """Notices are fenced by the try their tracking subject names (not the stream's)."""
    assert subjects.track_try(subjects.admission_track("a1", 7)) == ("a1", 7)
    assert subjects.track_try(subjects.admission_relay("a1")) is None
    assert subjects.track_try("_INBOX.x.7") is None


def test_credentials_in_urls_are_split_and_redacted() -> None:
    url = "nats://client:s3cret@127.0.0.1:4222,nats://client:s3cret@127.0.0.1:4223"
    plain, creds = split_credentials(url)
    assert plain == "nats://127.0.0.1:4222,nats://127.0.0.1:4223"
    assert creds == {"user": "client", "password": "s3cret"}
    assert "s3cret" not in redact_url(url)


# ---------------------------------------------------------------------- the driver
def _admitted(rid: str, seq: int, tenant: str = "", admission: str = "a1") -> AdmittedRequest:
    return AdmittedRequest(
        request_id=rid,
        prompt_token_ids=[5, 6, 7],
        params=SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
        reply_subject=f"{subjects.tenant_inbox(tenant)}.{rid}",
        admission_id=admission,
        admission_seq=seq,
        tenant=tenant,
        relay_subject=subjects.admission_relay(admission),
    )


def test_driver_fences_a_try_never_its_retry(toy_checkpoint: Path) -> None:
    driver = SchedulerDriver(SchedulerConfig(), load_model_limits(toy_checkpoint))
    first = driver.add(_admitted("r", 1), track="rlt.v1.adm.a1.1")
    retry = driver.add(_admitted("r", 2), track="rlt.v1.adm.a1.2")  # re-attaches
    assert not relayed_events(first) and not relayed_events(retry)
    # the retry's admission learns what the stream produced so far (nothing yet)
    (resync,) = retry.relays
    assert resync.key == ("a1", 2) and resync.item.known_token_ids == []
    assert driver.drop_fenced({("a1", 1)}) == [] and "r" in driver.streams
    assert driver.stream_key("r") == ("a1", 2)
    assert driver.drop_fenced({("a1", 2)}) == [("a1", 2)]
    assert not driver.streams and not driver.scheduler.requests
    # its ending is still counted (and its timing closed), though nothing is sent
    errors = driver.telemetry.registry.get_sample_value(
        "rlt:request_errors_total", {"code": "unavailable"}
    )
    assert errors == 1 and not driver.telemetry._timings
    # the first try's entry is told "done" when the retry takes the stream over; nothing
    # more is said about a fenced try: admission already ended it
    notices = [(track, n.state) for track, n in first.notices + retry.notices]
    assert notices == [
        ("rlt.v1.adm.a1.1", "accepted"),
        ("rlt.v1.adm.a1.1", "done"),
        ("rlt.v1.adm.a1.2", "accepted"),
    ]


def test_driver_aims_aborts_at_one_try_and_hands_a_retried_stream_over(
    toy_checkpoint: Path,
) -> None:
    driver = SchedulerDriver(SchedulerConfig(), load_model_limits(toy_checkpoint))
    driver.add(_admitted("x", 3, admission="a1"), track="rlt.v1.adm.a1.3")
    # seqs are counted per admission: an abort of a2's seq 3 is not an abort of a1's
    (out,) = driver.abort("x", "_INBOX.c", admission_id="a2", admission_seq=3).deliveries
    assert isinstance(out[1], ErrorEvent) and out[1].code == "not_found"
    assert "x" in driver.streams
    # the client retries x through admission a2, and aborts it there; the abort overtakes
    # the retry's submit: the retry re-attaches to the live stream, which then ends
    driver.abort("x", "_INBOX.c", admission_id="a2", admission_seq=7)
    out = driver.add(_admitted("x", 7, admission="a2"), track="rlt.v1.adm.a2.7")
    events = relayed_events(out)
    assert [e.finish_reason for e in events if isinstance(e, FinishedEvent)] == ["abort"]
    # through a2's relay, under the retry's seq
    assert {(r.subject, r.key) for r in out.relays} == {(subjects.admission_relay("a2"), ("a2", 7))}
    assert "x" not in driver.streams and not driver.scheduler.requests
    # a1, the admission it came through first, closes its entry without a word
    notices = [(t, n.state) for t, n in out.notices]
    assert ("rlt.v1.adm.a1.3", "done") in notices and ("rlt.v1.adm.a2.7", "accepted") in notices


def test_driver_aborts_are_per_tenant_and_remembered(toy_checkpoint: Path) -> None:
    driver = SchedulerDriver(SchedulerConfig(), load_model_limits(toy_checkpoint))
    driver.add(_admitted("r", 1, tenant="acme"))
    # another tenant: not found, and no outputs; the request runs on
    (out,) = driver.abort("r", "_INBOX.tenant.beta.x", tenant="beta").deliveries
    assert isinstance(out[1], ErrorEvent) and out[1].code == "not_found"
    assert "r" in driver.streams
    aborted = driver.abort("r", "_INBOX.tenant.acme.y", tenant="acme")
    (ack,) = [e for s, e in aborted.deliveries if s == "_INBOX.tenant.acme.y"]
    assert isinstance(ack, FinishedEvent)
    assert ack.finish_reason == "abort" and ack.token_ids == []  # never the outputs
    # an abort before its request: remembered, and the request ends without running; the
    # abort goes where every other event of the stream goes (admission passes it on)
    driver.abort("early", tenant="")
    (relay,) = driver.add(_admitted("early", 2), track="rlt.v1.adm.a1.2").relays
    assert relay.subject == subjects.admission_relay("a1") and relay.item.seq == 2
    event = relay.item.event
    assert isinstance(event, FinishedEvent) and event.finish_reason == "abort"
    assert "early" not in driver.scheduler.requests
    # a client's abort that overtook its submit (the scheduler reads them on two
    # subscriptions): confirmed to the requester, and the copy it names ends on arrival
    out = driver.abort("late", "_INBOX.c", tenant="", admission_id="a1", admission_seq=4)
    (ack,) = [e for _, e in out.deliveries]
    assert isinstance(ack, FinishedEvent) and ack.finish_reason == "abort"
    (event,) = relayed_events(driver.add(_admitted("late", 4)))
    assert isinstance(event, FinishedEvent) and event.finish_reason == "abort"
    # one aimed at a copy that already ended here: not found
    (out,) = driver.abort(
        "late", "_INBOX.c", tenant="", admission_id="a1", admission_seq=4
    ).deliveries
    assert isinstance(out[1], ErrorEvent) and out[1].code == "not_found"
    # metrics count every ending, the ones that never ran included
    registry = driver.telemetry.registry
    aborts = registry.get_sample_value("rlt:request_success_total", {"finished_reason": "abort"})
    assert aborts == 3  # "r", "early", "late"
