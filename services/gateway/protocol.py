"""The OpenAI-compatible HTTP API, translated to rlt's NATS API. Pure: no HTTP, no NATS.

``parse_completion`` / ``parse_chat`` decode and check a request body (``ApiError`` with an
HTTP status for what rlt refuses), ``to_generate`` builds the ``GenerateRequest`` for
``rlt.v1.generate``, and the builders below shape responses, usage and errors as the
``openai`` client expects them.

Accepted beyond OpenAI's fields (vLLM's extra body fields, the loop knobs):
``top_k``, ``ignore_eos``, ``stop_token_ids``, ``min_loops``, ``max_loops``,
``exit_threshold``, ``priority``, ``chat_template_kwargs``, ``include_stop_str_in_output``
and ``return_token_ids`` (the choice carries ``token_ids`` and, rlt's own, ``exit_depths``).
Unknown fields are ignored, as OpenAI-compatible servers do; known options rlt cannot honour
(``logit_bias``, penalties, ``suffix``, tools, ...) are refused with a 400 that names them,
never silently dropped. ``n`` choices are ``n`` engine requests (``choice_requests``: ids
``<id>-<i>``, a given seed ``+ i`` as vLLM derives them), answered as one response.
``logprobs`` (completions: how many alternatives; chat: ``logprobs`` and ``top_logprobs``)
come back in OpenAI's two shapes (``completion_logprobs``, ``chat_logprobs``); completions'
``echo`` puts the prompt (and its log-probabilities) first, and vLLM's ``prompt_logprobs``
comes back in vLLM's shape (``vllm_prompt_logprobs``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from messages.api import GenerateRequest, TokenLogprobs
from messages.errors import ErrorCode
from messages.sampling import MAX_LOGPROBS

# rlt error code -> (HTTP status, OpenAI error type)
_STATUS: dict[str, tuple[int, str]] = {
    ErrorCode.INVALID_REQUEST: (400, "invalid_request_error"),
    ErrorCode.NOT_FOUND: (404, "not_found_error"),
    ErrorCode.OVERLOADED: (429, "rate_limit_error"),
    ErrorCode.UNAVAILABLE: (503, "service_unavailable_error"),
    ErrorCode.TIMEOUT: (504, "timeout_error"),
    ErrorCode.INTERNAL: (500, "server_error"),
}
# how long a client told "overloaded" should wait before retrying (seconds)
RETRY_AFTER_S = 1


# limits on what a request may ask of the gateway itself
MAX_STOPS = 64
MAX_STOP_CHARS = 2048
MAX_BODY_BYTES = 16 << 20  # far above any request the bus could carry (max_payload)
MAX_CHOICES = 128  # OpenAI's bound on n; each choice is a request of its own in the engine
_SEED_MOD = 2**63  # SamplingParams' seed range


class ApiError(Exception):
    """A request the gateway answers with an OpenAI error body."""

    def __init__(
        self, message: str, code: str = ErrorCode.INVALID_REQUEST, param: str | None = None
    ):
        super().__init__(message)
        self.message = message
        self.code = str(code)
        self.param = param

    @property
    def status(self) -> int:
        return _STATUS.get(self.code, (500, ""))[0]

    def body(self) -> dict[str, Any]:
        return error_body(self.code, self.message, self.param)

    def headers(self) -> dict[str, str]:
        if self.status in (429, 503):
            return {"Retry-After": str(RETRY_AFTER_S)}
        return {}


def error_body(code: str, message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = _STATUS.get(code, (500, "server_error"))[1]
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ---------------------------------------------------------------------- requests
class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class _Common(msgspec.Struct, kw_only=True):
    """Fields the two endpoints share (OpenAI's, then the extra body fields)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    user: str | None = None
    # vLLM's extra body fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    return_token_ids: bool | None = None
    priority: int | None = None
    # known elsewhere (OpenAI's legacy functions, vLLM's constrained decoding and output
    # options) and not supported: declared so a request that sets them is refused by name
    # instead of being answered as if they were honoured
    min_tokens: int | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[Any] | None = None
    guided_grammar: str | None = None
    structured_outputs: Any = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool | None = None
    # rlt's loop knobs
    min_loops: int | None = None
    max_loops: int | None = None
    exit_threshold: float | None = None


class CompletionRequest(_Common, kw_only=True):
    # str | list[int] | list[str] | list[list[int]]: checked by hand (msgspec unions hold
    # one array type at most)
    prompt: Any = None
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None


class ChatRequest(_Common, kw_only=True):
    messages: list[dict[str, Any]] | None = None
    echo: bool | None = None  # vLLM's (echo the last message): not supported
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None


_COMPLETION_DECODER = msgspec.json.Decoder(CompletionRequest)
_CHAT_DECODER = msgspec.json.Decoder(ChatRequest)


@dataclass(frozen=True)
class Options:
    """What the gateway itself does with a request (everything else goes to the engine)."""

    stream: bool
    include_usage: bool
    stops: tuple[str, ...]
    include_stop_str: bool
    return_token_ids: bool
    # the alternatives each token comes with (0: its own log-probability only); None: no
    # log-probabilities
    logprobs: int | None = None
    # completions' echo: the answer starts with this, the prompt's text (the request's own,
    # or its token ids decoded by the checkpoint's tokenizer); None: no echo
    echo_text: str | None = None
    prompt_logprobs: int | None = None  # vLLM's: the prompt's, in vLLM's shape


def parse_completion(body: bytes) -> CompletionRequest:
    req = _decode(_COMPLETION_DECODER, body)
    _check_common(req)
    _check_logprobs(req.logprobs, "logprobs")
    _refuse_if(req.suffix is not None, "suffix")
    _prompt_fields(req.prompt)  # shape check now, before anything is sent
    return req


def parse_chat(body: bytes) -> ChatRequest:
    req = _decode(_CHAT_DECODER, body)
    _check_common(req)
    _refuse_if(req.echo, "echo")
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError("top_logprobs needs logprobs: true", param="top_logprobs")
    _check_logprobs(req.top_logprobs, "top_logprobs")
    _refuse_if(bool(req.tools), "tools")
    _refuse_if(req.tool_choice not in (None, "none"), "tool_choice")
    _refuse_if(bool(req.functions), "functions")
    _refuse_if(req.function_call not in (None, "none"), "function_call")
    fmt = (req.response_format or {}).get("type", "text")
    _refuse_if(fmt != "text", "response_format", f"response_format {fmt!r} is not supported")
    _refuse_if(req.add_generation_prompt is False, "add_generation_prompt")
    _refuse_if(req.continue_final_message, "continue_final_message")
    if not req.messages:
        raise ApiError("'messages' must be a non-empty list", param="messages")
    _chat_messages(req.messages)
    return req


def options(
    req: CompletionRequest | ChatRequest, decode: Callable[[list[int]], str] | None = None
) -> Options:
    """What the gateway does with ``req``; ``decode`` (the checkpoint's tokenizer) gives an
    echo of token ids its text."""
    echo_text = None
    if isinstance(req, CompletionRequest) and req.echo:
        prompt = _prompt_fields(req.prompt)
        if "prompt" in prompt:
            echo_text = prompt["prompt"]
        elif decode is not None:
            echo_text = decode(prompt["prompt_token_ids"])
        else:
            raise ApiError(
                "echo of a token-id prompt needs a checkpoint with a tokenizer", param="echo"
            )
    stops = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    return Options(
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        stops=stops,
        include_stop_str=bool(req.include_stop_str_in_output),
        return_token_ids=bool(req.return_token_ids),
        logprobs=_logprobs(req),
        echo_text=echo_text,
        prompt_logprobs=req.prompt_logprobs,
    )


def _prompt_logprobs(req: CompletionRequest | ChatRequest) -> int | None:
    """What the engine computes for the prompt: vLLM's ``prompt_logprobs``, and for an echo
    with ``logprobs`` as many alternatives (an echo without them costs the engine nothing)."""
    wanted = [req.prompt_logprobs]
    if isinstance(req, CompletionRequest) and req.echo:
        wanted.append(req.logprobs)
    asked = [n for n in wanted if n is not None]
    return max(asked) if asked else None


def _logprobs(req: CompletionRequest | ChatRequest) -> int | None:
    """How many alternatives each token comes with (the NATS API's ``logprobs``)."""
    if isinstance(req, ChatRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def to_generate(req: CompletionRequest | ChatRequest, request_id: str) -> GenerateRequest:
    """The NATS API request. Unset fields stay unset: the checkpoint's defaults apply."""
    fields: dict[str, Any] = {
        "request_id": request_id,
        "max_tokens": req.max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "seed": req.seed,
        "max_loops": req.max_loops,
        "exit_threshold": req.exit_threshold,
    }
    for name in ("min_loops", "ignore_eos", "stop_token_ids", "priority"):
        value = getattr(req, name)
        if value is not None:
            fields[name] = value
    fields["logprobs"] = _logprobs(req)
    fields["prompt_logprobs"] = _prompt_logprobs(req)
    if isinstance(req, ChatRequest):
        if req.max_completion_tokens is not None:
            fields["max_tokens"] = req.max_completion_tokens
        fields["messages"] = _chat_messages(req.messages or [])
        if req.chat_template_kwargs:
            fields["chat_template_kwargs"] = req.chat_template_kwargs
    else:
        fields.update(_prompt_fields(req.prompt))
    return GenerateRequest(**fields)


def choice_requests(request: GenerateRequest, n: int) -> list[GenerateRequest]:
    """The engine requests of ``n`` choices. One choice is the request itself; several get
    ids ``<id>-<i>`` and, when the request names a seed, seeds ``seed + i`` (vLLM's rule:
    the choices differ, and the same request gives the same choices again). Unseeded, each
    draws from a seed of its own id (admission)."""
    if n == 1:
        return [request]
    assert request.request_id is not None
    seed = request.seed
    # a seed out of range stays as it is: admission refuses it, as it would with n = 1
    in_range = seed is not None and 0 <= seed < _SEED_MOD
    seeds = [(seed + i) % _SEED_MOD for i in range(n)] if in_range else [seed] * n
    return [
        msgspec.structs.replace(request, request_id=f"{request.request_id}-{i}", seed=s)
        for i, s in enumerate(seeds)
    ]


def _decode(decoder: msgspec.json.Decoder[Any], body: bytes) -> Any:
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise ApiError(f"invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ApiError(f"invalid JSON: {exc}") from None


def _check_common(req: _Common) -> None:
    if req.n is not None and not 1 <= req.n <= MAX_CHOICES:
        raise ApiError(f"n must be between 1 and {MAX_CHOICES}, got {req.n}", param="n")
    if req.best_of not in (None, req.n or 1):  # best_of = n returns every choice: it is n
        raise ApiError(
            f"best_of={req.best_of} is not supported (only best_of = n: rlt returns every "
            "choice it makes)",
            param="best_of",
        )
    _refuse_if(bool(req.logit_bias), "logit_bias")
    _refuse_if(req.presence_penalty not in (None, 0, 0.0), "presence_penalty")
    _refuse_if(req.frequency_penalty not in (None, 0, 0.0), "frequency_penalty")
    _refuse_if(req.repetition_penalty not in (None, 1, 1.0), "repetition_penalty")
    _refuse_if(req.min_p not in (None, 0, 0.0), "min_p")
    _refuse_if(req.min_tokens not in (None, 0), "min_tokens")
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        _refuse_if(getattr(req, name) is not None, name)
    _refuse_if(req.structured_outputs is not None, "structured_outputs")
    _check_logprobs(req.prompt_logprobs, "prompt_logprobs")
    # the streams' text always skips special tokens
    _refuse_if(req.skip_special_tokens is False, "skip_special_tokens")
    if req.stream_options is not None and not req.stream:
        raise ApiError("stream_options is only allowed with stream=true", param="stream_options")
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if any(not s for s in stops):
        raise ApiError("stop strings must not be empty", param="stop")
    # every stop string is searched for at every token, on the loop all streams share
    if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ApiError(
            f"at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters each",
            param="stop",
        )


def _check_logprobs(value: int | None, param: str) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise ApiError(f"{param} must be between 0 and {MAX_LOGPROBS}, got {value}", param=param)


def _refuse_if(condition: Any, param: str, message: str | None = None) -> None:
    if condition:
        raise ApiError(message or f"{param} is not supported by rlt", param=param)


def _prompt_fields(prompt: Any) -> dict[str, Any]:
    """A completion prompt as the NATS API takes it: text, or token ids. OpenAI also allows
    a list of prompts; one prompt per request here (a list of one is unwrapped)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return {"prompt_token_ids": prompt}
    if isinstance(prompt, list) and len(prompt) > 1:
        raise ApiError(
            f"a list of {len(prompt)} prompts is not supported: send one prompt per request",
            param="prompt",
        )
    raise ApiError("'prompt' must be a string or a non-empty list of token ids", param="prompt")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for the chat template: content parts of type "text" are joined, one per
    line as vLLM joins them, into the string the template expects; other parts (images,
    audio) are refused."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError("each message needs a string 'role'", param="messages")
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ApiError(
                        f"message content of type {kind!r} is not supported (text only)",
                        param="messages",
                    )
                texts.append(str(part.get("text", "")))
            message = {**message, "content": "\n".join(texts)}
        elif content is None:
            message = {**message, "content": ""}
        elif not isinstance(content, str):
            raise ApiError("message content must be a string or text parts", param="messages")
        out.append(message)
    return out


# ---------------------------------------------------------------------- responses
@dataclass
class Usage:
    """Token counts of one response; ``exit_depths`` are the loops of each completion token
    (of every choice: the prompt is counted once, as OpenAI does)."""

    prompt_tokens: int
    cached_tokens: int
    exit_depths: list[int]

    def body(self) -> dict[str, Any]:
        completion = len(self.exit_depths)
        loops = sum(self.exit_depths)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            # rlt's extension: loops of the shared core per completion token, and their sum
            # (the decode's loops; the prefill of a prompt is full depth on top of this)
            "mean_exit_depth": round(loops / completion, 6) if completion else None,
            "core_loops": loops,
        }


def completion_logprobs(entries: list[TokenLogprobs], offsets: list[int]) -> dict[str, Any]:
    """The completions API's (legacy) shape: per token its text, log-probability, offset
    (where it starts in the tokens' texts joined, as vLLM counts it) and a map of
    alternatives that always holds the token itself (so up to ``logprobs`` + 1 entries, as
    OpenAI documents)."""
    top: list[dict[str, float | None] | None] = []
    for e in entries:
        if e.logprob is None and not e.top_logprobs:
            top.append(None)  # an echoed prompt's first token: nothing predicts it
            continue
        alternatives = {t.token: t.logprob for t in e.top_logprobs}
        alternatives.setdefault(e.token, e.logprob)
        top.append(alternatives)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": top,
        "text_offset": offsets,
    }


def chat_logprobs(entries: list[TokenLogprobs]) -> dict[str, Any]:
    """The chat API's shape: per token its text, UTF-8 bytes, log-probability and the
    ``top_logprobs`` most likely alternatives."""

    def one(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {
        "content": [
            {
                **one(e.token, e.logprob),
                "top_logprobs": [one(t.token, t.logprob) for t in e.top_logprobs],
            }
            for e in entries
        ],
        "refusal": None,
    }


def vllm_prompt_logprobs(entries: list[TokenLogprobs]) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, None for the first, else a map from
    token id to its log-probability and text, holding the prompt token and the N most
    likely (vLLM also gives each a ``rank``; rlt does not compute ranks)."""
    out: list[dict[str, Any] | None] = []
    for e in entries:
        if e.logprob is None and not e.top_logprobs:
            out.append(None)
            continue
        scored = {str(t.token_id): {"logprob": t.logprob, "decoded_token": t.token}
                  for t in e.top_logprobs}  # fmt: skip
        scored.setdefault(str(e.token_id), {"logprob": e.logprob, "decoded_token": e.token})
        out.append(scored)
    return out


def completion_choice(
    index: int,
    text: str,
    finish_reason: str | None,
    extra: dict[str, Any],
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        **extra,
    }


def chat_choice(
    index: int,
    text: str,
    finish_reason: str | None,
    extra: dict[str, Any],
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "index": index,
        "message": {"role": "assistant", "content": text},
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        **extra,
    }


def response_body(
    chat: bool,
    request_id: str,
    model: str,
    created: int,
    choices: list[dict[str, Any]],
    usage: Usage,
    top: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A non-streaming response; ``top``: fields of the response itself (vLLM's chat
    ``prompt_logprobs``)."""
    return {
        "id": request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage.body(),
        **(top or {}),
    }


def models_body(model: str, created: int, max_model_len: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": model,
                "object": "model",
                "created": created,
                "owned_by": "rlt",
                "root": model,
                "max_model_len": max_model_len,
            }
        ],
    }
