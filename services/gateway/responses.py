"""The answers of the OpenAI-compatible API: usage, choices, log-probabilities (OpenAI's
two shapes and vLLM's prompt shape), whole responses and the model list, as the ``openai``
client expects them. Pure: no HTTP, no NATS."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from messages.api import TokenLogprobs


@dataclass
class Usage:
    """Token counts of one response: the prompt once (every choice has the same, as OpenAI
    counts it), the completion tokens of every choice and the loops they ran, summed."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    core_loops: int
    shed_tokens: int = 0  # completion tokens run under a depth budget overload shedding lowered
    # hidden-state rows the prompts' loops computed (token x loop; fewer under token-sparse
    # prefill), every choice's
    prefill_rows: int = 0
    # self-speculative decoding: drafted tokens the deep loops accepted and rejected
    accepted_draft_tokens: int = 0
    rejected_draft_tokens: int = 0

    def body(self) -> dict[str, Any]:
        completion, loops = self.completion_tokens, self.core_loops
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            # rlt's extension: loops of the shared core per completion token, and their sum
            # (the decode's loops; the prefill of a prompt is full depth on top of this)
            "mean_exit_depth": round(loops / completion, 6) if completion else None,
            "core_loops": loops,
            "shed_tokens": self.shed_tokens,
            "prefill_rows": self.prefill_rows,
            # OpenAI's names for predicted tokens; here the early loops predict them
            "completion_tokens_details": {
                "accepted_prediction_tokens": self.accepted_draft_tokens,
                "rejected_prediction_tokens": self.rejected_draft_tokens,
            },
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
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:  # OpenAI's: the content is null when the answer is only calls
        message.update(content=text or None, tool_calls=tool_calls)
    return {
        "index": index,
        "message": message,
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
