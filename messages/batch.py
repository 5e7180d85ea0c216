"""Scheduler <-> worker contract: one batch per step, one result per batch.

The worker mirrors the scheduler's logical state from the deltas a batch carries
(new requests, appended blocks, finished ids), so full block tables never travel twice.
"""

from __future__ import annotations

from enum import StrEnum

import msgspec


class BatchPhase(StrEnum):
    PREFILL = "prefill"  # atomic chunked prefill: prelude + every depth of a chunk in one task
    PREFILLING_PRELUDE = "prefilling_prelude"  # split prefill: prelude only (no KV for Ouro)
    RECURRENT = "recurrent"  # decode rows first, then split-prefill recurrent rows


class WorkerSampling(msgspec.Struct, kw_only=True):
    """What the worker needs to decide exits and sample, sent once per request."""

    temperature: float
    top_p: float
    top_k: int
    seed: int
    min_loops: int
    max_loops: int
    exit_threshold: float


class NewRequest(msgspec.Struct, kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling: WorkerSampling


class BlockDelta(msgspec.Struct, kw_only=True):
    """Blocks appended to a request's tables since the previous batch, one list per plane."""

    request_id: str
    plane_blocks: list[list[int]]


class BatchRow(msgspec.Struct, kw_only=True):
    """One task: tokens [token_start, token_start + token_count) of one request.

    The row runs ``num_loops`` loops starting at loop index ``depth`` (0-based).
    ``embed`` runs the prelude first (atomic prefill, decode at depth 0).
    Decode rows (``input_token_id >= 0``) carry the token they feed and the survival
    probability so far; ``forced_exit`` > 0 replays a recorded exit depth instead of the
    policy (recompute after preemption or a worker restart).
    ``compute_logits`` asks for the coda + a sample on the row's last position.
    ``follows`` (async scheduling) marks a decode row sent before the scheduler knew the
    result of the request's previous row: the worker, which runs batches in order, fills in
    the position, depth, input token and survival from that result, and ignores the other
    fields of the row.
    """

    request_id: str
    token_start: int
    token_count: int
    depth: int
    num_loops: int = 1
    embed: bool = False
    input_token_id: int = -1
    remaining: float = 1.0
    forced_exit: int = 0
    compute_logits: bool = False
    output_index: int = 0
    follows: bool = False


class Batch(msgspec.Struct, kw_only=True):
    seq: int
    phase: BatchPhase
    rows: list[BatchRow]
    new_requests: list[NewRequest] = msgspec.field(default_factory=list)
    block_deltas: list[BlockDelta] = msgspec.field(default_factory=list)
    finished_request_ids: list[str] = msgspec.field(default_factory=list)
    trace_ids: dict[str, str] = msgspec.field(default_factory=dict)


class RowResult(msgspec.Struct, kw_only=True):
    """Outcome of one row: decode rows report survival and exit; coda rows a token."""

    row_index: int
    # a follow-on row the worker could not resolve (its predecessor failed): nothing ran
    skipped: bool = False
    remaining: float = 1.0
    exited: bool = False
    exit_depth: int = 0
    token_id: int = -1


class BatchResult(msgspec.Struct, kw_only=True):
    seq: int
    rows: list[RowResult] = msgspec.field(default_factory=list)
    error: str | None = None
