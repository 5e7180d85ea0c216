"""What a request's prompt and resumed outputs must be before the scheduler queues it: the
scheduler has the last word, whatever was checked before it."""

from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class KnownOutputs:
    """What a request resumed from another shard had generated: token ids, the loops each
    ran, and the depth budget each ran under where overload shedding lowered it below the
    request's ``max_loops`` (None where it did not; empty: none known, so none lowered)."""

    token_ids: list[int]
    exit_loops: list[int]
    depth_budgets: list[int | None] = field(default_factory=list)


def validate_known_outputs(
    known: KnownOutputs, params: SamplingParams, limits: ModelLimits
) -> None:
    """A resumed request's outputs (another shard started it): as many exits (and budgets,
    if any) as tokens, no more than ``max_tokens``, each in the vocabulary and the model's
    loop range, each budget between the request's ``min_loops`` and its ``max_loops``."""
    token_ids, exit_loops, budgets = known.token_ids, known.exit_loops, known.depth_budgets
    if len(token_ids) != len(exit_loops):
        raise RequestError(
            f"resumed outputs: {len(token_ids)} token ids but {len(exit_loops)} exit depths"
        )
    if budgets and len(budgets) != len(token_ids):
        raise RequestError(
            f"resumed outputs: {len(token_ids)} token ids but {len(budgets)} depth budgets"
        )
    max_loops = params.max_loops
    assert max_loops is not None  # resolved
    for budget in budgets:
        if budget is not None and (
            isinstance(budget, bool)
            or not isinstance(budget, int)
            or not params.min_loops <= budget < max_loops
        ):
            raise RequestError(
                f"resumed depth budget {budget!r} is outside [{params.min_loops}, {max_loops})"
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
