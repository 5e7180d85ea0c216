"""A parsed request, translated: for the engine and for the gateway itself. Pure.

``to_generate`` builds the ``GenerateRequest`` for ``rlt.v1.generate`` (unset fields stay
unset: the checkpoint's defaults apply); ``options`` is what the gateway does itself (the
stream, string stops, log-probabilities' shape, completions' echo). ``n`` choices are
``n`` engine requests (``choice_requests``: ids ``<id>-<i>``, a given seed ``+ i`` as vLLM
derives them), answered as one response.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from messages.api import GenerateRequest
from services.common.tool_template import TemplateTools
from services.gateway.constrained.tools import ToolCalling, tool_calling
from services.gateway.errors import ApiError
from services.gateway.protocol import (
    ChatRequest,
    CompletionRequest,
    StreamOptions,
    chat_messages,
    prompt_fields,
    structured_output_of,
)

_SEED_MOD = 2**63  # SamplingParams' seed range


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
    # vLLM's continuous_usage_stats: every frame carries the usage so far
    continuous_usage: bool = False
    # chat's tools (tools.py): what the template gets, and how calls are read back
    tools: ToolCalling | None = None


def options(
    req: CompletionRequest | ChatRequest,
    decode: Callable[[list[int]], str] | None = None,
    template: TemplateTools | None = None,
) -> Options:
    """What the gateway does with ``req``; ``decode`` (the checkpoint's tokenizer) gives an
    echo of token ids its text; ``template``: what the chat template does with tools."""
    echo_text = None
    if isinstance(req, CompletionRequest) and req.echo:
        prompt = prompt_fields(req.prompt)
        if "prompt" in prompt:
            echo_text = prompt["prompt"]
        elif decode is not None:
            try:
                echo_text = decode(prompt["prompt_token_ids"])
            except (OverflowError, ValueError, TypeError):  # an id beyond what a token id holds
                raise ApiError(
                    "prompt token ids out of the tokenizer's range", param="prompt"
                ) from None
        else:
            raise ApiError(
                "echo of a token-id prompt needs a checkpoint with a tokenizer", param="echo"
            )
    stops = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    usage = req.stream_options or StreamOptions()
    return Options(
        stream=bool(req.stream),
        include_usage=usage.include_usage,
        continuous_usage=usage.include_usage and usage.continuous_usage_stats,
        stops=stops,
        include_stop_str=bool(req.include_stop_str_in_output),
        return_token_ids=bool(req.return_token_ids),
        logprobs=_logprobs(req),
        echo_text=echo_text,
        prompt_logprobs=req.prompt_logprobs,
        tools=tool_calling(req, template) if isinstance(req, ChatRequest) else None,
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


def to_generate(
    req: CompletionRequest | ChatRequest, request_id: str, tools: ToolCalling | None = None
) -> GenerateRequest:
    """The NATS API request. Unset fields stay unset: the checkpoint's defaults apply.
    ``tools`` (``options``' own): the tools for the template, and their format."""
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
    for name in (
        "min_loops",
        "ignore_eos",
        "stop_token_ids",
        "priority",
        "shed_depth",
        "token_sparse_prefill",
        "prefill_retention",
    ):
        value = getattr(req, name)
        if value is not None:
            fields[name] = value
    fields["logprobs"] = _logprobs(req)
    fields["prompt_logprobs"] = _prompt_logprobs(req)
    fields["structured_output"] = structured_output_of(req)
    if tools is not None:
        fields["tools"] = tools.tools
        if tools.constraint is not None:  # (a format besides is refused by parse_chat)
            fields["structured_output"] = tools.constraint
    if isinstance(req, ChatRequest):
        if req.max_completion_tokens is not None:
            fields["max_tokens"] = req.max_completion_tokens
        fields["messages"] = chat_messages(req.messages or [])
        if req.chat_template_kwargs:
            fields["chat_template_kwargs"] = req.chat_template_kwargs
    else:
        fields.update(prompt_fields(req.prompt))
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
