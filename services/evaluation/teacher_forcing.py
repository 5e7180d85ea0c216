"""Scoring a held-out continuation through the serial oracle, with serving's semantics.

The oracle generates the continuation with a sampler that returns the held-out token and
records the log-probability it gave it, so each token exits where the exit rule says
(later tokens read the last-exited KV an early exit left) and a sparse prefill's KV is what
the continuation reads: the loss is the loss a served request would see.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.oracle import SerialOracle, SparseSetting


@dataclass(frozen=True)
class ScoredContinuation:
    nll: list[float]  # per continuation token
    exit_depths: list[int]  # per continuation token (the first one comes from the prefill)
    first_greedy: int  # the argmax of the first token's logits
    greedy: list[int]  # the argmax at every continuation position


def score_continuation(
    oracle: SerialOracle,
    window: torch.Tensor,
    prompt_len: int,
    *,
    min_loops: int = 1,
    exit_threshold: float = 1.0,
    sparse: SparseSetting | None = None,
    kv_cache_dtype: str = "auto",
    kv_int4_anchor_every: int = 0,
) -> ScoredContinuation:
    tokens = window.tolist()
    prompt, continuation = tokens[:prompt_len], tokens[prompt_len:]
    nll: list[float] = []
    greedy: list[int] = []

    def forced(logits: torch.Tensor, index: int) -> int:
        logp = torch.log_softmax(logits.float(), dim=-1)
        target = continuation[index]
        nll.append(-float(logp[target]))
        greedy.append(int(logits.argmax()))
        return target

    result = oracle.generate(
        prompt,
        max_tokens=len(continuation),
        min_loops=min_loops,
        exit_threshold=exit_threshold,
        ignore_eos=True,
        sampler=forced,
        sparse_prefill=sparse,
        kv_cache_dtype=kv_cache_dtype,
        kv_int4_anchor_every=kv_int4_anchor_every,
    )
    return ScoredContinuation(nll, result.exit_depths, greedy[0], greedy)
