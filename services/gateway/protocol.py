"""The OpenAI-compatible HTTP API's requests: their shapes, decoded and checked. Pure: no
HTTP, no NATS.

``parse_completion`` / ``parse_chat`` decode and check a request body (``ApiError``,
``errors.py``, with an HTTP status for what rlt refuses); ``translate.py`` turns a checked
request into rlt's NATS API, ``responses.py`` shapes the answers.

Accepted beyond OpenAI's fields (vLLM's extra body fields, the loop knobs):
``top_k``, ``ignore_eos``, ``stop_token_ids``, ``min_loops``, ``max_loops``,
``exit_threshold``, ``shed_depth`` (false: full depth under overload shedding),
``token_sparse_prefill`` and ``prefill_retention`` (token-sparse prefill),
``priority``, ``chat_template_kwargs``, ``include_stop_str_in_output``
and ``return_token_ids`` (the choice carries ``token_ids`` and, rlt's own, ``exit_depths``).
Structured outputs: ``response_format`` (json_object, json_schema) and vLLM's
``structured_outputs`` (json, regex, choice, grammar, json_object), ``structured.py``.
Chat's tool calling: ``tools``, ``tool_choice``, ``parallel_tool_calls`` (``tools.py``).
Unknown fields are ignored, as OpenAI-compatible servers do; every field of OpenAI's schema
for the two endpoints (and the vLLM fields that would change the answer) that rlt does not
honour is refused with a 400 that names it (``_UNSUPPORTED``), never silently dropped; the few
OpenAI documents as hints (``user``, ``metadata``, ...) are ignored (docs/gateway.md has the
table). ``n`` choices (up to ``MAX_CHOICES``) are answered as one response (one engine
request each, ``translate.py``).
``logprobs`` (completions: how many alternatives; chat: ``logprobs`` and ``top_logprobs``)
come back in OpenAI's two shapes (``responses.py``); completions' ``echo`` puts the prompt
(and its log-probabilities) first, and vLLM's ``prompt_logprobs`` comes back in vLLM's
shape.
"""

from __future__ import annotations

from typing import Any

import msgspec

from messages.sampling import MAX_LOGPROBS, StructuredOutput
from services.gateway.constrained.structured import FormatError, structured_output
from services.gateway.constrained.tools import check_tools, uses_format
from services.gateway.errors import ApiError

# limits on what a request may ask of the gateway itself
MAX_STOPS = 64
MAX_STOP_CHARS = 2048
MAX_BODY_BYTES = 16 << 20  # far above any request the bus could carry (max_payload)
MAX_CHOICES = 128  # OpenAI's bound on n; each choice is a request of its own in the engine


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    # vLLM's usage on every frame (with include_usage, as vLLM reads it): the counts so far
    continuous_usage_stats: bool = False
    # OpenAI's random padding of stream frames (against a network observer guessing token
    # lengths from frame sizes): not implemented, so only ``false`` is taken
    include_obfuscation: bool | None = None


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
    best_of: int | None = None
    user: str | None = None  # ignored: OpenAI's abuse-monitoring id
    # text, json_object or json_schema (services/gateway/constrained/structured.py)
    response_format: dict[str, Any] | None = None
    # vLLM's extra body fields
    top_k: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    return_token_ids: bool | None = None
    priority: int | None = None
    prompt_logprobs: int | None = None
    # chat's tool calling (services/gateway/constrained/tools.py); checked by hand, so that each
    # malformed part is named; completions refuse them
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    # OpenAI's and vLLM's fields rlt does not implement (``_UNSUPPORTED``): of any type, so
    # that a request setting one is refused by the field's name, never answered as if it
    # were honoured
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    functions: Any = None
    function_call: Any = None
    min_p: Any = None
    repetition_penalty: Any = None
    min_tokens: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    structured_outputs: Any = None
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    use_beam_search: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    logits_processors: Any = None
    truncate_prompt_tokens: Any = None
    return_tokens_as_token_ids: Any = None
    # rlt's loop knobs
    min_loops: int | None = None
    max_loops: int | None = None
    exit_threshold: float | None = None
    shed_depth: bool | None = None
    # token-sparse prefill (docs/sparse_prefill.md); checked by admission
    token_sparse_prefill: bool | None = None
    prefill_retention: list[float] | None = None


class CompletionRequest(_Common, kw_only=True):
    # str | list[int] | list[str] | list[list[int]]: checked by hand (msgspec unions hold
    # one array type at most)
    prompt: Any = None
    echo: bool | None = None
    logprobs: int | None = None
    suffix: Any = None  # not implemented
    prompt_embeds: Any = None  # vLLM's: not implemented


class ChatRequest(_Common, kw_only=True):
    messages: list[dict[str, Any]] | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # not implemented (``_UNSUPPORTED``): OpenAI's, then vLLM's
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    service_tier: Any = None
    store: Any = None
    echo: Any = None  # vLLM's: echo the last message
    add_generation_prompt: Any = None
    continue_final_message: Any = None
    chat_template: Any = None
    documents: Any = None


# Fields rlt does not implement, each with the values that ask for nothing beyond what rlt
# does anyway (a client may send those); any other value is a 400 naming the field.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    # OpenAI's
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "functions": (None, []),
    "function_call": (None, "none"),
    # vLLM's
    "min_p": (None, 0),
    "repetition_penalty": (None, 1),
    "min_tokens": (None, 0),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "guided_decoding_backend": (None,),
    "guided_whitespace_pattern": (None,),
    "skip_special_tokens": (None, True),  # the streams' text always skips special tokens
    "spaces_between_special_tokens": (None, True),
    "use_beam_search": (None, False),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "logits_processors": (None, []),
    "truncate_prompt_tokens": (None,),
    "return_tokens_as_token_ids": (None, False),
}
_UNSUPPORTED_COMPLETION: dict[str, tuple[Any, ...]] = {
    # tools are chat's (OpenAI's completions take none)
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None,),
    "suffix": (None, ""),
    "prompt_embeds": (None,),
}
_UNSUPPORTED_CHAT: dict[str, tuple[Any, ...]] = {
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "web_search_options": (None,),
    "service_tier": (None, "auto", "default"),
    "store": (None, False),  # rlt keeps no completions
    # vLLM's
    "echo": (None, False),
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "chat_template": (None,),
    "documents": (None,),
}


