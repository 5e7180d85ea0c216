"""What a request's prompt and resumed outputs must be before the scheduler queues it: the
scheduler has the last word, whatever was checked before it."""

from __future__ import annotations

from messages.errors import RequestError
from messages.sampling import SamplingParams
from services.common.config import ModelLimits


def validate_prompt(prompt_token_ids: list[int], limits: ModelLimits) -> None:
    if not isinstance(prompt_token_ids, list) or not prompt_token_ids:
        raise RequestError("prompt must contain at least one token")
    vocab = limits.vocab_size
    for tok in prompt_token_ids:
        if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab:
            raise RequestError(f"prompt token id {tok!r} is outside the vocabulary [0, {vocab})")


def validate_known_outputs(
    token_ids: list[int], exit_loops: list[int], params: SamplingParams, limits: ModelLimits
) -> None:
    """A resumed request's outputs (another shard started it): as many exits as tokens,
    no more than ``max_tokens``, each in the vocabulary and the model's loop range."""
    if len(token_ids) != len(exit_loops):
        raise RequestError(
            f"resumed outputs: {len(token_ids)} token ids but {len(exit_loops)} exit depths"
        )
    if token_ids and params.max_tokens is not None and len(token_ids) > params.max_tokens:
        raise RequestError(
            f"resumed outputs: {len(token_ids)} tokens exceed max_tokens {params.max_tokens}"
        )
    vocab, depths = limits.vocab_size, limits.total_ut_steps
    for tok, loops in zip(token_ids, exit_loops, strict=True):
        if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab:
            raise RequestError(f"resumed token id {tok!r} is outside the vocabulary")
        if isinstance(loops, bool) or not isinstance(loops, int) or not 1 <= loops <= depths:
            raise RequestError(f"resumed exit depth {loops!r} is outside [1, {depths}]")
