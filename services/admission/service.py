"""Admission actor: the public entry point (``rlt.v1.generate`` / ``rlt.v1.abort``, JSON).

Thin shell: its NATS handlers decode a message and hand it to the part that owns its
concept. Pure (no NATS): ``AdmissionCore`` (``validation``: decoding, tokenization, model
checks; backpressure), ``tables`` (open requests, fences, finished records), ``ShardTable``
(``shards``) and ``Router`` (``router``). Over NATS: ``intake`` (retries, then route, open,
submit), ``routing`` (which shard runs a request: prefix overlap from the prefix index
against load), ``membership`` (announcements, load reports), ``relay`` (streams to clients),
``shard_moves`` (shard loss, moves, fencing) and ``aborts``. Each accepted request goes to
its shard's scheduler (``rlt.v1.sched.submit.<shard>``); rejections are answered here with
one ``error`` event.

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
import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
from nats.aio.msg import Msg

from messages.api import ErrorEvent
from messages.errors import ErrorCode
from messages.internal import FenceQuery, RelayBatch, RequestNotice
from services.admission.aborts import Aborts
from services.admission.config import AdmissionConfig
from services.admission.core import AdmissionCore
from services.admission.errors import AdmissionError
from services.admission.intake import Intake
from services.admission.membership import ShardMembership
from services.admission.relay import Relay
from services.admission.routing import Routing
from services.admission.shard_moves import ShardMoves
from services.admission.shards import ShardTable, ShardTableConfig
from services.admission.tables import FenceLog, FinishedRecord, OpenRequests
from services.admission.validation import clean_trace_id, salvage_request_id
from services.common.checkpoint import load_model_limits
from services.common.config import SchedulerConfig
from services.common.tokenizer import TextCodec
from services.runtime import subjects
from services.runtime.bus import (
    HEADER_TRACE_ID,
    decode_msgpack,
    encode_json,
    encode_msgpack,
    is_no_responders,
)
from services.runtime.service import Endpoint, Service
from services.runtime.tracing import (
    ATTR_REQUEST_ID,
    TRACEPARENT,
    TraceContext,
    Tracer,
    parse_traceparent,
)


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
        self.tracer = Tracer(self.name)
        self.relay_subject = subjects.admission_relay(self.instance_id)
        self.num_rejected = 0
        # what admission remembers about requests (pure tables)
        self.open = OpenRequests(self.config.scheduler_lost_s, self.config.max_request_s)
        self.finished = FinishedRecord(
            self.config.finished_record_s, self.config.finished_record_bytes
        )
        self.fences = FenceLog(self.config.fence_keep_s)
        block_size = (scheduler_config or SchedulerConfig()).block_size
        self.shards = ShardTable(
            self.instance_id, block_size, ShardTableConfig(lost_s=self.config.scheduler_lost_s)
        )
        # what it does over NATS, by concept (each reads the settings given here: setup
        # changes only validation's)
        self.membership = ShardMembership(self, self.shards, self.open)
        self.routing = Routing(self, self.config, self.membership, block_size)
        self.aborts = Aborts(self, self.open, self.shards, self.routing.in_flight)
        self.moves = ShardMoves(
            self, self.config, self.open, self.fences, self.routing, self.aborts, self._next_seq
        )
        self.relay = Relay(self, self.open, self.finished, self.moves, self.aborts)
        self.intake = Intake(self, self.open, self.finished, self.routing, self.relay_subject)

    @property
    def num_admitted(self) -> int:
        return self.intake.num_admitted

    @property
    def num_retries(self) -> int:
        return self.intake.num_retries

    @property
    def routed(self) -> dict[str, int]:
        """Requests submitted per shard (moves included)."""
        return self.routing.routed

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
                structured_outputs_backend=sc.structured_outputs_backend,
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
        # arrives while its generate is being routed waits for it (``RoutesInFlight``)
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
        # (a generate being routed opens its entry after it, or is refused: Intake.forward)
        while (len(self.open) or self.routing.in_flight) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for entry in self.open.close_all():
            await self.aborts.abort_and_end(
                entry, "admission shut down before the request finished; retry it"
            )

    async def on_ready(self) -> None:
        self.spawn(self.moves.watch(), "open-requests")
        await self.nc.publish(subjects.SHARD_DISCOVER, b"")  # shards: announce yourselves

    def health_details(self) -> dict[str, Any]:
        now = time.monotonic()
        n, tokens = self.shards.waiting(now)
        routing = self.routing
        lookups = sorted(routing.lookup_us)
        return {
            "admitted": self.num_admitted,
            "rejected": self.num_rejected,
            "open_requests": len(self.open),
            "lost_to_scheduler_failure": self.aborts.num_lost,
            "moved": self.moves.num_moved,
            "handed_over": self.moves.num_handed_over,
            "clients_gone": self.relay.num_clients_gone,
            "retries": self.num_retries,
            "finished_record": len(self.finished),
            "fenced": len(self.fences),
            "waiting_requests": n,
            "waiting_tokens": tokens,
            "router": str(routing.router.policy),
            "routed": dict(routing.routed),
            "prefix_index_down": routing.index.down_since is not None,
            "prefix_lookups": len(lookups),
            "prefix_lookup_us_p50": lookups[len(lookups) // 2] if lookups else None,
            "refused_reports": self.membership.num_refused_reports,
            "shards": self.shards.health(now),
        }

    def _next_seq(self) -> int:
        assert self.core is not None
        return self.core.next_seq()

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
        if prepared.params.structured_output is not None:
            # compiling the format loads its grammar engine on first use: off the loop
            await asyncio.to_thread(self.core.check_structured_output, prepared)
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
            await self.intake.forward(self.core, prepared, reply, span.traceparent)
        except AdmissionError as exc:
            span.end(error=f"{exc.code}: {exc.message[:200]}")
            raise
        span.end()

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
        try:
            await self.aborts.abort(rid, abort.request_id, reply, trace_id, tenant)
        except AdmissionError as exc:  # too many aborts of ids held elsewhere at once
            if reply:
                await self._reject(reply, exc)

    # ------------------------------------------------------------------ shards
    async def _on_announce(self, msg: Msg) -> None:
        restarted = self.membership.announced(msg.data)
        if restarted is not None:
            await self.moves.scheduler_replaced(*restarted)

    async def _on_load(self, msg: Msg) -> None:
        await self.membership.reported(msg.data)

    async def _on_fence(self, msg: Msg) -> None:
        if not msg.reply:
            return
        try:
            query = decode_msgpack(msg.data, FenceQuery)
        except msgspec.DecodeError as exc:
            self.log.warning("bad fence query", error=str(exc)[:200])
            return
        update = self.moves.fence_update(query)
        await self.nc.publish(msg.reply, encode_msgpack(update))
        if update.fenced:
            self.log.info("fence sent", scheduler=query.scheduler_id, requests=len(update.fenced))

    # ------------------------------------------------------------------ streams
    async def _on_relay(self, msg: Msg) -> None:
        try:
            batch = decode_msgpack(msg.data, RelayBatch)
        except msgspec.DecodeError as exc:
            self.log.warning("bad relayed events ignored", error=str(exc)[:200])
            return
        await self.relay.relay(batch)

    async def _on_gone(self, msg: Msg) -> None:
        if not is_no_responders(msg):
            return
        seq = _seq_of(msg.subject)
        if seq is not None:
            await self.relay.client_gone(seq)

    async def _on_track(self, msg: Msg) -> None:
        seq = _seq_of(msg.subject)
        if seq is None:
            return
        if is_no_responders(msg):
            entry = self.open.get(seq)
            if entry is not None:
                await self.moves.move_or_end(entry, "no scheduler serves its shard", seq)
            return
        try:
            notice = decode_msgpack(msg.data, RequestNotice)
        except msgspec.DecodeError as exc:
            self.log.warning("bad request notice", error=str(exc)[:200])
            return
        self.relay.noticed(seq, notice)


def _seq_of(subject: str) -> int | None:
    """The admission seq a per-request subject ends with (None: not a number)."""
    try:
        return int(subject.rsplit(".", 1)[1])
    except ValueError:
        return None
