"""A valid request's way in: a retry of an id admission knows is answered from what it
knows (the recorded finished event, or the live stream it already relays), anything else
is routed to a shard, opened in the table of open requests and submitted there."""

from __future__ import annotations

import time
from typing import Any

from messages.errors import ErrorCode
from services.admission.core import AdmissionCore
from services.admission.errors import AdmissionError
from services.admission.routing import Routing
from services.admission.tables import FinishedRecord, OpenRequests, Retry, classify_retry
from services.admission.validation import Prepared
from services.runtime import subjects
from services.runtime.logging import log_content_enabled, request_fields
from services.runtime.service import Service


class Intake:
    def __init__(
        self,
        actor: Service,
        open_requests: OpenRequests,
        finished: FinishedRecord,
        routing: Routing,
        relay_subject: str,
    ) -> None:
        self._actor = actor
        self._open = open_requests
        self._finished = finished
        self._routing = routing
        self._relay_subject = relay_subject  # where its shard sends the stream's events
        self.num_admitted = 0
        self.num_retries = 0

    async def forward(
        self, core: AdmissionCore, prepared: Prepared, reply: str, traceparent: str
    ) -> None:
        """Raises AdmissionError when it cannot run (a conflicting id, no shard, overload,
        admission stopping)."""
        rid = prepared.request_id
        retry, recorded = classify_retry(rid, reply, self._open, self._finished, time.monotonic())
        if retry is not Retry.NEW:
            self.num_retries += 1
            self._actor.log.info("retried request", retry=retry.value, **request_fields(rid, ""))
        if retry is Retry.REPLAY and recorded is not None:
            await self._actor.nc.publish(reply, recorded)  # it finished: the same event
            return
        if retry is Retry.CONFLICT:
            state = "live" if self._open.find(rid) is not None else "finished"
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
        with self._routing.in_flight.routing(rid):
            choice, overlap = await self._routing.route(prepared, core.over_limit)
        if self._actor.draining:  # we may be past drain's last look at the open requests
            raise AdmissionError(rid, ErrorCode.UNAVAILABLE, "admission is shutting down")
        admitted = core.admit(prepared, reply, shard_id=choice, relay_subject=self._relay_subject)
        seq = admitted.admission_seq
        now = time.monotonic()
        self._open.opened(seq, rid, reply, prepared.trace_id, now, shard=choice, admitted=admitted)
        try:
            await self._routing.submit(admitted, now, overlap, traceparent)
        except Exception:
            self._open.close(seq)  # the client hears an error: nothing may run it later
            raise
        self.num_admitted += 1
        extra: dict[str, Any] = {}
        if log_content_enabled():  # user data: only when the operator asks for it
            extra.update(prompt=prepared.prompt_text, prompt_token_ids=prepared.prompt_token_ids)
        self._actor.log.info(
            "request admitted",
            shard=choice,
            num_prompt_tokens=len(prepared.prompt_token_ids),
            max_tokens=prepared.params.max_tokens,
            **extra,
            **request_fields(rid, prepared.trace_id),
        )