_COMPLETION_DECODER = msgspec.json.Decoder(CompletionRequest)
_CHAT_DECODER = msgspec.json.Decoder(ChatRequest)


def parse_completion(body: bytes) -> CompletionRequest:
    req = _decode(_COMPLETION_DECODER, body)
    _check_common(req)
    _refuse_unsupported(req, _UNSUPPORTED_COMPLETION)
    _check_logprobs(req.logprobs, "logprobs")
    if req.echo and req.logprobs is not None and _asks_sparse_prefill(req):
        # an echo with logprobs scores the prompt (the NATS API's prompt_logprobs)
        raise ApiError(
            "token_sparse_prefill cannot be combined with echo and logprobs: frozen prompt "
            "tokens never run their late loops, so the prompt cannot be scored",
            param="echo",
        )
    prompt_fields(req.prompt)  # shape check now, before anything is sent
    return req


def _asks_sparse_prefill(req: _Common) -> bool:
    """The request itself turns token-sparse prefill on (a retention alone does)."""
    return bool(req.token_sparse_prefill) or (
        req.token_sparse_prefill is None and req.prefill_retention is not None
    )


def parse_chat(body: bytes) -> ChatRequest:
    req = _decode(_CHAT_DECODER, body)
    _check_common(req)
    _refuse_unsupported(req, _UNSUPPORTED_CHAT)
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError("top_logprobs needs logprobs: true", param="top_logprobs")
    _check_logprobs(req.top_logprobs, "top_logprobs")
    if not req.messages:
        raise ApiError("'messages' must be a non-empty list", param="messages")
    chat_messages(req.messages)
    check_tools(req)
    if uses_format(req) and structured_output_of(req) is not None:
        param = "response_format" if req.response_format else "structured_outputs"
        raise ApiError(
            f"{param} cannot be combined with tools unless tool_choice is none: the tool "
            "calls are the output's format",
            param=param,
        )
    return req


def _decode(decoder: msgspec.json.Decoder[Any], body: bytes) -> Any:
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise ApiError(f"invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ApiError(f"invalid JSON: {exc}") from None
    except RecursionError:  # msgspec's decoder recurses per level (as admission's does)
        raise ApiError("invalid JSON: nested too deeply") from None


def _check_common(req: _Common) -> None:
    if req.n is not None and not 1 <= req.n <= MAX_CHOICES:
        raise ApiError(f"n must be between 1 and {MAX_CHOICES}, got {req.n}", param="n")
    if req.best_of not in (None, req.n or 1):  # best_of = n returns every choice: it is n
        raise ApiError(
            f"best_of={req.best_of} is not supported (only best_of = n: rlt returns every "
            "choice it makes)",
            param="best_of",
        )
    _refuse_unsupported(req, _UNSUPPORTED)
    structured_output_of(req)
    _check_logprobs(req.prompt_logprobs, "prompt_logprobs")
    if req.stream_options is not None:
        if not req.stream:
            raise ApiError(
                "stream_options is only allowed with stream=true", param="stream_options"
            )
        _refuse_if(req.stream_options.include_obfuscation, "stream_options.include_obfuscation")
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if any(not s for s in stops):
        raise ApiError("stop strings must not be empty", param="stop")
    # every stop string is searched for at every token, on the loop all streams share
    if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ApiError(
            f"at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters each",
            param="stop",
        )


def structured_output_of(req: _Common) -> StructuredOutput | None:
    """``response_format`` or vLLM's ``structured_outputs`` as the NATS API's format."""
    try:
        return structured_output(req.response_format, req.structured_outputs)
    except FormatError as exc:
        raise ApiError(exc.message, param=exc.param) from None


def _check_logprobs(value: int | None, param: str) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise ApiError(f"{param} must be between 0 and {MAX_LOGPROBS}, got {value}", param=param)


def _refuse_unsupported(req: _Common, fields: dict[str, tuple[Any, ...]]) -> None:
    for name, harmless in fields.items():
        value = getattr(req, name)
        _refuse_if(not any(_same(value, h) for h in harmless), name)


def _same(value: Any, harmless: Any) -> bool:
    # True == 1 in Python: a boolean only stands for itself
    if isinstance(value, bool) or isinstance(harmless, bool):
        return value is harmless
    return bool(value == harmless)


def _refuse_if(condition: Any, param: str, message: str | None = None) -> None:
    if condition:
        raise ApiError(message or f"{param} is not supported by rlt", param=param)


def prompt_fields(prompt: Any) -> dict[str, Any]:
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


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
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
        _check_tool_calls(message.get("tool_calls"))
        out.append(message)
    return out


def _check_tool_calls(calls: Any) -> None:
    """An assistant turn's past calls: OpenAI's shape, the part a template reads."""
    if calls is None:
        return
    ok = isinstance(calls, list) and all(
        isinstance(c, dict)
        and isinstance(c.get("function"), dict)
        and isinstance(c["function"].get("name"), str)
        and isinstance(c["function"].get("arguments", ""), str | dict)
        for c in calls
    )
    if not ok:
        raise ApiError(
            'a message\'s tool_calls must be a list of {"id", "type": "function", '
            '"function": {"name", "arguments"}}',
            param="messages",
        )
