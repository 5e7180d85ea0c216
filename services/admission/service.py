"""Admission actor: the public entry point (``rlt.v1.generate`` / ``rlt.v1.abort``, JSON).

Thin shell around ``AdmissionCore`` (validation, tokenization), ``ShardTable`` (the engine
shards and their load reports) and ``Router`` (which shard runs a request: prefix overlap
from the prefix index against load). Each accepted request goes to its shard's scheduler
(``rlt.v1.sched.submit.<shard>``); rejections are answered here with one ``error`` event.

Admission relays every stream: its shard's scheduler sends the stream's events to
admission (``RelayBatch`` on ``rlt.v1.adm.<admission>.relay.events``, one message per step),
and admission publishes them to the client's reply subject. So admission knows exactly which
tokens the client was sent, and when a shard is lost (its scheduler's reports stop, a new
scheduler instance announces the shard, or its worker is gone while other shards are
healthy) admission resubmits each of its open requests to another shard with those tokens
and exit depths: the new shard replays them as forced exits and streams from the next
index. The client sees a delay; no index twice, none missing. Events of the old copy carry
the old admission seq and are dropped.

Admission also keeps the table of open requests (``OpenRequests``): each submit carries a
tracking subject ``rlt.v1.adm.<admission>.<seq>`` on which the scheduler says "accepted",
and on which nats-server says "no responders" when no scheduler received it. A request
that cannot move (no other healthy shard) ends with ``unavailable``, so no client waits
forever.

Fencing: a scheduler that is only stalled (SIGSTOP, a long pause) keeps its NATS connection
and would go on streaming when it resumes, so admission gives up on a silent scheduler's
requests only once nats-server confirms that scheduler's connection is gone (its
``rlt.v1.sched.alive.<id>`` has no responders), or a new scheduler announces its shard. It
remembers what it moved or ended (``FenceLog``); a scheduler that comes back asks
(``FenceQuery``) and drops those requests without a word. Relayed events of such a try are
dropped here anyway (their seq is no longer open).

Tenants: a request on ``rlt.v1.tenant.<name>.generate`` belongs to that tenant; its id is
scoped inside the engine (``<name>/<id>``) and every event the client sees carries its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError

from messages.api import ErrorEvent, FinishedEvent, StreamEvent, TokenEvent
from messages.errors import ErrorCode
from messages.internal import (
    AbortAck,
    AbortForward,
    AdmittedRequest,
    FenceQuery,
    FenceUpdate,
    RelayBatch,
    RequestNotice,
    SchedulerLoad,
    ShardAnnounce,
)
from messages.prefix import (
    PrefixLookup,
    PrefixLookupReply,
    cacheable_prefix_blocks,
    prompt_block_hashes,
)
from services.admission.core import (
    AdmissionConfig,
    AdmissionCore,
    AdmissionError,
    FenceLog,
    FinishedRecord,
    OpenRequest,
    OpenRequests,
    Prepared,
    Retry,
    classify_retry,
    clean_trace_id,
    salvage_request_id,
)
from services.admission.router import IndexGate, RecentRoutes, Router
from services.admission.shards import Refusal, Shard, ShardLoad, ShardTable, ShardTableConfig
from services.common.checkpoint import load_model_limits
from services.common.config import SchedulerConfig
from services.common.tokenizer import TextCodec
from services.runtime import subjects
from services.runtime.bus import (
    HEADER_TRACE_ID,
    decode_msgpack,
    encode_json,
    encode_msgpack,
    fits,
    is_no_responders,
)
from services.runtime.logging import log_content_enabled, request_fields
from services.runtime.service import Endpoint, Service
from services.runtime.tracing import (
    ATTR_REQUEST_ID,
    TRACEPARENT,
    TraceContext,
    Tracer,
    parse_traceparent,
)

# a shard whose reports have said "no worker" this long gives its requests to healthy shards
NO_WORKER_GRACE_S = 0.5
# the same refusal of the same shard's reports is logged at most once per this many seconds
_REFUSAL_LOG_S = 5.0
# a gap this long in our own 0.25 s watch loop means we were stalled ourselves
_OWN_STALL_S = 2.0
# aborts of ids this admission does not hold ask every shard and wait up to 0.5 s for the
# answers; beyond this many at once the requester hears ``overloaded`` instead
_MAX_BROADCAST_ABORTS = 256


class AdmissionService(Service):
    name = "admission"
    description = "validates, tokenizes and routes client requests to shards; relays streams"

    def __init__(
        self,
        nats_url: str,
        checkpoint: str | Path,
        config: AdmissionConfig | None = None,
        scheduler_config: SchedulerConfig | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(nats_url, **kwargs)
        self.checkpoint = Path(checkpoint)
        self.config = config or AdmissionConfig()
        self.scheduler_config = scheduler_config
        self.core: AdmissionCore | None = None
        self.open = OpenRequests(self.config.scheduler_lost_s, self.config.max_request_s)
        self.finished = FinishedRecord(
            self.config.finished_record_s, self.config.finished_record_bytes
        )
        self.fences = FenceLog(self.config.fence_keep_s)
        self.tracer = Tracer(self.name)
        # silence before this (a stall of our own: we could not hear anyone) judges nobody
        self._judge_from = 0.0
        self._stalled_noted: set[str] = set()
        block_size = (scheduler_config or SchedulerConfig()).block_size
        self.shards = ShardTable(
            self.instance_id,
            block_size,
            ShardTableConfig(lost_s=self.config.scheduler_lost_s),
        )
        self.router = Router(
            self.config.router,
            block_size,
            self.config.router_overlap_weight,
            self.config.router_request_weight,
        )
        self.recent = RecentRoutes()
        self.index = IndexGate(self.config.prefix_index_retry_s)
        self.relay_subject = subjects.admission_relay(self.instance_id)
        self.lookup_us: deque[float] = deque(maxlen=2000)
        self.num_retries = 0
        self.num_admitted = 0
        self.num_rejected = 0
        self.num_lost = 0
        self.num_moved = 0
        self.num_clients_gone = 0
        self.num_refused_reports = 0
        self.routed: dict[str, int] = {}
        self._logged: dict[tuple[str, str], float] = {}
        self._last_discover = float("-inf")
        self._routing: dict[str, asyncio.Future[None]] = {}  # request id -> routed
        self._broadcast_aborts = 0  # in flight

    async def setup(self) -> None:
        limits = load_model_limits(self.checkpoint)
        sc = self.scheduler_config
        if sc is not None:
            # the same KV geometry the scheduler uses, to refuse what can never fit up front
            self.config = dataclasses.replace(
                self.config,
                block_size=sc.block_size,
                num_blocks=sc.num_blocks,
                num_kv_planes=sc.num_planes(limits.total_ut_steps),
                enable_prefix_caching=sc.enable_prefix_caching,
            )
        # connected by now: requests whose messages could never cross the bus are refused
        self.config = dataclasses.replace(self.config, max_payload=self.nc.max_payload)
        self.core = AdmissionCore(
            limits,
            TextCodec.from_checkpoint(self.checkpoint),
            self.config,
            admission_id=self.instance_id,
        )

    def endpoints(self) -> Sequence[Endpoint]:
        own = f"rlt-admission-{self.instance_id}"  # every admission replica hears every one
        # generate and abort are separate subscriptions (each its own task): an abort that
        # arrives while its generate is being routed waits for it (``_routing``)
        return (
            Endpoint("generate", subjects.GENERATE, self._on_generate),
            Endpoint("abort", subjects.ABORT, self._on_abort),
            # tenants: the tenant is the subject's, which its NATS user alone may publish
            Endpoint("tenant-generate", subjects.TENANT_GENERATE_ALL, self._on_generate),
            Endpoint("tenant-abort", subjects.TENANT_ABORT_ALL, self._on_abort),
            Endpoint("load", subjects.SCHED_LOAD, self._on_load, queue_group=own),
            Endpoint("announce", subjects.SHARD_ANNOUNCE, self._on_announce, queue_group=own),
            # plain: they must receive the "no responders" status of our own publishes
            Endpoint(
                "track",
                subjects.admission_tracks_of(self.instance_id),
                self._on_track,
                micro=False,
            ),
            Endpoint(
                "gone", subjects.clients_gone_of(self.instance_id), self._on_gone, micro=False
            ),
            Endpoint("relay", self.relay_subject, self._on_relay, micro=False),
            Endpoint(
                "fence", subjects.admission_fence(self.instance_id), self._on_fence, micro=False
            ),
        )

    async def drain(self, timeout: float) -> None:
        """New requests are refused (``draining``); the streams we relay run to their end.
        What is still open at the deadline ends with ``unavailable`` and is aborted at its
        shard: no other admission can take over our relay subject."""
        deadline = time.monotonic() + timeout
        # (a generate being routed opens its entry after it, or is refused: see _forward)
        while (len(self.open) or self._routing) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for entry in self.open.close_all():
            await self._abort_and_end(
                entry, "admission shut down before the request finished; retry it"
            )

    async def on_ready(self) -> None:
        self.spawn(self._watch(), "open-requests")
        await self.nc.publish(subjects.SHARD_DISCOVER, b"")  # shards: announce yourselves

    def health_details(self) -> dict[str, Any]:
        now = time.monotonic()
        n, tokens = self.shards.waiting(now)
        lookups = sorted(self.lookup_us)
        return {
            "admitted": self.num_admitted,
            "rejected": self.num_rejected,
            "open_requests": len(self.open),
            "lost_to_scheduler_failure": self.num_lost,
            "moved": self.num_moved,
            "clients_gone": self.num_clients_gone,
            "retries": self.num_retries,
            "finished_record": len(self.finished),
            "fenced": len(self.fences),
            "waiting_requests": n,
            "waiting_tokens": tokens,
            "router": str(self.router.policy),
            "routed": dict(self.routed),
            "prefix_index_down": self.index.down_since is not None,
            "prefix_lookups": len(lookups),
            "prefix_lookup_us_p50": lookups[len(lookups) // 2] if lookups else None,
            "refused_reports": self.num_refused_reports,
            "shards": {s.shard_id: self._shard_health(s, now) for s in self.shards.shards.values()},
        }

    def _shard_health(self, shard: Shard, now: float) -> dict[str, Any]:
        load = self.shards.load(shard, now)
        return {
            "scheduler": shard.scheduler_id,
            "producer": shard.producer_id,
            "healthy": shard in self.shards.healthy(now),
            "running": load.num_running,
            "waiting": load.num_waiting,
            "active_blocks": load.active_blocks,
            "free_blocks": load.num_free_blocks,
            "step_time_s": load.step_time_s,
            "report_age_s": round(now - shard.report_at, 3) if shard.report else None,
        }

    # ------------------------------------------------------------------ generate
    async def _on_generate(self, msg: Msg) -> None:
        assert self.core is not None
        reply = msg.reply
        if not reply:
            self.log.warning("generate request without a reply subject dropped")
            return
        tenant = subjects.tenant_of(msg.subject)
        if tenant is None:
            self.log.warning("generate on an unknown subject dropped", subject=msg.subject[:100])
            return
        why = self.core.check_reply_subject(reply, tenant)
        if why is not None:  # answering there could itself be the attack: drop it
            self.num_rejected += 1
            self.log.warning(
                "generate request with a bad reply subject dropped", reason=why, tenant=tenant
            )
            return
        headers = msg.headers or {}
        # a W3C traceparent joins the caller's trace; Rlt-Trace-Id names a trace id only
        parent = parse_traceparent(headers.get(TRACEPARENT))
        trace_id = parent.trace_id if parent is not None else headers.get(HEADER_TRACE_ID)
        try:
            await self._admit(msg.data, reply, trace_id, tenant, parent)
        except AdmissionError as exc:
            await self._reject(reply, exc)
        except Exception as exc:  # a bug here must still answer the client, exactly once
            self.log.exception("generate failed")
            rid = salvage_request_id(msg.data)  # the client's own id, for its error event
            await self._reject(
                reply, AdmissionError(rid, ErrorCode.INTERNAL, f"admission error: {exc!r}")
            )

    async def _admit(
        self,
        data: bytes,
        reply: str,
        trace_id: str | None,
        tenant: str,
        parent: TraceContext | None = None,
    ) -> None:
        assert self.core is not None
        if self.draining:
            raise AdmissionError("", ErrorCode.UNAVAILABLE, "admission is shutting down")
        prepared = self.core.prepare(data, trace_id, tenant)
        span = self.tracer.start(
            "admission.admit",
            parent,
            trace_id=prepared.trace_id,
            attributes={
                ATTR_REQUEST_ID: prepared.request_id,
                "rlt.num_prompt_tokens": len(prepared.prompt_token_ids),
            },
        )
        try:
            await self._forward(prepared, reply, span.traceparent)
        except AdmissionError as exc:
            span.end(error=f"{exc.code}: {exc.message[:200]}")
            raise
        span.end()

    async def _forward(self, prepared: Prepared, reply: str, traceparent: str) -> None:
        assert self.core is not None
        rid = prepared.request_id
        retry, recorded = classify_retry(rid, reply, self.open, self.finished, time.monotonic())
        if retry is not Retry.NEW:
            self.num_retries += 1
            self.log.info("retried request", retry=retry.value, **request_fields(rid, ""))
        if retry is Retry.REPLAY and recorded is not None:
            await self.nc.publish(reply, recorded)  # it finished: the same event, no re-run
            return
        if retry is Retry.CONFLICT:
            state = "live" if self.open.find(rid) is not None else "finished"
            raise AdmissionError(
                rid,
                ErrorCode.INVALID_REQUEST,
                f"request_id {subjects.public_request_id(rid)!r} is already {state} on another "
                "reply subject (a retry must come from the reply subject of the first try); "
                "choose another request_id",
            )
        if retry is Retry.REATTACH:
            return  # we relay its stream to this very reply subject: it simply goes on
        # routing may wait for the prefix index: an abort arriving meanwhile waits for it
        routed = self._routing[rid] = asyncio.get_running_loop().create_future()
        try:
            choice, overlap = await self._route(prepared)
        finally:
            self._routing.pop(rid, None)
            routed.set_result(None)
        if self.draining:  # we may be past drain's last look at the open requests
            raise AdmissionError(rid, ErrorCode.UNAVAILABLE, "admission is shutting down")
        admitted = self.core.admit(
            prepared, reply, shard_id=choice, relay_subject=self.relay_subject
        )
        seq = admitted.admission_seq
        now = time.monotonic()
        self.open.opened(seq, rid, reply, prepared.trace_id, now, shard=choice, admitted=admitted)
        try:
            await self._submit(admitted, now, overlap, traceparent)
        except Exception:
            self.open.close(seq)  # the client hears an error: nothing may run it later
            raise
        self.num_admitted += 1
        extra: dict[str, Any] = {}
        if log_content_enabled():  # user data: only when the operator asks for it
            extra.update(prompt=prepared.prompt_text, prompt_token_ids=prepared.prompt_token_ids)
        self.log.info(
            "request admitted",
            shard=choice,
            num_prompt_tokens=len(prepared.prompt_token_ids),
            max_tokens=prepared.params.max_tokens,
            **extra,
            **request_fields(rid, prepared.trace_id),
        )

    async def _submit(
        self, admitted: AdmittedRequest, now: float, overlap_blocks: int = 0, traceparent: str = ""
    ) -> None:
        shard = admitted.shard_id
        seq = admitted.admission_seq
        prompt = len(admitted.prompt_token_ids)
        prefill = max(0, prompt - overlap_blocks * self.shards.block_size)
        self.shards.sent(shard, seq, prompt, now, prefill)
        self.routed[shard] = self.routed.get(shard, 0) + 1
        # the tracking subject as reply: the "accepted" notice, or "no responders"
        await self.nc.publish(
            subjects.sched_submit(shard),
            encode_msgpack(admitted),
            reply=subjects.admission_track(self.instance_id, seq),
            headers={TRACEPARENT: traceparent} if traceparent else None,
        )

    # ------------------------------------------------------------------ routing
    async def _route(self, prepared: Prepared, exclude: str = "") -> tuple[str, int]:
        """The shard for a request and the prefix blocks it is expected to hold there
        (raises AdmissionError when no shard can take it)."""
        assert self.core is not None
        rid = prepared.request_id
        now = time.monotonic()
        candidates = [s for s in self.shards.routable(now) if s.shard_id != exclude]
        if not candidates and not exclude:
            candidates = await self._discover_shards()
        if not candidates:
            raise AdmissionError(rid, ErrorCode.UNAVAILABLE, "no scheduler is running")
        loads = [self.shards.load(s, now) for s in candidates]
        prompt = prepared.prompt_token_ids
        open_loads = [
            load
            for load in loads
            if self.core.over_limit(load.num_waiting, load.waiting_tokens, len(prompt)) is None
        ]
        if not open_loads:
            least = min(loads, key=lambda s: (s.num_waiting, s.waiting_tokens))
            why = self.core.over_limit(least.num_waiting, least.waiting_tokens, len(prompt))
            raise AdmissionError(rid, ErrorCode.OVERLOADED, f"server overloaded: {why}")
        hashes: list[int] = []
        overlaps: dict[str, int] | None = None
        caching = any(s.prefix_caching for s in candidates)
        # a request scoring its prompt computes all of it: no shard's cache helps it
        scores_prompt = prepared.params.prompt_logprobs is not None
        if self.router.uses_overlap and caching and len(open_loads) > 1 and not scores_prompt:
            bs = self.shards.block_size
            hashes = prompt_block_hashes(prompt, bs)[: cacheable_prefix_blocks(len(prompt), bs)]
            if hashes:
                overlaps = await self._overlaps(hashes, open_loads, prepared)
        choice = self.router.choose(open_loads, len(prompt), overlaps)
        if hashes:
            self.recent.record(hashes, choice.shard_id, now)
        return choice.shard_id, choice.overlap_blocks

    async def _overlaps(
        self, hashes: list[int], loads: list[ShardLoad], prepared: Prepared
    ) -> dict[str, int] | None:
        """{shard: cached leading blocks}: the prefix index's per-producer answer, topped up
        with what this router sent each shard recently. None (load only) when the index
        cannot answer."""
        now = time.monotonic()
        if not self.index.should_ask(now):
            return None
        lookup = PrefixLookup(
            block_hashes=hashes,
            request_id=prepared.request_id,
            trace_id=prepared.trace_id,
            per_producer=True,
        )
        started = time.perf_counter()
        try:
            msg = await self.nc.request(
                subjects.PREFIX_LOOKUP,
                encode_msgpack(lookup),
                timeout=self.config.prefix_lookup_timeout_s,
            )
            answer = decode_msgpack(msg.data, PrefixLookupReply)
        except (NatsError, TimeoutError, msgspec.DecodeError) as exc:
            if self.index.failed(time.monotonic()):
                self.log.warning(
                    "prefix index unreachable; routing by load only", error=repr(exc)[:200]
                )
            return None
        self.lookup_us.append((time.perf_counter() - started) * 1e6)
        if self.index.succeeded():
            self.log.info("prefix index reachable again; routing by prefix overlap")
        by_producer = {load.producer_id: load.shard_id for load in loads}
        out = {by_producer[p]: n for p, n in answer.overlaps.items() if p in by_producer}
        for shard_id, n in self.recent.overlaps(hashes, now).items():
            out[shard_id] = max(out.get(shard_id, 0), n)
        return out

    async def _discover_shards(self) -> list[Shard]:
        """No shard known: ask them to announce and report, and wait a moment."""
        await self._ask_shards()
        try:
            msg = await self.nc.request(subjects.SCHED_LOAD_GET, b"", timeout=1.0)
            await self._on_load(msg)
        except (NatsError, TimeoutError) as exc:
            self.log.warning("scheduler unreachable", error=repr(exc))
            return []
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            routable = self.shards.routable(time.monotonic())
            if routable:
                return routable
            await asyncio.sleep(0.01)
        return []

    async def _ask_shards(self) -> None:
        now = time.monotonic()
        if now - self._last_discover >= 0.2:
            self._last_discover = now
            await self.nc.publish(subjects.SHARD_DISCOVER, b"")

    # ------------------------------------------------------------------ shards
    async def _on_announce(self, msg: Msg) -> None:
        try:
            announce = decode_msgpack(msg.data, ShardAnnounce)
        except msgspec.DecodeError as exc:
            self._log_refusal("?", "malformed announcement", error=str(exc)[:200])
            return
        refused, replaced = self.shards.announce(announce, time.monotonic())
        if refused is not None:
            self._log_refusal(announce.shard_id, f"shard refused: {refused}")
            return
        if replaced is not None:
            self.log.warning(
                "shard restarted: its requests move",
                shard=announce.shard_id,
                old_scheduler=replaced,
                scheduler=announce.scheduler_id,
            )
            for seq, entry in self.open.on_shard(announce.shard_id).items():
                if entry.owner == replaced:
                    await self._move_or_end(entry, "its scheduler restarted", seq)
        else:
            self.log.info(
                "shard announced", shard=announce.shard_id, scheduler=announce.scheduler_id
            )

    async def _on_load(self, msg: Msg) -> None:
        assert self.core is not None
        try:
            report = decode_msgpack(msg.data, SchedulerLoad)
        except msgspec.DecodeError as exc:
            self.num_refused_reports += 1
            self._log_refusal("?", "bad load report ignored (malformed)", error=str(exc)[:200])
            return
        now = time.monotonic()
        refused = self.shards.apply(report, now, time.time())
        if refused is not None:
            self.num_refused_reports += 1
            self._log_refusal(
                report.shard_id or "?",
                f"bad load report ignored ({refused})",
                scheduler=report.scheduler_id,
            )
            if refused is Refusal.UNKNOWN:
                await self._ask_shards()  # a shard we missed announces itself again
            return
        self.open.heard_from(report.scheduler_id, now)

    def _log_refusal(self, shard: str, what: str, **fields: Any) -> None:
        now = time.monotonic()
        if now - self._logged.get((shard, what), float("-inf")) >= _REFUSAL_LOG_S:
            self._logged[(shard, what)] = now
            self.log.warning(what, shard=shard, **fields)

    # ------------------------------------------------------------------ streams
    async def _on_relay(self, msg: Msg) -> None:
        try:
            batch = decode_msgpack(msg.data, RelayBatch)
        except msgspec.DecodeError as exc:
            self.log.warning("bad relayed events ignored", error=str(exc)[:200])
            return
        now = time.monotonic()
        self.open.heard_from(batch.scheduler_id, now)
        for item in batch.events:
            entry, event = self.open.relayed(batch.shard_id, item, batch.scheduler_id)
            if entry is None:
                continue
            if entry.owner is None:
                entry.owner = batch.scheduler_id
            if event is None:
                continue
            try:
                await self._pass_on(entry, event, now)
            except Exception:  # only this stream suffers; the batch's others go on
                self.log.exception(
                    "relayed event failed", **request_fields(entry.request_id, entry.trace_id)
                )

    async def _pass_on(self, entry: OpenRequest, event: StreamEvent, now: float) -> None:
        if isinstance(event, ErrorEvent) and event.code == ErrorCode.UNAVAILABLE:
            # the shard gave up on it (shutting down, no worker for too long): elsewhere?
            if await self._move(entry, f"its shard said: {event.message}", entry.seq):
                return
            self.open.close(entry.seq)
        data = encode_json(_for_client(event))
        if not fits(self.nc, len(data)):  # the scheduler and prepare() are meant to prevent it
            self.open.close(entry.seq)
            message = (
                f"the {type(event).__name__} of {len(data)} bytes exceeds the NATS "
                f"max_payload of {self.nc.max_payload} bytes"
            )
            await self._abort_and_end(entry, message, ErrorCode.INTERNAL)
            return
        reply = ""
        if isinstance(event, TokenEvent):
            # nats-server answers this with "no responders" once the client is gone
            reply = subjects.client_gone(self.instance_id, entry.seq)
        elif isinstance(event, FinishedEvent):
            # kept for a client that missed it and retries (RLT_FINISHED_RECORD_S)
            self.finished.add(entry.request_id, entry.reply, data, now)
        try:
            await self.nc.publish(entry.reply, data, reply=reply)
        except Exception as exc:  # e.g. a bad client reply subject: only that stream suffers
            self.log.warning("delivery failed", error=repr(exc)[:200])

    async def _on_gone(self, msg: Msg) -> None:
        if not is_no_responders(msg):
            return
        try:
            seq = int(msg.subject.rsplit(".", 1)[1])
        except ValueError:
            return
        entry = self.open.close(seq)
        if entry is None:
            return
        self.num_clients_gone += 1
        self.log.warning(
            "client gone; request aborted", **request_fields(entry.request_id, entry.trace_id)
        )
        await self._forward_abort(entry.request_id, entry, "", entry.trace_id, _tenant(entry))

    async def _on_track(self, msg: Msg) -> None:
        try:
            seq = int(msg.subject.rsplit(".", 1)[1])
        except ValueError:
            return
        if is_no_responders(msg):
            entry = self.open.get(seq)
            if entry is not None:
                await self._move_or_end(entry, "no scheduler serves its shard", seq)
            return
        try:
            notice = decode_msgpack(msg.data, RequestNotice)
        except msgspec.DecodeError as exc:
            self.log.warning("bad request notice", error=str(exc)[:200])
            return
        now = time.monotonic()
        closed = self.open.notice(seq, notice, now)
        if closed is not None and notice.finished is not None:
            # kept for a client that missed it and retries (RLT_FINISHED_RECORD_S)
            data = encode_json(_for_client(notice.finished))
            self.finished.add(notice.request_id, closed.reply, data, now)

    # ------------------------------------------------------------------ shard loss
    async def _watch(self) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(0.25)
            now = time.monotonic()
            if now - before > _OWN_STALL_S:
                self._judge_from = now  # we were stalled: we could not hear anyone either
            if not self.bus_connected:
                continue  # silence while we are cut off says nothing about the schedulers
            try:
                await self._check_shards(now)
            except Exception:
                self.log.exception("shard check failed")

    async def _check_shards(self, now: float) -> None:
        for entry in self.open.expired(now):
            limit = f"RLT_MAX_REQUEST_S ({self.config.max_request_s:g} s)"
            await self._abort_and_end(entry, f"request exceeded {limit}", ErrorCode.TIMEOUT)
        since = max(self.bus_connected_since, self._judge_from)
        silent = self.shards.silent(now, since)
        suspects = self.open.suspects(now, since)
        if silent or suspects:
            await self._judge(silent, suspects)
        for shard in self.shards.without_worker(now, NO_WORKER_GRACE_S):
            if not self.shards.healthy(now, exclude=shard.shard_id):
                continue  # nowhere better: they wait for a worker there
            for seq, entry in self.open.on_shard(shard.shard_id).items():
                await self._move(entry, "its shard has no worker", seq)

    async def _judge(self, silent: list[Shard], suspects: dict[int, OpenRequest]) -> None:
        """Moves (or ends) the requests of silent shards and schedulers once nats-server
        confirms each scheduler's connection is gone: one that is merely stalled keeps its
        connection and would resume streaming, so its requests wait for it."""
        owners = {e.owner for e in suspects.values() if e.owner is not None}
        owners |= {s.scheduler_id for s in silent}
        known = sorted(owners | set(self.open.schedulers()))
        verdicts = dict(zip(known, await asyncio.gather(*map(self._probe, known)), strict=True))
        for sid, verdict in verdicts.items():
            if verdict == "alive":
                self.open.heard_from(sid, time.monotonic())
            elif verdict == "stalled" and sid not in self._stalled_noted:
                self._stalled_noted.add(sid)
                self.log.warning(
                    "scheduler silent but still connected; its requests wait", scheduler=sid
                )
            if verdict != "stalled":
                self._stalled_noted.discard(sid)
        for shard in silent:
            if verdicts.get(shard.scheduler_id) != "gone":
                continue
            if self.shards.shards.get(shard.shard_id) is not shard:
                continue  # a new scheduler announced it while we probed: that path moved them
            self.shards.remove(shard.shard_id)
            self.recent.forget_shard(shard.shard_id)
            entries = self.open.on_shard(shard.shard_id)
            self.log.warning(
                "shard lost: its reports stopped and its scheduler is gone",
                shard=shard.shard_id,
                scheduler=shard.scheduler_id,
                open_requests=len(entries),
            )
            for seq, entry in entries.items():
                await self._move_or_end(entry, "its shard was lost", seq)
        # a request no scheduler accepted may sit in any stalled scheduler's inbound queue
        nobody_stalled = all(v != "stalled" for v in verdicts.values())
        for seq, entry in suspects.items():
            gone = verdicts.get(entry.owner) == "gone" if entry.owner else nobody_stalled
            if gone:
                await self._move_or_end(entry, "the scheduler holding it stopped", seq)

    async def _probe(self, scheduler_id: str) -> str:
        """ "gone": nats-server has no subscriber for that scheduler any more (its connection
        was closed: nothing more can come from it); "stalled": connected but not answering;
        "alive": it answered."""
        try:
            await self.nc.request(
                subjects.sched_alive(scheduler_id), b"", timeout=self.config.probe_timeout_s
            )
        except NoRespondersError:
            return "gone"
        except (TimeoutError, NatsError):
            return "stalled"
        return "alive"

    async def _on_fence(self, msg: Msg) -> None:
        if not msg.reply:
            return
        try:
            query = decode_msgpack(msg.data, FenceQuery)
        except msgspec.DecodeError as exc:
            self.log.warning("bad fence query", error=str(exc)[:200])
            return
        fenced = self.fences.for_scheduler(query.scheduler_id, time.monotonic(), query.seqs)
        update = FenceUpdate(
            admission_id=self.instance_id,
            fenced=fenced,
            scheduler_lost_s=self.config.scheduler_lost_s,
        )
        await self.nc.publish(msg.reply, encode_msgpack(update))
        if fenced:
            self.log.info("fence sent", scheduler=query.scheduler_id, requests=len(fenced))

    async def _move_or_end(self, entry: OpenRequest, reason: str, seen_seq: int) -> None:
        if not await self._move(entry, reason, seen_seq):
            self.open.close(entry.seq)
            # if its scheduler comes back, it drops this try without a word (fencing)
            self.fences.add(entry.owner, entry.request_id, entry.seq, time.monotonic())
            if entry.abort_requested:  # it ends, as asked, only not with its usual event
                message = f"aborted; its shard stopped before it confirmed ({reason})"
            else:
                message = f"the scheduler holding this request stopped ({reason}); retry it"
            await self._end(entry, message)

    async def _move(self, entry: OpenRequest, reason: str, seen_seq: int) -> bool:
        """Resubmits ``entry``, seen open under ``seen_seq``, to another healthy shard with the
        outputs the client has; False if it cannot move (no other healthy shard, or moved
        too often). True, doing nothing, if it ended or moved since the caller saw it."""
        assert self.core is not None
        if not self.open.is_open(entry, seen_seq):
            return True  # handled while the caller awaited something
        admitted = entry.admitted
        if admitted is None or not self.open.can_move(entry, self.config.max_moves):
            return False
        now = time.monotonic()
        old_shard, old_seq, old_owner = entry.shard, entry.seq, entry.owner
        healthy = self.shards.healthy(now, exclude=old_shard)
        if not healthy:
            return False
        loads = [self.shards.load(s, now) for s in healthy]
        target = self.router.choose(loads, len(admitted.prompt_token_ids)).shard_id
        seq = self.core.next_seq()
        resumed = msgspec.structs.replace(
            admitted,
            admission_seq=seq,
            shard_id=target,
            resume_token_ids=list(entry.token_ids),
            resume_exit_depths=list(entry.exit_depths),
        )
        self.open.moved(entry, seq, target, now)
        self.fences.add(old_owner, entry.request_id, old_seq, now)
        # the old copy, if its scheduler still runs, stops and frees its KV (only that copy)
        await self._forward_abort(
            entry.request_id, None, "", entry.trace_id, admitted.tenant, old_shard, old_seq
        )
        await self._submit(resumed, now)
        self.num_moved += 1
        self.log.warning(
            "request moved to another shard",
            reason=reason,
            from_shard=old_shard,
            to_shard=target,
            resumed_tokens=len(entry.token_ids),
            **request_fields(entry.request_id, entry.trace_id),
        )
        return True

    async def _abort_and_end(
        self, entry: OpenRequest, message: str, code: ErrorCode = ErrorCode.UNAVAILABLE
    ) -> None:
        """Ends a closed entry that may still run at its shard: stopped there, then told."""
        await self._forward_abort(entry.request_id, entry, "", entry.trace_id, _tenant(entry))
        await self._end(entry, message, code)

    async def _end(
        self, entry: OpenRequest, message: str, code: ErrorCode = ErrorCode.UNAVAILABLE
    ) -> None:
        """The client's terminal event, sent by admission (the entry is closed already)."""
        if code is ErrorCode.UNAVAILABLE:
            self.num_lost += 1
        self.log.warning(
            "open request ended by admission",
            code=str(code),
            reason=message,
            **request_fields(entry.request_id, entry.trace_id),
        )
        event = ErrorEvent(
            request_id=subjects.public_request_id(entry.request_id),
            code=str(code),
            message=message,
        )
        try:
            await self.nc.publish(entry.reply, encode_json(event))
        except Exception as exc:
            self.log.warning("could not tell the client", error=repr(exc)[:200])

    # ------------------------------------------------------------------ abort
    async def _on_abort(self, msg: Msg) -> None:
        assert self.core is not None
        tenant = subjects.tenant_of(msg.subject)
        if tenant is None:
            return
        reply = msg.reply or ""
        if reply and self.core.check_reply_subject(reply, tenant) is not None:
            reply = ""  # never answer into the system's own subjects or another tenant's
        try:
            abort = self.core.parse_abort(msg.data)
        except AdmissionError as exc:
            if reply:
                await self._reject(reply, exc)
            return
        except Exception as exc:  # a bug here must still answer, and never end the handler
            self.log.exception("abort failed")
            if reply:
                rid = salvage_request_id(msg.data)
                await self._reject(reply, AdmissionError(rid, ErrorCode.INTERNAL, repr(exc)[:200]))
            return
        trace_id = clean_trace_id((msg.headers or {}).get(HEADER_TRACE_ID)) or ""
        rid = subjects.scoped_request_id(tenant, abort.request_id)
        routing = self._routing.get(rid)
        if routing is not None:  # its generate is being routed: never overtake it
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(routing), 5.0)
        entry = self.open.find(rid)
        if entry is None or _tenant(entry) != tenant:
            # another admission routed it, or it is unknown: every shard is asked
            if self._broadcast_aborts >= _MAX_BROADCAST_ABORTS:
                if reply:
                    why = "too many aborts of requests this admission does not hold; retry"
                    await self._reject(reply, AdmissionError(rid, ErrorCode.OVERLOADED, why))
                return
            self._broadcast_aborts += 1
            self.spawn(self._abort_anywhere(rid, reply, trace_id, tenant), "abort")
            return
        entry.abort_requested = True
        await self._forward_abort(rid, entry, reply, trace_id, tenant)
        fields = request_fields(abort.request_id, trace_id)
        self.log.info("abort forwarded", tenant=tenant, **fields)

    async def _abort_anywhere(
        self, request_id: str, reply: str, trace_id: str, tenant: str
    ) -> None:
        """A broadcast abort; the shard holding the request ends it (and answers the
        requester). When no shard says it held it, the requester hears ``not_found``."""
        forward = AbortForward(
            request_id=request_id,
            reply_subject=reply,
            trace_id=trace_id,
            tenant=tenant,
            broadcast=True,
        )
        try:
            await self._ask_every_shard(forward, reply, request_id, trace_id)
        finally:
            self._broadcast_aborts -= 1

    async def _ask_every_shard(
        self, forward: AbortForward, reply: str, request_id: str, trace_id: str
    ) -> None:
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        held = False
        try:
            await self.nc.publish(subjects.SCHED_ABORT, encode_msgpack(forward), reply=inbox)
            deadline = time.monotonic() + 0.5
            answered = 0
            while answered < max(1, len(self.shards)) and not held:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    ack_msg = await sub.next_msg(timeout=left)
                except (NatsError, TimeoutError):
                    break
                if is_no_responders(ack_msg):
                    break
                answered += 1
                try:
                    held = decode_msgpack(ack_msg.data, AbortAck).held
                except msgspec.DecodeError:
                    continue
        finally:
            await sub.unsubscribe()
        self.log.info("abort broadcast", held=held, **request_fields(request_id, trace_id))
        if not held and reply:
            public = subjects.public_request_id(request_id)
            event = ErrorEvent(
                request_id=public,
                code=str(ErrorCode.NOT_FOUND),
                message=f"unknown request id {public!r}",
            )
            await self.nc.publish(reply, encode_json(event))

    async def _forward_abort(
        self,
        request_id: str,
        entry: OpenRequest | None,
        reply: str,
        trace_id: str,
        tenant: str,
        shard: str = "",
        seq: int = 0,
    ) -> None:
        """To the shard running it (only its copy of seq ``seq``); to every shard when this
        admission does not know where it runs (another admission routed it)."""
        if entry is not None and not shard:
            shard, seq = entry.shard, entry.seq
        forward = AbortForward(
            request_id=request_id,
            reply_subject=reply,
            trace_id=trace_id,
            tenant=tenant,
            admission_seq=seq,
            admission_id=self.instance_id if seq else "",
            broadcast=not shard,
        )
        subject = subjects.sched_abort(shard) if shard else subjects.SCHED_ABORT
        await self.nc.publish(subject, encode_msgpack(forward))

    async def _reject(self, reply: str, exc: AdmissionError) -> None:
        self.num_rejected += 1
        self.log.info(
            "request rejected",
            code=str(exc.code),
            reason=exc.message[:200],
            request_id=exc.request_id,
        )
        public = subjects.public_request_id(exc.request_id)
        event = ErrorEvent(request_id=public, code=str(exc.code), message=exc.message)
        await self.nc.publish(reply, encode_json(event))


def _tenant(entry: OpenRequest) -> str:
    return entry.admitted.tenant if entry.admitted is not None else subjects.DEFAULT_TENANT


def _for_client(event: StreamEvent) -> StreamEvent:
    """The event with the id the client sent (a tenant's ids are scoped inside)."""
    public = subjects.public_request_id(event.request_id)
    if public == event.request_id:
        return event
    return msgspec.structs.replace(event, request_id=public)
