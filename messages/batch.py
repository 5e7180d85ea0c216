"""Scheduler <-> worker contract: one batch per step, one result per batch.

The worker mirrors the scheduler's logical state from the deltas a batch carries
(new requests, appended blocks, finished ids), so full block tables never travel twice.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

import msgspec

from messages.kv_transfer import KVPull
from messages.sampling import SparsePrefill, StructuredOutput


class BatchKind(StrEnum):
    """What one batch serves; every batch is one kind, and a row's own part in it is its
    ``RowKind``. A request's place in its life is another enum, the scheduler's
    ``RequestState`` (services/scheduler/core/request.py), which never travels."""

    PREFILL = "prefill"  # atomic chunked prefill: PREFILL rows (prelude + every depth of a chunk)
    PREFILLING_PRELUDE = "prefilling_prelude"  # split prefill: PRELUDE rows only (no KV for Ouro)
    # decode (DECODE and FOLLOW_ON rows) first, then split prefill's per-depth PREFILL rows
    RECURRENT = "recurrent"


class RowKind(StrEnum):
    """What one row of a batch does (a batch of one ``BatchKind`` mixes kinds of rows)."""

    PRELUDE = "prelude"  # split prefill: the embedding of a prompt span (no core loop)
    PREFILL = "prefill"  # prompt positions through loops (a split depth task or an atomic chunk)
    DECODE = "decode"  # one loop of the token being generated
    # a decode row sent before the result of the request's previous row was known (async):
    # the worker, which runs batches in order, resolves its position, depth and input token
    FOLLOW_ON = "follow_on"
    # the next pass of the request's self-speculative cycle (docs/speculative.md): the worker
    # resolves it into draft or verify rows; with ``embed`` it carries the position, input
    # token and output index a new cycle starts from (the scheduler knew them)
    SPECULATIVE = "speculative"


class WorkerSampling(msgspec.Struct, gc=False, kw_only=True):
    """What the worker needs to decide exits and sample, sent once per request."""

    temperature: float
    top_p: float
    top_k: int
    seed: int
    min_loops: int
    max_loops: int
    exit_threshold: float
    # return each sampled token's log-probability and this many alternatives (None: don't);
    # a negative count does not decode (it once meant "none")
    logprobs: Annotated[int, msgspec.Meta(ge=0)] | None = None
    # the same for the prompt's tokens (from its final-depth prefill rows)
    prompt_logprobs: Annotated[int, msgspec.Meta(ge=0)] | None = None
    # the format every sampled token must keep the output in (the worker masks the logits)
    structured_output: StructuredOutput | None = None
    # the request's max_tokens (0: not sent): a speculative cycle never drafts past it
    max_tokens: int = 0


class SparseFragment(msgspec.Struct, frozen=True, gc=False, array_like=True):
    """Part of one window's sparse loop: the window's active tokens of rank
    ``[active_start, active_end)`` (rank = order by prompt position) out of the
    ``window_active`` that loop keeps. The fragment that starts at rank 0 chooses the
    window's active tokens for the loop; the one that ends at ``window_active`` completes
    the loop over the whole window."""

    active_start: int
    active_end: int
    window_active: int

    @property
    def num_active(self) -> int:
        return self.active_end - self.active_start


class NewRequest(msgspec.Struct, gc=False, kw_only=True):
    """A request the worker learns of: on admission, and again after a preemption, a worker
    loss or a move to another shard, when its known tokens are replayed by decode rows."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: WorkerSampling
    # with a structured output: the tokens it has generated so far, from which the worker
    # rebuilds the grammar's state (empty otherwise, and for a request that starts now)
    generated_token_ids: list[int] = msgspec.field(default_factory=list)
    # token-sparse prefill (None: every loop runs every prompt token)
    sparse_prefill: SparsePrefill | None = None


class BlockDelta(msgspec.Struct, gc=False, kw_only=True):
    """Blocks appended to a request's tables since the previous batch, one list per plane."""

    request_id: str
    plane_blocks: list[list[int]]


