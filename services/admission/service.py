"""Admission actor: the public entry point (``rlt.v1.generate`` / ``rlt.v1.abort``, JSON).

Thin shell around ``AdmissionCore``: each accepted request is forwarded to the scheduler
with the client's reply subject, so the token stream goes straight from the scheduler to
the client. Rejections are answered here with one ``error`` event.

Admission also keeps the table of open requests (``OpenRequests``): each submit carries a
tracking subject ``rlt.v1.adm.<admission>.<seq>`` on which the scheduler says "accepted" and
"done". When no scheduler receives a submit, or the scheduler holding a request goes silent
(crash, restart), admission ends the request with ``unavailable``, so no client waits forever.

Fencing: a scheduler that is only stalled (SIGSTOP, a long pause) still holds its NATS
connection and would go on streaming when it resumes, so admission ends a silent
scheduler's requests only once nats-server confirms that scheduler's connection is gone (its
``rlt.v1.sched.alive.<id>`` has no responders). It remembers what it ended (``FenceLog``); a
scheduler that comes back asks (``FenceQuery``) and drops those requests without a word.
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
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError

from messages.api import ErrorEvent
from messages.errors import ErrorCode
from messages.internal import (
    AbortForward,
    FenceQuery,
    FenceUpdate,
    RequestNotice,
    SchedulerLoad,
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
)
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
from services.runtime.logging import log_content_enabled, request_fields
from services.runtime.service import Endpoint, Service
from services.runtime.tracing import (
    ATTR_REQUEST_ID,
    TRACEPARENT,
    TraceContext,
    Tracer,
    parse_traceparent,
)

# a gap this long in our own 0.25 s watch loop means we were stalled ourselves
_OWN_STALL_S = 2.0


class AdmissionService(Service):
    name = "admission"
    description = "validates, tokenizes and admits client requests; backpressure"

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
        self.num_retries = 0
        self.num_admitted = 0
        self.num_rejected = 0
        self.num_lost = 0
        self.tracer = Tracer(self.name)
        # silence before this (a stall of our own: we could not hear anyone) judges nobody
        self._judge_from = 0.0
        self._stalled_noted: set[str] = set()

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
        # inline handling keeps arrival order: an abort never overtakes its generate
        return (
            Endpoint("generate", subjects.GENERATE, self._on_generate),
            Endpoint("abort", subjects.ABORT, self._on_abort),
            # tenants: the tenant is the subject's, which its NATS user alone may publish
            Endpoint("tenant-generate", subjects.TENANT_GENERATE_ALL, self._on_generate),
            Endpoint("tenant-abort", subjects.TENANT_ABORT_ALL, self._on_abort),
            # every admission replica needs every load report: a queue group of its own
            Endpoint(
                "load",
                subjects.SCHED_LOAD,
                self._on_load,
                queue_group=f"rlt-admission-{self.instance_id}",
            ),
            # plain: it must receive the "no responders" status of our submits
            Endpoint(
                "track",
                subjects.admission_tracks_of(self.instance_id),
                self._on_track,
                micro=False,
            ),
            Endpoint(
                "fence", subjects.admission_fence(self.instance_id), self._on_fence, micro=False
            ),
        )

    async def on_ready(self) -> None:
        self.spawn(self._watch_open_requests(), "open-requests")

    def health_details(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "admitted": self.num_admitted,
            "rejected": self.num_rejected,
            "open_requests": len(self.open),
            "lost_to_scheduler_failure": self.num_lost,
            "retries": self.num_retries,
            "finished_record": len(self.finished),
            "fenced": len(self.fences),
        }
        if self.core is not None:
            n, tokens = self.core.load.waiting(time.monotonic())
            out.update(waiting_requests=n, waiting_tokens=tokens)
        return out

    # ------------------------------------------------------------------ handlers
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
            await self._reject(
                reply, AdmissionError("", ErrorCode.INTERNAL, f"admission error: {exc!r}")
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
                "reply subject (a retry "
                "must come from the reply subject of the first try); choose another request_id",
            )
        if not await self._scheduler_alive():
            raise AdmissionError(rid, ErrorCode.UNAVAILABLE, "no scheduler is running")
        if retry is Retry.REATTACH:
            self.open.superseded(rid)  # the scheduler moves the stream to this try
        else:
            self.core.check_backpressure(prepared)
        admitted = self.core.admit(prepared, reply)
        body = encode_msgpack(admitted)
        seq = admitted.admission_seq
        self.open.opened(seq, prepared.request_id, reply, prepared.trace_id, time.monotonic())
        # the tracking subject as reply: "accepted"/"done" notices, or "no responders"
        await self.nc.publish(
            subjects.SCHED_SUBMIT,
            body,
            reply=subjects.admission_track(self.instance_id, seq),
            headers={TRACEPARENT: traceparent},
        )
        self.num_admitted += 1
        extra: dict[str, Any] = {}
        if log_content_enabled():  # user data: only when the operator asks for it
            extra.update(prompt=prepared.prompt_text, prompt_token_ids=prepared.prompt_token_ids)
        self.log.info(
            "request admitted",
            num_prompt_tokens=len(prepared.prompt_token_ids),
            max_tokens=prepared.params.max_tokens,
            **extra,
            **request_fields(prepared.request_id, prepared.trace_id),
        )

    async def _on_abort(self, msg: Msg) -> None:
        assert self.core is not None
        tenant = subjects.tenant_of(msg.subject)
        reply = msg.reply or ""
        if tenant is None or (reply and self.core.check_reply_subject(reply, tenant) is not None):
            reply = ""  # never answer into the system's own subjects or another tenant's
        if tenant is None:
            return
        try:
            abort = self.core.parse_abort(msg.data)
        except AdmissionError as exc:
            if reply:
                await self._reject(reply, exc)
            return
        except Exception as exc:  # a bug here must still answer, and never end the handler
            self.log.exception("abort failed")
            if reply:
                await self._reject(reply, AdmissionError("", ErrorCode.INTERNAL, repr(exc)[:200]))
            return
        trace_id = clean_trace_id((msg.headers or {}).get(HEADER_TRACE_ID)) or ""
        forward = AbortForward(
            request_id=subjects.scoped_request_id(tenant, abort.request_id),
            reply_subject=reply,
            trace_id=trace_id,
            tenant=tenant,
        )
        await self.nc.publish(subjects.SCHED_ABORT, encode_msgpack(forward))
        fields = request_fields(abort.request_id, trace_id)
        self.log.info("abort forwarded", tenant=tenant, **fields)

    async def _scheduler_alive(self) -> bool:
        """Load reports arrive every fraction of a second; only when they stopped, ask."""
        assert self.core is not None
        if not self.core.load.is_stale(time.monotonic(), self.config.scheduler_stale_s):
            return True
        try:
            msg = await self.nc.request(subjects.SCHED_LOAD_GET, b"", timeout=1.0)
            self.core.load.apply(decode_msgpack(msg.data, SchedulerLoad))
        except (NatsError, TimeoutError, msgspec.DecodeError) as exc:
            self.log.warning("scheduler unreachable", error=repr(exc))
            return False
        return True

    async def _on_load(self, msg: Msg) -> None:
        assert self.core is not None
        try:
            report = decode_msgpack(msg.data, SchedulerLoad)
        except msgspec.DecodeError as exc:
            self.log.warning("bad load report", error=str(exc)[:200])
            return
        self.core.load.apply(report)
        self.open.heard_from(report.scheduler_id, time.monotonic())

    async def _on_track(self, msg: Msg) -> None:
        try:
            seq = int(msg.subject.rsplit(".", 1)[1])
        except ValueError:
            return
        if is_no_responders(msg):
            entry = self.open.unanswered(seq)
            if entry is not None:
                await self._end_open(entry, "no scheduler is running")
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
            public = msgspec.structs.replace(
                notice.finished, request_id=subjects.public_request_id(notice.request_id)
            )
            self.finished.add(notice.request_id, closed.reply, encode_json(public), now)

    async def _watch_open_requests(self) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(0.25)
            now = time.monotonic()
            if now - before > _OWN_STALL_S:
                self._judge_from = now  # we were stalled: we could not hear anyone either
            if not self.bus_connected:
                continue  # silence while we are cut off says nothing about the scheduler
            await self._end_lost_requests(now)

    async def _end_lost_requests(self, now: float) -> None:
        """Ends the open requests of schedulers that went silent, once nats-server confirms
        each one's connection is gone: a scheduler that is merely stalled keeps its
        connection and would resume streaming, so its requests wait for it."""
        since = max(self.bus_connected_since, self._judge_from)
        suspects = self.open.suspects(now, since)
        if not suspects:
            return
        owners = {e.owner for e in suspects.values() if e.owner is not None}
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
        # a request no scheduler accepted may sit in any stalled scheduler's inbound queue
        nobody_stalled = all(v != "stalled" for v in verdicts.values())
        ending = [
            seq
            for seq, e in suspects.items()
            if (verdicts.get(e.owner) == "gone" if e.owner is not None else nobody_stalled)
        ]
        for entry in self.open.declare(ending):
            self.fences.add(entry.owner, entry.request_id, entry.seq, time.monotonic())
            await self._end_open(
                entry, "the scheduler holding this request stopped (crash or restart); retry it"
            )

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
        fenced = self.fences.for_scheduler(query.scheduler_id, time.monotonic())
        update = FenceUpdate(
            admission_id=self.instance_id,
            fenced=fenced,
            scheduler_lost_s=self.config.scheduler_lost_s,
        )
        await self.nc.publish(msg.reply, encode_msgpack(update))
        if fenced:
            self.log.info("fence sent", scheduler=query.scheduler_id, requests=len(fenced))

    async def _end_open(self, entry: OpenRequest, message: str) -> None:
        self.num_lost += 1
        self.log.warning(
            "open request lost", reason=message, **request_fields(entry.request_id, entry.trace_id)
        )
        event = ErrorEvent(
            request_id=subjects.public_request_id(entry.request_id),
            code=str(ErrorCode.UNAVAILABLE),
            message=message,
        )
        try:
            await self.nc.publish(entry.reply, encode_json(event))
        except Exception as exc:
            self.log.warning("could not tell the client", error=repr(exc)[:200])

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
