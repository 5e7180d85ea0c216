"""Relaying streams: each shard's scheduler sends admission its streams' events, one
``RelayBatch`` a step, and admission publishes them to the clients. So admission knows
exactly which tokens each client was sent (what a request resumes from when it moves), a
client that is gone is noticed (nats-server answers its token with "no responders"), and a
finished event is recorded for a client that missed it and retries."""

from __future__ import annotations

import time

import msgspec

from messages.api import ErrorEvent, FinishedEvent, StreamEvent, TokenEvent
from messages.errors import ErrorCode
from messages.internal import RelayBatch, RequestNotice
from services.admission.aborts import Aborts
from services.admission.shard_moves import ShardMoves
from services.admission.tables import FinishedRecord, OpenRequest, OpenRequests
from services.runtime import subjects
from services.runtime.bus import encode_json, fits
from services.runtime.logging import request_fields
from services.runtime.service import Service


class Relay:
    def __init__(
        self,
        actor: Service,
        open_requests: OpenRequests,
        finished: FinishedRecord,
        moves: ShardMoves,
        aborts: Aborts,
    ) -> None:
        self._actor = actor
        self._open = open_requests
        self._finished = finished
        self._moves = moves
        self._aborts = aborts
        self.num_clients_gone = 0

    async def relay(self, batch: RelayBatch) -> None:
        """Passes a step's events on to their clients (those of tries still open)."""
        now = time.monotonic()
        self._open.heard_from(batch.scheduler_id, now)
        for item in batch.events:
            entry, event = self._open.relayed(batch.shard_id, item, batch.scheduler_id)
            if entry is None:
                continue
            if entry.owner is None:
                entry.owner = batch.scheduler_id
            if item.handoff is not None:  # moved on, or (aborted meanwhile) its last event
                event = await self._moves.hand_over(entry, item.handoff, item.seq)
            if event is None:
                continue
            try:
                await self._pass_on(entry, event, now)
            except Exception:  # only this stream suffers; the batch's others go on
                self._actor.log.exception(
                    "relayed event failed", **request_fields(entry.request_id, entry.trace_id)
                )

    def noticed(self, seq: int, notice: RequestNotice) -> None:
        """A scheduler's notice on a request's tracking subject ("accepted", or "done" for a
        stream it sent the client directly)."""
        now = time.monotonic()
        closed = self._open.notice(seq, notice, now)
        if closed is not None and notice.finished is not None:
            # kept for a client that missed it and retries (RLT_FINISHED_RECORD_S)
            data = encode_json(for_client(notice.finished))
            self._finished.add(notice.request_id, closed.reply, data, now)

    async def client_gone(self, seq: int) -> None:
        """nats-server found nobody listening for a token sent under ``seq``: the request
        stops at its shard."""
        entry = self._open.close(seq)
        if entry is None:
            return
        self.num_clients_gone += 1
        self._actor.log.warning(
            "client gone; request aborted", **request_fields(entry.request_id, entry.trace_id)
        )
        await self._aborts.forward(entry.request_id, entry, "", entry.trace_id, entry.tenant)

    async def _pass_on(self, entry: OpenRequest, event: StreamEvent, now: float) -> None:
        if isinstance(event, ErrorEvent) and event.code == ErrorCode.UNAVAILABLE:
            # the shard gave up on it (shutting down, no worker for too long): elsewhere?
            if await self._moves.move(entry, f"its shard said: {event.message}", entry.seq):
                return
            self._open.close(entry.seq)
        nc = self._actor.nc
        data = encode_json(for_client(event))
        if not fits(nc, len(data)):  # the scheduler and prepare() are meant to prevent it
            self._open.close(entry.seq)
            message = (
                f"the {type(event).__name__} of {len(data)} bytes exceeds the NATS "
                f"max_payload of {nc.max_payload} bytes"
            )
            await self._aborts.abort_and_end(entry, message, ErrorCode.INTERNAL)
            return
        reply = ""
        if isinstance(event, TokenEvent):
            # nats-server answers this with "no responders" once the client is gone
            reply = subjects.client_gone(self._actor.instance_id, entry.seq)
        elif isinstance(event, FinishedEvent):
            # kept for a client that missed it and retries (RLT_FINISHED_RECORD_S)
            self._finished.add(entry.request_id, entry.reply, data, now)
        try:
            await nc.publish(entry.reply, data, reply=reply)
        except Exception as exc:  # e.g. a bad client reply subject: only that stream suffers
            self._actor.log.warning("delivery failed", error=repr(exc)[:200])


def for_client(event: StreamEvent) -> StreamEvent:
    """The event with the id the client sent (a tenant's ids are scoped inside)."""
    public = subjects.public_request_id(event.request_id)
    if public == event.request_id:
        return event
    return msgspec.structs.replace(event, request_id=public)
