"""The scheduler's streams: which try of each live request it serves, and where its events
go (admission's relay subject; admission passes them on to the client). Pure: no NATS."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from messages.api import ErrorEvent, FinishedEvent, StreamEvent
from messages.errors import ErrorCode
from messages.internal import AdmittedRequest, RelayedEvent
from services.runtime.logging import log_content_enabled, request_fields
from services.scheduler.driver.step_output import Relay, StepOutput, StreamKey

# streams remembered after they ended (what a late abort or a held event belongs to)
_MAX_ENDED = 10_000


@dataclass
class Stream:
    trace_id: str
    started: float
    relay: str  # admission's relay subject: every event of the stream goes there
    track: str = ""  # admission's tracking subject ("" = nobody tracks it)
    tenant: str = ""  # only this tenant may abort it or retry it
    admission_id: str = ""  # the admission that may end it if we are lost (fencing)
    admission_seq: int = 0  # the try it serves (a retry re-attaching moves it); tags relays

    @classmethod
    def of(cls, req: AdmittedRequest, track: str = "") -> Stream:
        assert req.relay_subject is not None  # a submit without one is dropped on arrival
        return cls(
            req.trace_id,
            time.monotonic(),
            req.relay_subject,
            track,
            tenant=req.tenant,
            admission_id=req.admission_id,
            admission_seq=req.admission_seq,
        )

    @property
    def key(self) -> StreamKey:
        return (self.admission_id, self.admission_seq)

    def relay_of(self, event: StreamEvent) -> Relay:
        return Relay(
            self.relay, self.admission_id, RelayedEvent(seq=self.admission_seq, event=event)
        )


class Streams:
    """Live streams by request id, and the tries of those that ended lately."""

    def __init__(self) -> None:
        self.live: dict[str, Stream] = {}
        self._ended: OrderedDict[str, StreamKey] = OrderedDict()
        # of those, the tries that ended by a handoff to a decode shard
        self._handed_off: OrderedDict[str, StreamKey] = OrderedDict()

    def __len__(self) -> int:
        return len(self.live)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.live

    def __getitem__(self, request_id: str) -> Stream:
        return self.live[request_id]

    def get(self, request_id: str) -> Stream | None:
        return self.live.get(request_id)

    def add(self, request_id: str, stream: Stream) -> None:
        self.live[request_id] = stream

    def end(self, request_id: str, *, handed_off: bool = False) -> Stream | None:
        """Drops a live stream (its terminal event is on its way, it was fenced, or it was
        ``handed_off`` to a decode shard: admission carries it on there)."""
        stream = self.live.pop(request_id, None)
        if stream is not None:
            self.remember_ended(request_id, stream.key)
            if handed_off:
                _remember(self._handed_off, request_id, stream.key)
        return stream

    def remember_ended(self, request_id: str, key: StreamKey) -> None:
        _remember(self._ended, request_id, key)

    def ended_key(self, request_id: str) -> StreamKey | None:
        return self._ended.get(request_id)

    def handed_off_key(self, request_id: str) -> StreamKey | None:
        """The try of this request that left for a decode shard lately, if any."""
        return self._handed_off.get(request_id)

    def key(self, request_id: str) -> StreamKey | None:
        """The try a live or lately ended stream serves."""
        stream = self.live.get(request_id)
        return stream.key if stream is not None else self._ended.get(request_id)

    def tries(self) -> set[StreamKey]:
        """The tries of the live streams an admission admitted."""
        return {s.key for s in self.live.values() if s.admission_id}

    def route(
        self,
        events: Iterable[StreamEvent],
        out: StepOutput,
        *,
        shard_id: str,
        simulated: bool,
        log: Any,
    ) -> list[StreamEvent]:
        """Relays each event of a live stream (those of others are stale: dropped); a
        terminal event ends its stream. Returns the events relayed."""
        routed: list[StreamEvent] = []
        for event in events:
            stream = self.live.get(event.request_id)
            if stream is None:
                continue
            if isinstance(event, FinishedEvent):
                event.shard = shard_id
                event.simulated = simulated
                self.end(event.request_id)
                extra: dict[str, Any] = {}
                if log_content_enabled():
                    extra.update(token_ids=event.token_ids, text=event.text)
                log.info(
                    "request finished",
                    finish_reason=event.finish_reason,
                    num_tokens=len(event.token_ids),
                    latency_s=round(time.monotonic() - stream.started, 4),
                    **extra,
                    **request_fields(event.request_id, stream.trace_id),
                )
            elif isinstance(event, ErrorEvent):
                self.end(event.request_id)
                log.warning(
                    "request failed",
                    code=event.code,
                    reason=event.message[:300],
                    **request_fields(event.request_id, stream.trace_id),
                )
            routed.append(event)
            out.relays.append(stream.relay_of(event))
        return routed


def aborted(request_id: str, num_prompt_tokens: int) -> FinishedEvent:
    return FinishedEvent(
        request_id=request_id,
        finish_reason="abort",
        token_ids=[],
        exit_depths=[],
        num_prompt_tokens=num_prompt_tokens,
    )


def error_event(request_id: str, code: ErrorCode | str, message: str) -> ErrorEvent:
    return ErrorEvent(request_id=request_id, code=str(code), message=message)


def _remember(tries: OrderedDict[str, StreamKey], request_id: str, key: StreamKey) -> None:
    tries[request_id] = key
    tries.move_to_end(request_id)
    while len(tries) > _MAX_ENDED:
        tries.popitem(last=False)
