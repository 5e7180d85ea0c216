"""Admission's pure core: decode and validate a public request, tokenize, give it an id,
check it against the model, and apply backpressure. No NATS here.

Errors are raised as ``AdmissionError`` carrying the request id (when one could be read),
a code from ``messages.errors.ErrorCode`` and a message for the client.
"""

from __future__ import annotations

import enum
import os
import re
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from hashlib import blake2b

import jinja2
import msgspec

from messages.api import (
    AbortRequest,
    ErrorEvent,
    FinishedEvent,
    GenerateRequest,
    StreamEvent,
    TokenEvent,
)
from messages.errors import ErrorCode, RequestError
from messages.internal import AdmittedRequest, RelayedEvent, RequestNotice
from messages.sampling import SamplingParams
from services.common.config import ModelLimits
from services.common.fit import KVGeometry, check_request_fits
from services.common.tokenizer import TextCodec
from services.runtime import subjects
from services.runtime.tracing import new_trace_id

_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]+$")
# a client's Rlt-Trace-Id header: copied into logs and internal messages, so bounded
_TRACE_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,64}$")
# a reply subject: printable tokens without wildcards, separated by single dots
_SUBJECT_RE = re.compile(r"^[^.\s*>]+(\.[^.\s*>]+)*$")
# internal subjects a client must never make a service publish to (reply-subject injection)
_RESERVED_REPLY_PREFIXES = ("rlt.", "$", "_RLT_INBOX")
# the JSON a finished event spends per generated token, on average (id, depth, text)
_FINISHED_BYTES_PER_TOKEN = 16
# the JSON the first token event spends per prompt token on prompt_logprobs, and per
# alternative of each (ids, values, texts; measured about 86 and 63, with room for longer
# token texts)
_PROMPT_LOGPROB_BYTES = 100
_PROMPT_ALTERNATIVE_BYTES = 80
_GENERATE_DECODER = msgspec.json.Decoder(GenerateRequest)
_ABORT_DECODER = msgspec.json.Decoder(AbortRequest)
_ANY_DECODER = msgspec.json.Decoder()
_MSGPACK = msgspec.msgpack.Encoder()


