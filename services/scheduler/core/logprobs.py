"""Log-probabilities as the stream carries them: the worker's per-row scores turned into
``TokenLogprobs`` (token texts are filled in later, by the output processor)."""

from __future__ import annotations

from messages.api import TokenLogprobs, TopLogprob
from messages.batch import PromptLogprobs, RowResult
from services.scheduler.core.request import Request


def token_logprobs(row: RowResult, token_id: int) -> TokenLogprobs:
    """The sampled token's log-probability and its top alternatives, from ``row``."""
    sampled = row.logprobs
    assert sampled is not None
    return TokenLogprobs(
        token_id=token_id,
        logprob=sampled.logprob,
        top_logprobs=_top(sampled.top_ids, sampled.top_logprobs),
    )


def fill_prompt_logprobs(request: Request, scored: PromptLogprobs) -> None:
    """A final-depth prefill row's prompt log-probabilities, by position (a chunk computed
    again after a preemption overwrites its earlier copy); nothing once they were sent."""
    slots = request.prompt_logprobs
    if slots is None:
        return
    prompt = request.prompt_token_ids
    rows = zip(scored.logprobs, scored.top_ids, scored.top_logprobs, strict=False)
    for position, (logprob, ids, values) in enumerate(rows, start=scored.start):
        if 0 < position < len(slots):
            slots[position] = TokenLogprobs(
                token_id=prompt[position], logprob=logprob, top_logprobs=_top(ids, values)
            )


def prompt_entries(request: Request) -> list[TokenLogprobs]:
    """The prompt's entries as the first token event carries them: the first token with
    no log-probability (nothing predicts it, as in vLLM), and so any position no row
    scored (the simulated device scores none)."""
    slots = request.prompt_logprobs
    assert slots is not None
    return [
        slot or TokenLogprobs(token_id=token, logprob=None)
        for slot, token in zip(slots, request.prompt_token_ids, strict=True)
    ]


def _top(ids: list[int], logprobs: list[float]) -> list[TopLogprob]:
    return [TopLogprob(token_id=t, logprob=lp) for t, lp in zip(ids, logprobs, strict=False)]
