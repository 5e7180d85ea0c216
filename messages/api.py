"""Public client API (JSON on ``rlt.v1.generate`` / ``rlt.v1.abort``) and stream events."""

from __future__ import annotations

from typing import Any

import msgspec

from messages.sampling import SamplingParams


class GenerateRequest(SamplingParams, kw_only=True, forbid_unknown_fields=True):
    """A client's request: the prompt plus flat sampling fields. The prompt is exactly one
    of ``prompt`` (text), ``prompt_token_ids``, or ``messages`` (a chat, rendered with the
    checkpoint's chat template; ``chat_template_kwargs`` reach the template, and ``tools``,
    OpenAI's function entries, as transformers passes them)."""

    request_id: str | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            **{name: getattr(self, name) for name in SamplingParams.__struct_fields__}
        )


class AbortRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    request_id: str


class TopLogprob(msgspec.Struct, gc=False, kw_only=True):
    token_id: int
    logprob: float
    token: str = ""  # the token decoded on its own (empty without a tokenizer)


class TokenLogprobs(msgspec.Struct, gc=False, kw_only=True):
    """The generated token's log-probability under the model's distribution at its exit
    depth (the logits before temperature and top-k/top-p), and the ``logprobs`` most likely
    tokens, most likely first. For a prompt token: the full-depth prediction of it from the
    tokens before (None for the first, which nothing predicts)."""

    logprob: float | None
    token_id: int = -1  # (-1 from a version that did not send it)
    token: str = ""  # the token decoded on its own (empty without a tokenizer)
    top_logprobs: list[TopLogprob] = msgspec.field(default_factory=list)


class TokenEvent(
    msgspec.Struct, gc=False, kw_only=True, tag="token", tag_field="type", omit_defaults=True
):
    """One generated token. The optional fields (log-probabilities, the first token's
    prompt counts, a shed token's depth budget) are sent only when they hold something, so
    a plain token event costs no more bytes than its five fields."""

    request_id: str
    index: int
    token_id: int
    exit_depth: int
    text: str  # the text this token adds (services/scheduler/output.py)
    logprobs: TokenLogprobs | None = None
    # the first token's event (index 0), when the request asked for ``prompt_logprobs``:
    # one entry per prompt token, in order
    prompt_logprobs: list[TokenLogprobs] | None = None
    # the first token's event only: the prompt's token count and how many of them the prefix
    # cache held, so a stream can report its usage before it ends
    num_prompt_tokens: int | None = None
    num_cached_tokens: int | None = None
    # the most loops this token could run when overload shedding lowered it below the
    # request's max_loops (None: it could run them all); a shard that resumes the request
    # after its shard was lost learns from these which earlier tokens were shed
    depth_budget: int | None = None


class FinishedEvent(msgspec.Struct, gc=False, kw_only=True, tag="finished", tag_field="type"):
    request_id: str
    finish_reason: str
    token_ids: list[int]
    exit_depths: list[int]
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    text: str = ""
    # the engine shard it finished on (after a shard loss: the shard it was resumed on)
    shard: str = ""
    # produced by the ``--device sim`` worker (benchmarks only): the tokens are not a model's
    simulated: bool = False
    # generated tokens that ran under a depth budget overload shedding lowered below the
    # request's max_loops; with any, ``depth_budgets`` holds each token's budget (the most
    # loops it could run; entry 0, the prompt's token, always ran full depth)
    shed_tokens: int = 0
    depth_budgets: list[int] | None = None
    # hidden-state rows the prompt's loops computed on this shard (token x loop; prompt x
    # loops when every loop ran every token, fewer under token-sparse prefill or a prefix
    # hit, more after a preemption recomputed some)
    prefill_rows: int = 0
    # self-speculative decoding (docs/speculative.md): tokens the early loops drafted for
    # this request, and how many of them the deep loops accepted
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0


class ErrorEvent(msgspec.Struct, gc=False, kw_only=True, tag="error", tag_field="type"):
    request_id: str
    code: str
    message: str


StreamEvent = TokenEvent | FinishedEvent | ErrorEvent

TERMINAL_EVENTS = (FinishedEvent, ErrorEvent)