class AdmissionError(Exception):
    def __init__(self, request_id: str, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.code = code
        self.message = message

    def event(self) -> ErrorEvent:
        return ErrorEvent(request_id=self.request_id, code=str(self.code), message=self.message)


@dataclass(frozen=True)
class AdmissionConfig:
    # backpressure: requests / prompt tokens queued at the scheduler (not yet running)
    max_waiting_requests: int = 1024
    max_waiting_tokens: int = 1 << 20
    max_request_id_length: int = 256
    # KV geometry, to refuse requests that can never fit (None: leave it to the scheduler)
    block_size: int = 16
    num_blocks: int | None = None
    num_kv_planes: int = 1
    enable_prefix_caching: bool = False
    # prompt cap in tokens (None: the model's max_position_embeddings)
    max_prompt_tokens: int | None = None
    # the bus's max_payload (set by the service once connected): internal messages and the
    # finished event must fit it, so such requests are refused up front with a clear error
    max_payload: int | None = None
    # a scheduler that holds open requests and has not been heard from for this long (while
    # we were connected) is gone: its requests end with "unavailable"
    scheduler_lost_s: float = 10.0
    # an open-request entry older than this is forgotten (the scheduler ends it itself)
    max_request_s: float = 3600.0
    # finished events kept to answer a client's retry of the same request_id (the window in
    # which a retry never runs a request twice), and their total size
    finished_record_s: float = 600.0
    finished_record_bytes: int = 64 << 20
    # tenants whose requests may ask for a priority more urgent than the default (< 0);
    # DEFAULT_TENANT ("") names the default tenant (RLT_PRIORITY_TENANTS: "default,acme")
    priority_tenants: frozenset[str] = frozenset()
    # how long the requests a lost scheduler held are remembered for its fence query
    fence_keep_s: float = 600.0
    # "is that scheduler still there?": no answer in this long means connected but stalled
    probe_timeout_s: float = 1.0
    # routing over shards (services/admission/router.py): policy, the prefix index lookup's
    # timeout, and how long a failed index is left alone before it is asked again
    router: str = "prefix"
    # a block of prefill saved against blocks of load (Dynamo's overlap_score_weight);
    # 2 measured better than 1 on hits, tokens/s and TTFT (docs/benchmarks/sharding.md)
    router_overlap_weight: float = 2.0
    # each request already running or queued on a shard counts as this many blocks of load
    router_request_weight: float = 2.0
    prefix_lookup_timeout_s: float = 0.05
    prefix_index_retry_s: float = 1.0
    # a request moved this many times (shard after shard lost) ends with "unavailable"
    max_moves: int = 8

    @classmethod
    def from_env(cls) -> AdmissionConfig:
        """The limits operators set through the environment (docs/services.md)."""
        base, env = cls(), os.environ
        max_prompt = env.get("RLT_MAX_PROMPT_TOKENS")
        return cls(
            max_waiting_requests=int(
                env.get("RLT_MAX_WAITING_REQUESTS", base.max_waiting_requests)
            ),
            max_waiting_tokens=int(env.get("RLT_MAX_WAITING_TOKENS", base.max_waiting_tokens)),
            max_prompt_tokens=int(max_prompt) if max_prompt else None,
            scheduler_lost_s=float(env.get("RLT_SCHEDULER_LOST_S", base.scheduler_lost_s)),
            max_request_s=float(env.get("RLT_MAX_REQUEST_S", base.max_request_s)),
            finished_record_s=float(env.get("RLT_FINISHED_RECORD_S", base.finished_record_s)),
            priority_tenants=parse_priority_tenants(env.get("RLT_PRIORITY_TENANTS", "")),
            prefix_lookup_timeout_s=float(
                env.get("RLT_PREFIX_LOOKUP_TIMEOUT_S", base.prefix_lookup_timeout_s)
            ),
            router_overlap_weight=float(
                env.get("RLT_ROUTER_OVERLAP_WEIGHT", base.router_overlap_weight)
            ),
            router_request_weight=float(
                env.get("RLT_ROUTER_REQUEST_WEIGHT", base.router_request_weight)
            ),
        )


def parse_priority_tenants(value: str) -> frozenset[str]:
    """``"default,acme"`` -> {"", "acme"}: the tenants that may raise a request's priority."""
    names = [part.strip() for part in value.split(",") if part.strip()]
    return frozenset(
        subjects.DEFAULT_TENANT if name == "default" else subjects.check_tenant(name)
        for name in names
    )


@dataclass
class Prepared:
    """A request that passed every check that does not depend on load."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    trace_id: str
    prompt_text: str | None = None  # only for RLT_LOG_CONTENT=1 logging
    tenant: str = subjects.DEFAULT_TENANT


class AdmissionCore:
    def __init__(
        self,
        limits: ModelLimits,
        codec: TextCodec | None,
        config: AdmissionConfig | None = None,
        admission_id: str | None = None,
    ) -> None:
        self.limits = limits
        self.codec = codec
        self.config = config or AdmissionConfig()
        self.admission_id = admission_id or uuid.uuid4().hex[:12]
        self._seq = 0  # admission seqs: one per submit (a move is a new submit)

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    # ------------------------------------------------------------------ generate
    def prepare(
        self, data: bytes, trace_id: str | None = None, tenant: str = subjects.DEFAULT_TENANT
    ) -> Prepared:
        """Decode + validate + tokenize + model checks. Raises AdmissionError."""
        request = self._decode(data)
        request_id = subjects.scoped_request_id(tenant, self._request_id(request.request_id))
        try:
            if request.priority < 0 and tenant not in self.config.priority_tenants:
                raise RequestError(
                    f"priority {request.priority} is more urgent than the default (0), which "
                    "this tenant may not ask for (RLT_PRIORITY_TENANTS)"
                )
            prompt = self._prompt_ids(request)
            # the scheduler gets the request with the model's defaults filled in
            params = self.limits.resolve(request.sampling_params())
            if params.seed is None:
                # fixed here, from the id: a request resumed on another shard, or retried
                # through another admission, samples exactly the same tokens
                params = msgspec.structs.replace(params, seed=seed_from_request_id(request_id))
            assert params.max_tokens is not None
            self._check_fits(len(prompt), params.max_tokens, params.prompt_logprobs)
            _check_encodable(params)
        except RequestError as exc:
            raise AdmissionError(request_id, exc.code, exc.message) from None
        return Prepared(
            request_id,
            prompt,
            params,
            clean_trace_id(trace_id) or new_trace_id(),
            request.prompt,
            tenant,
        )

    @staticmethod
    def check_reply_subject(reply: str, tenant: str = subjects.DEFAULT_TENANT) -> str | None:
        """Why ``reply`` cannot receive a stream (None: it can). A client naming an internal
        subject, or another tenant's inbox, as its reply would make the services publish
        there; one the services may not publish to would fail every event."""
        if len(reply) > 1024 or not _SUBJECT_RE.match(reply):
            return "not a valid NATS subject"
        if reply.startswith(_RESERVED_REPLY_PREFIXES):
            return "reply subjects under rlt., $ and _RLT_INBOX are reserved"
        if not subjects.reply_allowed(tenant, reply):
            inbox = subjects.tenant_inbox(tenant)
            return f"the reply subject must be inside this tenant's inbox prefix {inbox}."
        return None

    def over_limit(self, num_waiting: int, waiting_tokens: int, num_prompt: int) -> str | None:
        """Why one more request of ``num_prompt`` tokens may not join a queue this long
        (None: it may). The limits hold per scheduler (per shard)."""
        cfg = self.config
        if num_waiting + 1 > cfg.max_waiting_requests:
            return (
                f"{num_waiting} requests are waiting (limit {cfg.max_waiting_requests}); "
                "retry later"
            )
        if waiting_tokens + num_prompt > cfg.max_waiting_tokens:
            return (
                f"{waiting_tokens} prompt tokens are waiting (limit {cfg.max_waiting_tokens}); "
                "retry later"
            )
        return None

    def admit(
        self,
        prepared: Prepared,
        reply_subject: str,
        *,
        shard_id: str = "",
        relay_subject: str = "",
    ) -> AdmittedRequest:
        """Builds the message for the scheduler (the shard table counts it as waiting)."""
        seq = self.next_seq()
        return AdmittedRequest(
            request_id=prepared.request_id,
            prompt_token_ids=prepared.prompt_token_ids,
            params=prepared.params,
            reply_subject=reply_subject,
            trace_id=prepared.trace_id,
            admission_id=self.admission_id,
            admission_seq=seq,
            admitted_at=time.time(),
            tenant=prepared.tenant,
            shard_id=shard_id,
            relay_subject=relay_subject,
        )

    # ------------------------------------------------------------------ abort
    def parse_abort(self, data: bytes) -> AbortRequest:
        try:
            abort = _ABORT_DECODER.decode(data)
        except (msgspec.DecodeError, RecursionError) as exc:
            raise AdmissionError(
                salvage_request_id(data), ErrorCode.INVALID_REQUEST, _decode_message(exc)
            ) from None
        self._check_request_id(abort.request_id)
        return abort

    # ------------------------------------------------------------------ helpers
    def _decode(self, data: bytes) -> GenerateRequest:
        try:
            return _GENERATE_DECODER.decode(data)
        except (msgspec.DecodeError, RecursionError) as exc:  # ValidationError is a DecodeError
            raise AdmissionError(
                salvage_request_id(data), ErrorCode.INVALID_REQUEST, _decode_message(exc)
            ) from None

    def _request_id(self, given: str | None) -> str:
        if given is None:
            return f"req-{uuid.uuid4().hex}"
        self._check_request_id(given)
        return given

    def _check_request_id(self, request_id: str) -> None:
        limit = self.config.max_request_id_length
        if not request_id or len(request_id) > limit or not _REQUEST_ID_RE.match(request_id):
            shown = request_id[:64]
            raise AdmissionError(
                "",
                ErrorCode.INVALID_REQUEST,
                f"request_id must be 1-{limit} characters of [A-Za-z0-9._:-], got {shown!r}",
            )

    def _prompt_ids(self, request: GenerateRequest) -> list[int]:
        given = [request.prompt, request.prompt_token_ids, request.messages]
        if sum(x is not None for x in given) != 1:
            raise RequestError("give exactly one of prompt, prompt_token_ids or messages")
        if request.prompt_token_ids is not None:
            ids = request.prompt_token_ids
        elif request.messages is not None:
            ids = self._tokenize_chat(request.messages, request.chat_template_kwargs or {})
        else:
            ids = self._tokenize(request.prompt or "")
        if not ids:
            raise RequestError("prompt must contain at least one token")
        cap = self.config.max_prompt_tokens
        if cap is not None and len(ids) > cap:  # the model's own limit is checked later
            raise RequestError(
                f"prompt is too long ({len(ids)} tokens, limit {cap}: RLT_MAX_PROMPT_TOKENS)"
            )
        vocab = self.limits.vocab_size
        for tok in ids:
            if not 0 <= tok < vocab:
                raise RequestError(f"prompt token id {tok} is outside the vocabulary [0, {vocab})")
        return ids

    @property
    def max_prompt_tokens(self) -> int:
        cap = self.config.max_prompt_tokens
        limit = self.limits.max_position_embeddings
        return limit if cap is None else min(cap, limit)

    def _tokenize(self, text: str) -> list[int]:
        codec = self._codec()
        self._check_chars(len(text))
        return codec.encode(text)

    def _tokenize_chat(self, messages: list[dict], template_kwargs: dict) -> list[int]:
        codec = self._codec()
        if codec.chat_template is None:
            raise RequestError("this checkpoint's tokenizer has no chat template; send prompt")
        for message in messages:
            content = message.get("content")
            if not isinstance(message.get("role"), str) or not isinstance(content, str | list):
                raise RequestError("each message needs a string 'role' and a 'content'")
        self._check_chars(sum(len(str(m.get("content"))) for m in messages))
        try:
            return codec.encode_chat(messages, add_generation_prompt=True, **template_kwargs)
        except jinja2.TemplateError as exc:  # raise_exception() and template errors
            raise RequestError(f"the chat template refused the messages: {exc}") from None
        except Exception as exc:  # the template is checkpoint code run on client data
            raise RequestError(
                f"the chat template failed on the messages: {type(exc).__name__}: {exc}"
            ) from None

    def _codec(self) -> TextCodec:
        if self.codec is None:
            raise RequestError("this checkpoint has no tokenizer.json; send prompt_token_ids")
        return self.codec

    def _check_chars(self, num_chars: int) -> None:
        # cheap guard before tokenizing: no tokenizer makes fewer than 1 token per 64 chars
        max_chars = 64 * self.max_prompt_tokens
        if num_chars > max_chars:
            raise RequestError(f"prompt is too long ({num_chars} characters, limit {max_chars})")

    def _check_fits(
        self, num_prompt: int, max_tokens: int, prompt_logprobs: int | None = None
    ) -> None:
        cfg = self.config
        kv = None
        if cfg.num_blocks is not None:
            kv = KVGeometry(cfg.block_size, cfg.num_blocks, cfg.num_kv_planes)
        check_request_fits(num_prompt, max_tokens, self.limits.max_position_embeddings, kv)
        if cfg.max_payload is not None:
            # prompt ids travel as msgpack (<= 5 bytes each) to the scheduler and worker
            if 5 * num_prompt + 4096 > cfg.max_payload:
                raise RequestError(
                    f"prompt of {num_prompt} tokens does not fit the bus's max_payload of "
                    f"{cfg.max_payload} bytes"
                )
            finished_bytes = 1024 + _FINISHED_BYTES_PER_TOKEN * max_tokens
            if finished_bytes > cfg.max_payload:
                raise RequestError(
                    f"max_tokens {max_tokens} would make a finished event (~{finished_bytes} "
                    f"bytes) over the bus's max_payload of {cfg.max_payload} bytes"
                )
            if prompt_logprobs is not None:
                # they travel in one event, the first token's
                per_token = _PROMPT_LOGPROB_BYTES + _PROMPT_ALTERNATIVE_BYTES * prompt_logprobs
                first_bytes = 1024 + per_token * num_prompt
                if first_bytes > cfg.max_payload:
                    raise RequestError(
                        f"prompt_logprobs={prompt_logprobs} for a prompt of {num_prompt} tokens "
                        f"would make the first token event ~{first_bytes} bytes, over the "
                        f"bus's max_payload of {cfg.max_payload} bytes: ask fewer "
                        f"alternatives (each costs ~{_PROMPT_ALTERNATIVE_BYTES} bytes a prompt "
                        "token), a shorter prompt, or raise max_payload"
                    )


def clean_trace_id(value: str | None) -> str | None:
    """A client's trace id if it is short and plain (it is copied into logs and messages),
    else None (a fresh one is made)."""
    return value if value is not None and _TRACE_ID_RE.match(value) else None


def seed_from_request_id(request_id: str) -> int:
    """A request's sampling seed when it gives none: a function of its id (63 bits)."""
    digest = blake2b(request_id.encode(), digest_size=8, person=b"rlt-seed-v1").digest()
    return int.from_bytes(digest, "little") >> 1


def _check_encodable(params: SamplingParams) -> None:
    """JSON carries integers msgpack cannot (e.g. a top_k of 2**70): refuse them here, not
    with a failure on the way to the scheduler."""
    try:
        _MSGPACK.encode(params)
    except (OverflowError, msgspec.EncodeError):
        raise RequestError("a number in the request is out of range (64-bit integers)") from None


def _decode_message(exc: msgspec.DecodeError | RecursionError) -> str:
    if isinstance(exc, RecursionError):
        return "invalid JSON: nested too deeply"
    if isinstance(exc, msgspec.ValidationError):
        return f"invalid request: {exc}"
    return f"invalid JSON: {exc}"


def salvage_request_id(data: bytes) -> str:
    """Best effort: the request id of a request that failed validation, for the error event."""
    try:
        obj = _ANY_DECODER.decode(data)
    except (msgspec.DecodeError, RecursionError):  # deeply nested JSON ends in RecursionError
        return ""
    if isinstance(obj, dict):
        rid = obj.get("request_id")
        if isinstance(rid, str) and len(rid) <= 256:
            return rid
    return ""


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
    moves: int = 0
    # the client asked to abort it: if its shard is lost it ends, it does not move
    abort_requested: bool = False


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

    def moved(self, entry: OpenRequest, new_seq: int, shard: str, now: float) -> None:
        """``entry`` is resubmitted to ``shard`` under ``new_seq``: anything still arriving
        for its old seq (its old shard's copy) no longer reaches it."""
        self._open.pop(entry.seq, None)
        entry.seq, entry.shard, entry.owner, entry.sent_at = new_seq, shard, None, now
        entry.moves += 1
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
        if event is None:  # a resync: the stream's outputs so far
            entry.token_ids = list(item.known_token_ids)
            entry.exit_depths = list(item.known_exit_depths)
            return entry, None
        if isinstance(event, TokenEvent):
            if event.index != len(entry.token_ids):
                return entry, None  # a duplicate (or, never expected, a gap)
            entry.token_ids.append(event.token_id)
            entry.exit_depths.append(event.exit_depth)
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
