"""KV admission policies and the record a preemption leaves (pure arithmetic, no state).

Which waiting request may start is a bet on how much KV the running ones will still write:
``reserve`` bets on the worst case (prompt + max_tokens - 1), ``incremental`` bets on nothing
and pays with recompute-preemption when KV runs out, ``watermark`` keeps a fraction of the
worst case free. See ``KVAdmission`` in services/common/config.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import KVAdmission


@dataclass(frozen=True)
class Commitment:
    """Blocks the running requests will still allocate: their prompts' (certain) and their
    decodes' (an upper bound: a request that stops early never writes them)."""

    prompt: int = 0
    decode: int = 0

    def __add__(self, other: Commitment) -> Commitment:
        return Commitment(self.prompt + other.prompt, self.decode + other.decode)

    def __sub__(self, other: Commitment) -> Commitment:
        return Commitment(self.prompt - other.prompt, self.decode - other.decode)


def admits(
    policy: KVAdmission,
    watermark: float,
    *,
    free_blocks: int,
    committed: Commitment,
    candidate: Commitment,
) -> bool:
    """Whether a candidate may start now.

    ``free_blocks``: what allocation can still hand out once the candidate's prefix hit is
    claimed; ``committed``: what the running requests will still allocate; ``candidate``:
    what the candidate will allocate (its prefix hit left out).
    """
    if policy is KVAdmission.INCREMENTAL:
        return True
    if policy is KVAdmission.RESERVE:
        watermark = 1.0
    # at watermark 1 this is the reserve test (every footprint fits); at 0 every prompt must
    # fit, the candidate's included, while decode growth is left to preemption
    certain = committed.prompt + candidate.prompt
    return free_blocks - certain >= watermark * (committed.decode + candidate.decode)


@dataclass(frozen=True)
class Preemption:
    """One recompute-preemption, as traces and tests show it."""

    seq: int  # the batch whose selection needed the KV (the next batch, for a worker loss)
    request_id: str
    # the request whose allocation forced it; "" when the worker's KV was lost
    for_request_id: str
    prompt_tokens: int  # prompt positions whose KV was dropped (a prefix hit may restore some)
    output_tokens: int  # generated positions whose KV was dropped (replayed, exit depths kept)
    blocks: int  # blocks it held
    # the incarnation it restarts as: rows it runs after readmission carry it (a batch that
    # built nothing leaves its preemptions to the next one, which may readmit the request)
    incarnation: int = 0

    def describe(self) -> str:
        cause = f"for {self.for_request_id}" if self.for_request_id else "worker lost"
        return (
            f"preempt {self.request_id} ({cause}): {self.prompt_tokens} prompt + "
            f"{self.output_tokens} generated tokens to recompute, {self.blocks} blocks freed"
        )
