"""Stopping requests: a client's abort, forwarded to the shard running the request (or
asked of every shard when another admission routed it), and admission's own end of an open
request (the client's last event, when its scheduler cannot send one)."""

from __future__ import annotations

import time

import msgspec
from nats.errors import Error as NatsError

from messages.api import ErrorEvent
from messages.errors import ErrorCode
from messages.internal import AbortAck, AbortForward
from services.admission.errors import AdmissionError
from services.admission.routing import RoutesInFlight
from services.admission.shards import ShardTable
from services.admission.tables import OpenRequest, OpenRequests
from services.runtime import subjects
from services.runtime.bus import decode_msgpack, encode_json, encode_msgpack, is_no_responders
from services.runtime.logging import request_fields
from services.runtime.service import Service

# aborts of ids this admission does not hold ask every shard and wait up to 0.5 s for the
# answers; beyond this many at once the requester hears ``overloaded`` instead
_MAX_BROADCAST_ABORTS = 256
# how long an abort waits for its generate to be routed
_ROUTING_WAIT_S = 5.0
# how long a broadcast abort waits for the shards' answers
_BROADCAST_WAIT_S = 0.5


class Aborts:
    def __init__(
        self,
        actor: Service,
        open_requests: OpenRequests,
        shards: ShardTable,
        in_flight: RoutesInFlight,
    ) -> None:
        self._actor = actor
        self._open = open_requests
        self._shards = shards
        self._in_flight = in_flight
        self.num_lost = 0  # requests ended with ``unavailable`` by admission
        self._broadcasts = 0  # in flight

    async def abort(
        self, request_id: str, public_id: str, reply: str, trace_id: str, tenant: str
    ) -> None:
        """A client's abort of ``request_id`` (scoped to ``tenant``). Raises AdmissionError
        (``overloaded``) when too many aborts of unknown ids are being asked already."""
        # its generate is being routed: never overtake it
        await self._in_flight.wait(request_id, _ROUTING_WAIT_S)
        entry = self._open.find(request_id)
        if entry is None or entry.tenant != tenant:
            # another admission routed it, or it is unknown: every shard is asked
            if self._broadcasts >= _MAX_BROADCAST_ABORTS:
                why = "too many aborts of requests this admission does not hold; retry"
                raise AdmissionError(request_id, ErrorCode.OVERLOADED, why)
            self._broadcasts += 1
            self._actor.spawn(self._abort_anywhere(request_id, reply, trace_id, tenant), "abort")
            return
        entry.abort_requested = True
        await self.forward(request_id, entry, reply, trace_id, tenant)
        fields = request_fields(public_id, trace_id)
        self._actor.log.info("abort forwarded", tenant=tenant, **fields)

    async def forward(
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
            admission_id=self._actor.instance_id if seq else "",
            broadcast=not shard,
        )
        subject = subjects.sched_abort(shard) if shard else subjects.SCHED_ABORT
        await self._actor.nc.publish(subject, encode_msgpack(forward))

    async def abort_and_end(
        self, entry: OpenRequest, message: str, code: ErrorCode = ErrorCode.UNAVAILABLE
    ) -> None:
        """Ends a closed entry that may still run at its shard: stopped there, then told."""
        await self.forward(entry.request_id, entry, "", entry.trace_id, entry.tenant)
        await self.end(entry, message, code)

    async def end(
        self, entry: OpenRequest, message: str, code: ErrorCode = ErrorCode.UNAVAILABLE
    ) -> None:
        """The client's terminal event, sent by admission (the entry is closed already)."""
        if code is ErrorCode.UNAVAILABLE:
            self.num_lost += 1
        log = self._actor.log
        log.warning(
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
            await self._actor.nc.publish(entry.reply, encode_json(event))
        except Exception as exc:
            log.warning("could not tell the client", error=repr(exc)[:200])

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
            self._broadcasts -= 1

    async def _ask_every_shard(
        self, forward: AbortForward, reply: str, request_id: str, trace_id: str
    ) -> None:
        nc = self._actor.nc
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        held = False
        try:
            await nc.publish(subjects.SCHED_ABORT, encode_msgpack(forward), reply=inbox)
            deadline = time.monotonic() + _BROADCAST_WAIT_S
            answered = 0
            while answered < max(1, len(self._shards)) and not held:
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
        self._actor.log.info("abort broadcast", held=held, **request_fields(request_id, trace_id))
        if not held and reply:
            public = subjects.public_request_id(request_id)
            event = ErrorEvent(
                request_id=public,
                code=str(ErrorCode.NOT_FOUND),
                message=f"unknown request id {public!r}",
            )
            await nc.publish(reply, encode_json(event))
