"""What admission asks of a scheduler: submits (a new request, a client's retry of a live
one, one refused or aborted before it ran) and aborts, and the stream events they cause.

``Submissions`` is the half of ``SchedulerDriver`` (driver.py) that decides what each
becomes and what admission and an abort's requester hear; the driver supplies the core it
runs on and hands everything out in its ``StepOutput``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from messages.api import StreamEvent
from messages.errors import ErrorCode, RequestError
from messages.internal import AdmittedRequest, RelayedEvent, RequestNotice
from services.common.sparse_prefill import prefill_setting
from services.runtime import subjects
from services.runtime.logging import log_content_enabled, request_fields
from services.scheduler.core.intake import KnownOutputs
from services.scheduler.driver.load_report import LoadReport
from services.scheduler.driver.step_output import Relay, StepOutput
from services.scheduler.driver.streams import Stream, Streams, aborted, error_event
from services.scheduler.driver.telemetry import SchedulerTelemetry
from services.scheduler.driver.tombstones import ANY, AbortTombstones
from services.scheduler.engine_core import EngineCore


class Submissions:
    """Submits and aborts; ``SchedulerDriver`` is the rest (the loop, the worker)."""

    # what the driver provides
    core: EngineCore
    streams: Streams
    tombstones: AbortTombstones
    telemetry: SchedulerTelemetry
    load_report: LoadReport
    log: Any
    instance: str
    shard_id: str
    draining: bool
    simulated: bool
    num_resumed: int
    _out: StepOutput  # what the calls since the last output produced

    def _take(self) -> StepOutput:
        """Everything to send since the last call (the driver adds batches and prefix
        events)."""
        raise NotImplementedError

    def add(self, req: AdmittedRequest, track: str = "", traceparent: str = "") -> StepOutput:
        """Queues an admitted request. ``track`` is admission's tracking subject: it hears
        "accepted"; the stream's events go to ``req.relay_subject``. ``traceparent`` is
        admission's span (the parent of ours)."""
        fields = request_fields(req.request_id, req.trace_id)
        relay = req.relay_subject
        if relay is None or not relay.startswith(subjects.ADMISSION_TRACK_PREFIX):
            # only admission submits, and it always names its relay: nowhere to answer
            self.log.error("submit without admission's relay subject dropped", **fields)
            return self._take()
        if req.admission_id:
            self.load_report.submitted(req.admission_id, req.admission_seq, time.monotonic())
        if req.shard_id and req.shard_id != self.shard_id:
            self.log.warning("request for another shard refused", shard=req.shard_id, **fields)
            message = f"sent to shard {self.shard_id}, not {req.shard_id}"
            return self._refuse(req, ErrorCode.INTERNAL, message)
        live = self.streams.get(req.request_id)
        if live is not None and live.tenant != req.tenant:
            message = f"request_id {req.request_id!r} is in use"
            return self._refuse(req, ErrorCode.INVALID_REQUEST, message)
        if live is not None:
            self._reattach(req, live, track, relay)
            if req.kv_source is not None:  # it goes on here with the KV it has
                self._out.kv_releases.append(req.kv_source)
            if self.tombstones.take(req.tenant, req.request_id, time.monotonic(), live.key):
                self._abort_live(req.request_id)  # the retry's abort came first
            return self._take()
        try_ = (req.admission_id, req.admission_seq)
        if self.tombstones.take(req.tenant, req.request_id, time.monotonic(), try_):
            # its abort came first: it ends now, without running (as asked, even if we drain)
            self.log.info("request aborted before it arrived", **fields)
            self._notice(track, req.request_id, "accepted")
            return self._end_unstarted(req, aborted(req.request_id, len(req.prompt_token_ids)))
        if self.draining:
            return self._refuse(req, ErrorCode.UNAVAILABLE, "scheduler is shutting down")
        # empty unless it resumes a request a lost shard started
        known = KnownOutputs(req.resume_token_ids, req.resume_exit_depths, req.resume_depth_budgets)
        try:
            done = self.core.add_request(
                req.request_id,
                req.prompt_token_ids,
                req.params,
                trace_id=req.trace_id,
                known_outputs=known,
                hand_off=req.hand_off,
                kv_source=req.kv_source,
                prefill_setting=req.prefill_setting,
            )
        except RequestError as exc:
            self.log.info("request refused", code=str(exc.code), reason=exc.message[:200], **fields)
            return self._refuse(req, exc.code, exc.message)
        except Exception as exc:  # a scheduler bug must not take the service down
            self.log.exception("add_request failed", **fields)
            return self._refuse(req, ErrorCode.INTERNAL, f"scheduler error: {exc!r}")
        self.streams.add(req.request_id, Stream.of(req, track))
        self.telemetry.on_added(req, traceparent)
        self._notice(track, req.request_id, "accepted")
        extra: dict[str, Any] = {}
        if log_content_enabled():
            extra["prompt_token_ids"] = req.prompt_token_ids
        if known.token_ids:
            self.num_resumed += 1
            extra["resumed_tokens"] = len(req.resume_token_ids)
        if req.kv_source is not None:
            extra["kv_from_shard"] = req.kv_source.shard_id
        if req.hand_off:
            extra["hand_off"] = True
        self.log.info(
            "request added",
            num_prompt_tokens=len(req.prompt_token_ids),
            max_tokens=req.params.max_tokens,
            **extra,
            **fields,
        )
        self._route(done)
        return self._take()

    def _reattach(self, req: AdmittedRequest, live: Stream, track: str, relay: str) -> None:
        """A client's retry of a live request (same request_id): no second generation; the
        stream goes on under the retry's try, relay and tracking subject."""
        if live.track and live.track != track:
            # the admission it came through first closes its entry without a word
            self._notice(live.track, req.request_id, "done")
        live.track, live.relay = track, relay
        live.admission_id, live.admission_seq = req.admission_id, req.admission_seq
        # the retry's admission learns what the stream has produced so far
        request = self.core.scheduler.requests.get(req.request_id)
        if request is not None:
            resync = RelayedEvent(
                seq=live.admission_seq,
                known_token_ids=list(request.output_token_ids),
                known_exit_depths=list(request.output_exit_loops),
                known_depth_budgets=request.shed_depth_budgets(),
            )
            self._out.relays.append(Relay(live.relay, live.admission_id, resync))
        self._notice(track, req.request_id, "accepted")
        self.log.info("request re-attached", **request_fields(req.request_id, req.trace_id))

    def _refuse(self, req: AdmittedRequest, code: ErrorCode, message: str) -> StepOutput:
        return self._end_unstarted(req, error_event(req.request_id, code, message))

    def _end_unstarted(self, req: AdmittedRequest, event: StreamEvent) -> StepOutput:
        """The terminal event of a request that never ran, through its relay (admission
        passes it on and so learns it ended). Metrics count it like any other ending (a
        refusal by its error code, an early abort as finished "abort"). The KV a prefill
        shard handed over with it is released."""
        if req.kv_source is not None:
            self._out.kv_releases.append(req.kv_source)
        self.telemetry.on_events([event], self.core.inflight)
        self.streams.remember_ended(req.request_id, (req.admission_id, req.admission_seq))
        self._out.relays.append(Stream.of(req).relay_of(event))
        return self._take()

    def abort(
        self,
        request_id: str,
        requester_reply: str = "",
        tenant: str = "",
        *,
        admission_id: str = "",
        admission_seq: int = 0,
        broadcast: bool = False,
    ) -> StepOutput:
        """Ends a live request of ``tenant`` with ``finish_reason: abort``. ``admission_seq``
        > 0 aborts only the try ``(admission_id, admission_seq)`` (a request admission moved
        away from here, or the copy admission knows of). An abort for a request that is not
        here (yet) is remembered for a few seconds (``tombstones``) and honoured if the
        request arrives; the requester hears ``not_found`` now, unless the abort was a
        ``broadcast`` to every shard, or it named a try that has not been here while no
        other copy runs here (its submit is behind it: the requester hears the abort
        confirmed), or a try this shard handed to a decode shard (admission, which sent
        the abort here before it knew, ends it instead of moving it on: confirmed too).
        The requester's reply carries no outputs: those go to the request's own stream
        only."""
        aimed = (admission_id, admission_seq) if admission_seq else ANY
        live = self.streams.get(request_id)
        stream = live if live is not None and aimed in (ANY, live.key) else None
        if stream is None or stream.tenant != tenant:
            self.tombstones.add(tenant, request_id, time.monotonic(), aimed)
            if requester_reply and not broadcast:
                coming = live is None and self.streams.ended_key(request_id) != aimed
                handed_off = self.streams.handed_off_key(request_id) == aimed
                if aimed != ANY and (coming or handed_off):
                    answer: StreamEvent = aborted(request_id, 0)
                else:
                    message = f"unknown request id {request_id!r}"
                    answer = error_event(request_id, ErrorCode.NOT_FOUND, message)
                self._out.deliveries.append((requester_reply, answer))
            return self._take()
        self._abort_live(request_id, requester_reply, broadcast)
        return self._take()

    def _abort_live(
        self, request_id: str, requester_reply: str = "", broadcast: bool = False
    ) -> None:
        try:
            events = self.core.abort_request(request_id)
        except RequestError as exc:
            if requester_reply and not broadcast:
                answer = error_event(request_id, exc.code, exc.message)
                self._out.deliveries.append((requester_reply, answer))
            return
        self._route(events)
        if requester_reply:
            self._out.deliveries.append((requester_reply, aborted(request_id, 0)))

    def _notice(self, track: str, request_id: str, state: str) -> None:
        if track:
            notice = RequestNotice(request_id=request_id, scheduler_id=self.instance, state=state)
            request = self.core.scheduler.requests.get(request_id)
            if state == "accepted" and request is not None:
                notice.prefill_setting = prefill_setting(request.sparse)
            self._out.notices.append((track, notice))

    def _relay(self, stream: Stream, event: StreamEvent) -> None:
        self._out.relays.append(stream.relay_of(event))

    def _route(self, events: Iterable[StreamEvent]) -> None:
        routed = self.streams.route(
            events, self._out, shard_id=self.shard_id, simulated=self.simulated, log=self.log
        )
        self.telemetry.on_events(routed, self.core.inflight)
