"""What admission remembers about requests (pure: no NATS, no clock of its own).

- ``OpenRequests``: the requests this admission forwarded whose stream has not ended (what
  it needs to move one to another shard, or to end it when its scheduler is gone);
- ``FenceLog``: the tries it moved or ended because their scheduler was gone, for that
  scheduler to drop should it come back;
- ``FinishedRecord``: recent finished events, so a client's retry of a finished request gets
  the same event instead of a second generation (``classify_retry``).
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec

from messages.api import ErrorEvent, FinishedEvent, StreamEvent, TokenEvent
from messages.errors import ErrorCode
from messages.internal import AdmittedRequest, RelayedEvent, RequestNotice
from services.runtime import subjects


@dataclass
class OpenRequest:
    request_id: str
    reply: str
    trace_id: str
    sent_at: float
    owner: str | None = None  # the scheduler that accepted it
    shard: str = ""  # the shard it was routed to ("" = not routed by this admission)
    seq: int = 0  # the admission seq it is open under (new on every move)
    # what it needs to resume elsewhere if its shard is lost: the request as admitted, and
    # the outputs relayed to the client so far (exactly what the client was sent)
    admitted: AdmittedRequest | None = None
    token_ids: list[int] = field(default_factory=list)
    exit_depths: list[int] = field(default_factory=list)
    # each token's depth budget where overload shedding lowered it (None: not lowered)
    depth_budgets: list[int | None] = field(default_factory=list)
    moves: int = 0
    # the client asked to abort it: if its shard is lost it ends, it does not move
    abort_requested: bool = False

    @property
    def tenant(self) -> str:
        return self.admitted.tenant if self.admitted is not None else subjects.DEFAULT_TENANT

    def resumed(self, admitted: AdmittedRequest, seq: int, shard: str) -> AdmittedRequest:
        """The submit that resumes it on ``shard`` under ``seq``, with the outputs its
        client has (and their shed depth budgets, if any was shed)."""
        shed = any(b is not None for b in self.depth_budgets)
        return msgspec.structs.replace(
            admitted,
            admission_seq=seq,
            shard_id=shard,
            resume_token_ids=list(self.token_ids),
            resume_exit_depths=list(self.exit_depths),
            resume_depth_budgets=list(self.depth_budgets) if shed else [],
        )


class OpenRequests:
    """Requests this admission forwarded whose stream has not ended, keyed by admission seq.

    A scheduler that dies (or restarts: a new epoch) would leave its clients in silence.
    Each submit carries a tracking subject; the scheduler answers "accepted" on it (and
    "done" for a stream it sends to the client directly), and nats-server answers "no
    responders" when no scheduler listens. An open request whose scheduler has not been
    heard from for ``scheduler_lost_s`` of connected time (load reports come every 0.25 s)
    is a suspect: once its scheduler is confirmed gone it moves to another shard or ends
    with ``unavailable``, sent by admission. Pure: no NATS, no clock.
    """

    def __init__(self, scheduler_lost_s: float, max_request_s: float = 3600.0) -> None:
        self.scheduler_lost_s = scheduler_lost_s
        self.max_request_s = max_request_s
        self._open: dict[int, OpenRequest] = {}
        self._by_id: dict[str, int] = {}  # request id -> its newest seq
        self._heard: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._open)

    def opened(
        self,
        seq: int,
        request_id: str,
        reply: str,
        trace_id: str,
        now: float,
        *,
        shard: str = "",
        admitted: AdmittedRequest | None = None,
    ) -> OpenRequest:
        entry = OpenRequest(
            request_id, reply, trace_id, now, shard=shard, seq=seq, admitted=admitted
        )
        self._open[seq] = entry
        self._by_id[request_id] = seq
        return entry

    def get(self, seq: int) -> OpenRequest | None:
        return self._open.get(seq)

    def entries(self) -> list[OpenRequest]:
        return list(self._open.values())

    def on_shard(self, shard: str, owner: str | None = None) -> dict[int, OpenRequest]:
        """Open requests routed to ``shard`` (and accepted by ``owner``, if given), by the
        seq they are open under now (a caller that awaits passes it on: see ``is_open``)."""
        return {
            seq: e
            for seq, e in self._open.items()
            if e.shard == shard and (owner is None or e.owner in (None, owner))
        }

    def moved(
        self, entry: OpenRequest, new_seq: int, shard: str, now: float, *, handed: bool = False
    ) -> None:
        """``entry`` is resubmitted to ``shard`` under ``new_seq``: anything still arriving
        for its old seq (its old shard's copy) no longer reaches it. ``handed``: a prefill
        shard handed it over (not a failure: it does not count as a move)."""
        self._open.pop(entry.seq, None)
        entry.seq, entry.shard, entry.owner, entry.sent_at = new_seq, shard, None, now
        entry.moves += 0 if handed else 1
        self._open[new_seq] = entry
        self._by_id[entry.request_id] = new_seq

    def relayed(
        self, shard: str, item: RelayedEvent, scheduler_id: str = ""
    ) -> tuple[OpenRequest | None, StreamEvent | None]:
        """A relayed event from ``shard``: returns the open request it belongs to and the
        event to pass on to the client (None: nothing to send). Events of a seq that is not
        open (the request moved, or ended) or from another shard than the request's are
        dropped, and so is a token index the client already has: each index reaches it
        once. Once a scheduler instance accepted it, only that instance's events count. A
        terminal event closes the entry."""
        entry = self._open.get(item.seq)
        if entry is None or (entry.shard and entry.shard != shard):
            return None, None
        if scheduler_id and entry.owner and entry.owner != scheduler_id:
            return None, None  # not from the scheduler instance that accepted it
        event = item.event
        if item.handoff is not None:
            return entry, None  # its shard handed it over: the caller moves it
        if event is None:  # a resync: the stream's outputs so far
            entry.token_ids = list(item.known_token_ids)
            entry.exit_depths = list(item.known_exit_depths)
            budgets = list(item.known_depth_budgets)
            aligned = len(budgets) == len(entry.token_ids)  # else none known: none shed
            entry.depth_budgets = budgets if aligned else [None] * len(entry.token_ids)
            return entry, None
        if isinstance(event, TokenEvent):
            if event.index != len(entry.token_ids):
                return entry, None  # a duplicate (or, never expected, a gap)
            entry.token_ids.append(event.token_id)
            entry.exit_depths.append(event.exit_depth)
            entry.depth_budgets.append(event.depth_budget)
            return entry, event
        if isinstance(event, ErrorEvent) and event.code == ErrorCode.UNAVAILABLE:
            return entry, event  # the shard gave up on it: the caller may move it, or close
        self._pop(item.seq)
        if isinstance(event, FinishedEvent):
            entry.token_ids, entry.exit_depths = list(event.token_ids), list(event.exit_depths)
        return entry, event

    def close(self, seq: int) -> OpenRequest | None:
        return self._pop(seq)

    def is_open(self, entry: OpenRequest, seq: int | None = None) -> bool:
        """Still open; with ``seq`` (the one the caller saw), also not moved since (a move
        gives it a new seq)."""
        return self._open.get(entry.seq if seq is None else seq) is entry

    @staticmethod
    def can_move(entry: OpenRequest, max_moves: int) -> bool:
        """Whether it may resume on another shard: admission has what it needs to resubmit
        it, it has not moved ``max_moves`` times, and its client has not asked to abort it
        (an abort in flight to a lost shard ends it instead)."""
        return entry.admitted is not None and entry.moves < max_moves and not entry.abort_requested

    def close_all(self) -> list[OpenRequest]:
        """Removes and returns every entry (admission is stopping)."""
        return self.declare(list(self._open))

    def find(self, request_id: str) -> OpenRequest | None:
        seq = self._by_id.get(request_id)
        return self._open.get(seq) if seq is not None else None

    def superseded(self, request_id: str) -> OpenRequest | None:
        """A retry of this live request is forwarded under a new seq (the scheduler moves the
        stream there): the old entry goes, so it can never end the stream a second time."""
        seq = self._by_id.get(request_id)
        return self._pop(seq) if seq is not None else None

    def notice(self, seq: int, notice: RequestNotice, now: float) -> OpenRequest | None:
        """Applies a notice; returns the entry a "done" closed."""
        self.heard_from(notice.scheduler_id, now)
        entry = self._open.get(seq)
        if entry is None or entry.request_id != notice.request_id:
            return None
        if notice.state == "done":
            return self._pop(seq)
        if notice.state == "accepted":
            entry.owner = notice.scheduler_id
            admitted = entry.admitted
            if admitted is not None and admitted.prefill_setting is None:
                # a move to another shard prefills its prompt as this one does
                entry.admitted = msgspec.structs.replace(
                    admitted, prefill_setting=notice.prefill_setting
                )
        return None

    def unanswered(self, seq: int) -> OpenRequest | None:
        """nats-server says no scheduler received the submit: the request is ours to end."""
        return self._pop(seq)

    def heard_from(self, scheduler_id: str, now: float) -> None:
        self._heard[scheduler_id] = now

    def suspects(self, now: float, connected_since: float) -> dict[int, OpenRequest]:
        """The requests whose scheduler has been silent for ``scheduler_lost_s`` of our
        connected time (or that no scheduler accepted in time), by seq, left in the table:
        the service ends them only once nats-server confirms their scheduler is gone (a
        stalled scheduler may still publish). Entries past ``max_request_s`` are left to
        ``expired``."""
        out: dict[int, OpenRequest] = {}
        for seq, entry in self._open.items():
            if now - entry.sent_at > self.max_request_s:
                continue  # the scheduler ends it with ``timeout`` (or ``expired`` does)
            ref = entry.sent_at if entry.owner is None else self._heard.get(entry.owner, 0.0)
            if now - max(ref, entry.sent_at, connected_since) > self.scheduler_lost_s:
                out[seq] = entry
        stale = now - 10 * self.scheduler_lost_s
        for sid in [sid for sid, at in self._heard.items() if at < stale]:
            del self._heard[sid]
        return out

    def declare(self, seqs: Iterable[int]) -> list[OpenRequest]:
        """Removes and returns these entries: their scheduler is confirmed gone."""
        return [e for e in (self._pop(seq) for seq in seqs) if e is not None]

    def expired(self, now: float) -> list[OpenRequest]:
        """Removes and returns the entries older than ``max_request_s`` whose scheduler's
        own ``timeout`` has not come back within ``scheduler_lost_s`` more (its clock
        starts a little later than ours): admission ends those itself."""
        limit = self.max_request_s + self.scheduler_lost_s
        return self.declare([seq for seq, e in self._open.items() if now - e.sent_at > limit])

    def schedulers(self) -> list[str]:
        """The schedulers heard from recently (those that may hold an unaccepted request)."""
        return list(self._heard)

    def _pop(self, seq: int | None) -> OpenRequest | None:
        entry = self._open.pop(seq, None) if seq is not None else None
        if entry is not None and self._by_id.get(entry.request_id) == seq:
            del self._by_id[entry.request_id]
        return entry


class FenceLog:
    """The requests this admission ended with ``unavailable`` because their scheduler was
    gone, by scheduler, for ``keep_s``: a scheduler that comes back (it was cut off, or
    stalled until nats-server dropped it) asks for them and drops them without sending
    anything more, so no client hears from two sides. ``None`` as the scheduler: a request
    no scheduler had accepted (any scheduler may still hold its submit). Bounded: at most
    ``max_entries`` (oldest out). Pure."""

    def __init__(self, keep_s: float = 600.0, max_entries: int = 100_000) -> None:
        self.keep_s = keep_s
        self.max_entries = max_entries
        self._items: deque[tuple[float, str | None, str, int]] = deque()

    def __len__(self) -> int:
        return len(self._items)

    def add(self, scheduler_id: str | None, request_id: str, seq: int, now: float) -> None:
        """``seq``: the admission seq of the try that was ended (a retry has another)."""
        self._items.append((now, scheduler_id, request_id, seq))
        self.expire(now)

    def for_scheduler(
        self, scheduler_id: str, now: float, seqs: Iterable[int] = ()
    ) -> list[tuple[str, int]]:
        """The tries fenced for ``scheduler_id``; only those among ``seqs`` when given."""
        self.expire(now)
        among = set(seqs)
        return [
            (rid, seq)
            for _, sid, rid, seq in self._items
            if sid in (None, scheduler_id) and (not among or seq in among)
        ]

    def expire(self, now: float) -> None:
        while self._items and (
            now - self._items[0][0] > self.keep_s or len(self._items) > self.max_entries
        ):
            self._items.popleft()


@dataclass
class _Finished:
    reply: str
    data: bytes  # the finished event as the client got it (JSON)
    at: float


class FinishedRecord:
    """The finished events of recent requests, by request_id, kept ``keep_s`` (and at most
    ``max_bytes`` in all, oldest out first): a client that missed its finished event retries
    the same request_id and gets this copy instead of a second generation. Pure."""

    def __init__(self, keep_s: float = 600.0, max_bytes: int = 64 << 20) -> None:
        self.keep_s = keep_s
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, _Finished] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def add(self, request_id: str, reply: str, data: bytes, now: float) -> None:
        self._drop(request_id)
        self._items[request_id] = _Finished(reply, data, now)
        self.bytes += len(data)
        self.expire(now)

    def get(self, request_id: str, now: float) -> _Finished | None:
        self.expire(now)
        return self._items.get(request_id)

    def expire(self, now: float) -> None:
        while self._items:
            oldest = next(iter(self._items.values()))
            if now - oldest.at <= self.keep_s and self.bytes <= self.max_bytes:
                break
            self._drop(next(iter(self._items)))

    def _drop(self, request_id: str) -> None:
        item = self._items.pop(request_id, None)
        if item is not None:
            self.bytes -= len(item.data)


class Retry(enum.Enum):
    NEW = "new"  # never seen (or its last try ended in an error): run it
    REATTACH = "reattach"  # live: forward, the scheduler moves the stream to this try
    REPLAY = "replay"  # finished: answer with the recorded finished event
    CONFLICT = "conflict"  # the id belongs to another client's stream: refuse


def classify_retry(
    request_id: str, reply: str, open_requests: OpenRequests, record: FinishedRecord, now: float
) -> tuple[Retry, bytes | None]:
    """What a generate with an id admission has seen before is. A retry is the same
    request_id from the same reply subject (the rlt client keeps it across retries and
    reconnects); another reply subject could be anyone's, so it gets neither the running
    stream nor the recorded output."""
    live = open_requests.find(request_id)
    if live is not None:
        return (Retry.REATTACH, None) if live.reply == reply else (Retry.CONFLICT, None)
    done = record.get(request_id, now)
    if done is not None:
        return (Retry.REPLAY, done.data) if done.reply == reply else (Retry.CONFLICT, None)
    return Retry.NEW, None