class BatchRow(msgspec.Struct, gc=False, kw_only=True):
    """One task: tokens [token_start, token_start + token_count) of one request.

    The row runs ``num_loops`` loops starting at loop index ``depth`` (0-based).
    ``embed`` runs the prelude first (atomic prefill, decode at depth 0).
    DECODE rows carry the token they feed (``input_token_id``) and the survival probability
    so far; ``forced_exit_loops`` > 0 replays a recorded exit (the token exits after that
    many loops) instead of the policy (recompute after preemption or a worker restart).
    ``compute_logits`` asks for the coda + a sample on the row's last position.
    A FOLLOW_ON row carries only its request: the worker fills in the rest from the result
    of the request's previous row.
    ``max_loops`` (decode and follow-on rows) is the depth budget of the row's token when
    overload shedding lowered it below the request's own ``max_loops`` (None: not shed). A
    token's budget is fixed by its first loop: the worker takes a follow-on's only when it
    resolves to depth 0, and carries it on to the token's later loops.
    A PREFILL row with a ``fragment`` runs one sparse loop of the window
    ``[token_start, token_start + token_count)``: only the fragment's active tokens are
    computed (``num_rows`` of them).
    """

    request_id: str
    kind: RowKind
    token_start: int
    token_count: int
    depth: int = 0
    num_loops: int = 1
    embed: bool = False
    input_token_id: int = 0
    remaining: float = 1.0
    forced_exit_loops: int = 0
    compute_logits: bool = False
    output_index: int = 0
    max_loops: int | None = None
    fragment: SparseFragment | None = None
    # SPECULATIVE: the draft tokens (K) and draft loops (d) of a cycle this row starts
    speculative_tokens: int = 0
    draft_loops: int = 0

    @property
    def num_rows(self) -> int:
        """Hidden-state rows the row computes per loop."""
        return self.token_count if self.fragment is None else self.fragment.num_active


class Batch(msgspec.Struct, gc=False, kw_only=True):
    seq: int
    kind: BatchKind
    rows: list[BatchRow]
    new_requests: list[NewRequest] = msgspec.field(default_factory=list)
    block_deltas: list[BlockDelta] = msgspec.field(default_factory=list)
    finished_request_ids: list[str] = msgspec.field(default_factory=list)
    trace_ids: dict[str, str] = msgspec.field(default_factory=dict)
    # W3C traceparent of the scheduler's span of each request loaded here, when spans are
    # exported: the worker's span of the request is its child (services/runtime/tracing.py)
    traceparents: dict[str, str] = msgspec.field(default_factory=dict)
    # prompt KV to pull from a prefill worker (disaggregation), started once every earlier
    # batch has run; a batch may carry only these (no rows)
    kv_pulls: list[KVPull] = msgspec.field(default_factory=list)


class SampledLogprobs(msgspec.Struct, array_like=True, gc=False):
    """A sampled token's log-probability under the model's distribution (the logits before
    temperature and top-k/top-p), and the most likely tokens' ids and log-probabilities."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


class PromptLogprobs(msgspec.Struct, array_like=True, gc=False):
    """Log-probabilities of prompt tokens ``start``, ``start + 1``, ... under the model's
    prediction from the tokens before each (a prefill row's final depth)."""

    start: int
    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


class RowResult(msgspec.Struct, gc=False, kw_only=True, omit_defaults=True):
    """Outcome of one row: decode rows report survival and exit; coda rows a token. Fields
    at their defaults are not sent (most of a row's are, most steps)."""

    row_index: int
    # a follow-on row the worker could not resolve (its predecessor failed): nothing ran
    skipped: bool = False
    remaining: float = 1.0
    exited: bool = False
    exit_loops: int = 0  # the token exited after this many loops (1..total_ut_steps)
    token_id: int = -1
    logprobs: SampledLogprobs | None = None  # asked for by the request (WorkerSampling)
    prompt_logprobs: PromptLogprobs | None = None  # a final-depth prefill row's, if asked
    # this row alone failed (e.g. its sampling overflowed): its request ends with an error,
    # the other rows of the batch are applied as usual
    error: str | None = None
    # SPECULATIVE: the tokens this pass committed, in order, their exit loop counts and
    # (when the request asks for them) their log-probabilities
    token_ids: list[int] = msgspec.field(default_factory=list)
    token_exit_loops: list[int] = msgspec.field(default_factory=list)
    token_logprobs: list[SampledLogprobs] = msgspec.field(default_factory=list)
    # a cycle is still open after this pass; a cycle that ended here: its draft tokens and
    # how many of them were accepted
    cycle_open: bool = False
    drafted: int = 0
    accepted: int = 0


class BatchResult(msgspec.Struct, gc=False, kw_only=True):
    seq: int
    rows: list[RowResult] = msgspec.field(default_factory=list)
    error: str | None = None
