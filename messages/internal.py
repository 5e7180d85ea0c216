"""Messages between services (msgpack on internal subjects). Map encoding; every field added
later gets a default so old and new services keep talking."""

from __future__ import annotations

import msgspec

from messages.api import FinishedEvent
from messages.batch import Batch, BatchResult
from messages.sampling import SamplingParams


class AdmittedRequest(msgspec.Struct, kw_only=True):
    """admission -> scheduler: a validated, tokenized request and where its stream goes."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    reply_subject: str
    trace_id: str = ""
    # backpressure accounting: which admission sent it, and its per-admission sequence
    admission_id: str = ""
    admission_seq: int = 0
    admitted_at: float = 0.0  # unix seconds
    # the tenant whose subject the request came on ("" = the default tenant): its aborts and
    # retries must come from the same tenant
    tenant: str = ""


class AbortForward(msgspec.Struct, kw_only=True):
    """admission -> scheduler: a client abort and where to answer the abort requester."""

    request_id: str
    reply_subject: str = ""
    trace_id: str = ""
    tenant: str = ""  # only a request of this tenant is aborted


class SchedulerLoad(msgspec.Struct, kw_only=True):
    """scheduler -> admission: queue depth for backpressure.

    ``last_admission_seq[a]`` is the highest ``admission_seq`` received from admission ``a``,
    so an admission can add what it sent since to this (slightly old) snapshot.
    """

    scheduler_id: str
    num_waiting: int = 0
    num_waiting_tokens: int = 0
    num_running: int = 0
    last_admission_seq: dict[str, int] = msgspec.field(default_factory=dict)
    time: float = 0.0


class WorkerBatch(msgspec.Struct, kw_only=True):
    """scheduler -> worker. ``epoch`` is new for every scheduler incarnation and after every
    worker loss: the worker resets its mirrored state on a new epoch and runs its batches
    strictly from ``epoch_start_seq`` on (a lost first batch is waited for, never skipped).
    The KV geometry travels along so the worker always matches the scheduler's logical KV."""

    epoch: str
    batch: Batch
    num_blocks: int = 0
    block_size: int = 0
    kv_layout: str = ""
    epoch_start_seq: int = -1  # -1: unknown (an old scheduler); the first batch seen starts
    worker_id: str = ""  # the worker instance it is addressed to ("" = any)


class WorkerResult(msgspec.Struct, kw_only=True):
    """worker -> scheduler."""

    epoch: str
    result: BatchResult
    worker_id: str = ""
    execute_s: float = 0.0
    # from the batch's arrival at the worker to its result being sent (waiting behind the
    # batch before it included): the scheduler's round trip minus this is the bus's cost
    worker_s: float = 0.0
    # not run: the worker is bound to another scheduler that is still connected (a worker
    # takes a new scheduler only once nats-server says the old one is gone)
    refused: str = ""


class WorkerHeartbeat(msgspec.Struct, kw_only=True):
    """worker -> schedulers, every fraction of a second and on request: "I am alive, and this
    is how far I got". ``missing_seq`` is the batch the worker is idle waiting for (-1 when it
    is busy or has nothing to wait for): a scheduler that sent that batch a while ago knows it
    was lost. ``next_seq`` past a batch whose result never came says the result was lost."""

    worker_id: str
    epoch: str = ""
    next_seq: int = 0
    missing_seq: int = -1
    busy_s: float = 0.0  # how long the batch now executing has run (0: idle)
    draining: bool = False
    time: float = 0.0  # unix seconds


class RequestNotice(msgspec.Struct, kw_only=True):
    """scheduler -> admission, on the per-request tracking subject admission gave the
    submit: ``accepted`` (this scheduler owns the stream) and ``done`` (its terminal event
    was published). Lets admission answer ``unavailable`` for requests a lost scheduler held."""

    request_id: str
    scheduler_id: str
    state: str  # "accepted" | "done"
    # with "done" after a finished event: a copy of it, so admission can answer a client that
    # retries the same request_id (it missed the event) without running it again
    finished: FinishedEvent | None = None


class FenceQuery(msgspec.Struct, kw_only=True):
    """scheduler -> admission, after the scheduler was cut off from NATS or stalled: "which
    of my requests did you end meanwhile?" It holds their stream events until it knows."""

    scheduler_id: str


class FenceUpdate(msgspec.Struct, kw_only=True):
    """admission -> scheduler: the requests admission ended with ``unavailable`` because the
    scheduler holding them was gone (nats-server had dropped its connection). The scheduler
    drops them without another word to their clients: each already has its terminal event."""

    admission_id: str
    # (request_id, admission_seq) of each: the seq names the try, so a client's retry of
    # the same request_id (a new seq) is never dropped for its predecessor
    fenced: list[tuple[str, int]] = msgspec.field(default_factory=list)
    scheduler_lost_s: float = 10.0
