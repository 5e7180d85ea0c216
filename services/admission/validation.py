"""Request validation (pure: no NATS): decode a public request, check its id, tokenize its
prompt, resolve its sampling parameters against the model, and refuse what could never run
(too long for the model, the KV cache or the bus's max_payload).

Errors are raised as ``AdmissionError`` carrying the request id (when one could be read),
a code from ``messages.errors.ErrorCode`` and a message for the client.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from hashlib import blake2b

import jinja2
import msgspec

from messages.api import AbortRequest, GenerateRequest
from messages.errors import ErrorCode, RequestError
from messages.sampling import SamplingParams
from services.admission.config import AdmissionConfig
from services.admission.errors import AdmissionError
from services.common.config import ModelLimits
from services.common.fit import KVGeometry, check_request_fits
from services.common.structured.grammar import check_structured_output, with_backend
from services.common.tokenizer import TextCodec
from services.common.tool_template import chat_for_template
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


@dataclass
class Prepared:
    """A request that passed every check that does not depend on load."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    trace_id: str
    prompt_text: str | None = None  # only for RLT_LOG_CONTENT=1 logging
    tenant: str = subjects.DEFAULT_TENANT


class RequestValidator:
    """Decodes and checks what a client sent: the request's shape, its id, its prompt
    (tokenized here), its sampling parameters against the model, and whether it can ever
    fit the KV cache and the bus. Raises ``AdmissionError``; knows nothing of load."""

    def __init__(
        self, limits: ModelLimits, codec: TextCodec | None, config: AdmissionConfig | None = None
    ) -> None:
        self.limits = limits
        self.codec = codec
        self.config = config or AdmissionConfig()

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
            # the grammar engine is fixed here: every worker the request runs on uses it
            params = with_backend(params, self.config.structured_outputs_backend)
            if params.seed is None:
                # fixed here, from the id: a request resumed on another shard, or retried
                # through another admission, samples exactly the same tokens
                params = msgspec.structs.replace(params, seed=seed_from_request_id(request_id))
            assert params.max_tokens is not None
            self._check_fits(len(prompt), params.max_tokens, params.prompt_logprobs)
            _check_encodable(params)
            if params.structured_output is not None and self.codec is None:
                raise RequestError(
                    "structured_output needs the checkpoint's tokenizer (tokenizer.json)"
                )
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

    def check_structured_output(self, prepared: Prepared) -> None:
        """Raises AdmissionError naming the problem when the request's structured output
        does not compile. The first call loads its grammar engine (xgrammar loads torch),
        which takes up to seconds: the service calls this off its event loop."""
        constraint = prepared.params.structured_output
        if constraint is None:
            return
        try:
            check_structured_output(constraint)
        except RequestError as exc:
            raise AdmissionError(prepared.request_id, exc.code, exc.message) from None

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
            ids = self._tokenize_chat(
                request.messages, request.chat_template_kwargs or {}, request.tools
            )
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

    def _tokenize_chat(
        self, messages: list[dict], template_kwargs: dict, tools: list[dict] | None = None
    ) -> list[int]:
        codec = self._codec()
        if codec.chat_template is None:
            raise RequestError("this checkpoint's tokenizer has no chat template; send prompt")
        for message in messages:
            content = message.get("content")
            if content is None and message.get("tool_calls"):
                content = ""  # an assistant turn that only called tools
            if not isinstance(message.get("role"), str) or not isinstance(content, str | list):
                raise RequestError("each message needs a string 'role' and a 'content'")
        tool_chars = len(json.dumps(tools)) if tools else 0
        self._check_chars(sum(len(str(m.get("content"))) for m in messages) + tool_chars)
        try:
            # a template without tools gets rlt's default tool prompt (tool_template.py)
            messages, tools = chat_for_template(codec, messages, tools)
            return codec.encode_chat(messages, True, tools, **template_kwargs)
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
