"""Messages between services (msgpack on internal subjects). Map encoding; every field added
later gets a default so old and new services keep talking."""

from __future__ import annotations

import msgspec

from messages.api import FinishedEvent, StreamEvent
from messages.batch import Batch, BatchResult
from messages.kv_transfer import KVBlockFormat, KVHandoff
from messages.sampling import PrefillSetting, SamplingParams, SparsePrefill


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
    # the shard admission routed it to ("" = whichever scheduler receives it)
    shard_id: str = ""
    # where the scheduler sends the stream's events (admission relays them to the client, so
    # it knows what the client was sent); a submit without one is dropped
    relay_subject: str | None = None
    # a request resumed after its shard was lost: the outputs the client already has. The
    # scheduler replays them as forced exits (like a preemption recompute) without streaming
    # them again, and streams from index len(resume_token_ids)
    resume_token_ids: list[int] = msgspec.field(default_factory=list)
    resume_exit_depths: list[int] = msgspec.field(default_factory=list)
    # and the depth budget of each that overload shedding lowered (None: not lowered;
    # empty: none was)
    resume_depth_budgets: list[int | None] = msgspec.field(default_factory=list)
    # disaggregation: a prefill shard stops it after its first token and hands it over
    # (``KVHandoff`` in its relayed events); a decode shard gets the handoff here and pulls
    # the prompt's KV from the prefill worker instead of computing it
    hand_off: bool = False
    kv_source: KVHandoff | None = None
    # how the shard that first ran it prefilled its prompt (None: this shard's defaults
    # decide): a moved request runs under the same setting
    prefill_setting: PrefillSetting | None = None


class AbortForward(msgspec.Struct, kw_only=True):
    """admission -> scheduler: a client abort and where to answer the abort requester."""

    request_id: str
    reply_subject: str = ""
    trace_id: str = ""
    tenant: str = ""  # only a request of this tenant is aborted
    # > 0: only the stream admitted under this admission seq (a moved request's old copy,
    # or the copy the aborting admission knows), seqs being counted per admission
    admission_seq: int = 0
    admission_id: str = ""
    # sent to every shard (admission did not know where it runs): unknown ids are not an error
    broadcast: bool = False


class AbortAck(msgspec.Struct, kw_only=True):
    """scheduler -> admission, the answer to a broadcast abort (its reply subject): whether
    this shard held the request. When none did, admission tells the requester ``not_found``."""

    request_id: str
    shard_id: str = ""
    held: bool = False


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
    # the shard this scheduler drives, and the router's inputs
    shard_id: str = ""
    producer_id: str = ""  # its prefix-event producer name (the index's key for its blocks)
    report_seq: int = 0  # per scheduler instance, increasing: an older report is stale
    num_blocks: int = 0
    num_free_blocks: int = 0
    num_active_blocks: int = 0  # KV blocks (one plane) the running requests hold
    # the waiting prompts' tokens its own prefix cache does not hold: prefill still to do
    num_waiting_prefill_tokens: int = 0
    step_time_s: float = 0.0  # recent mean time from a batch's submission to its result
    has_worker: bool = True  # False: its worker is gone; its requests wait (or move)
    draining: bool = False
    simulated: bool = False  # its worker is a ``--device sim`` worker


class ShardAnnounce(msgspec.Struct, kw_only=True):
    """scheduler -> routers, on start and when asked (``rlt.v1.shard.discover``): "shard
    ``shard_id`` is served by this scheduler instance, with this KV geometry". A router
    routes only to announced shards whose block size matches its own prefix hashing."""

    shard_id: str
    scheduler_id: str
    producer_id: str = ""
    block_size: int = 0
    num_blocks: int = 0
    enable_prefix_caching: bool = False
    time: float = 0.0
    # disaggregation: "prefill", "decode" or "both" (colocated), and what its blocks are
    # (prefill and decode shards must agree, or the shard is refused by name)
    role: str = "both"
    block_format: KVBlockFormat | None = None
    # token-sparse prefill: what a request asking for it without a retention runs under here
    # (window, this model's retention; None: this shard cannot run it, or did not say), and
    # whether a request that does not choose gets it. A sparse request's block hashes
    # include its setting: admission keys its prefix lookups the way this shard keys blocks
    sparse_prefill: SparsePrefill | None = None
    sparse_prefill_default: bool = False
    # its KV codec (--kv-cache-dtype): a block's hash includes it (other than "auto"), so
    # admission keys its prefix lookups for this shard with it
    kv_cache_dtype: str = "auto"


class RelayedEvent(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One stream event for admission to pass on, tagged with the request's admission seq
    (a request moved to another shard gets a new seq: events of its old copy are ignored).
    Without an event it is a resync: the outputs the stream has produced so far (after a
    client's retry re-attached the stream to another admission)."""

    seq: int
    event: StreamEvent | None = None
    known_token_ids: list[int] = msgspec.field(default_factory=list)
    known_exit_depths: list[int] = msgspec.field(default_factory=list)
    known_depth_budgets: list[int | None] = msgspec.field(default_factory=list)
    # the request left this shard after its first token: where its prompt KV waits (the
    # stream's last event from here; admission moves the request to a decode shard)
    handoff: KVHandoff | None = None


class RelayBatch(msgspec.Struct, kw_only=True):
    """scheduler -> admission: one step's events of the streams that admission relays."""

    shard_id: str
    scheduler_id: str
    events: list[RelayedEvent] = msgspec.field(default_factory=list)


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
    epoch_start_seq: int | None = None  # None: unknown; the first batch seen starts
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
    simulated: bool = False  # computed by the cost model of a ``--device sim`` worker


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
    shard_id: str = ""  # the shard whose scheduler may bind it
    simulated: bool = False  # a ``--device sim`` worker (no model: benchmarks only)


class RequestNotice(msgspec.Struct, kw_only=True):
    """scheduler -> admission, on the per-request tracking subject admission gave the
    submit: ``accepted`` (this scheduler owns the stream) and ``done`` (a client's retry
    through another try took the stream over: this entry closes without a word). Lets
    admission answer ``unavailable`` for requests a lost scheduler held."""

    request_id: str
    scheduler_id: str
    state: str  # "accepted" | "done"
    # a copy of a finished event for admission's retry record; schedulers now relay every
    # terminal event (admission keeps its record from that), so they leave it out
    finished: FinishedEvent | None = None
    # "accepted": how this shard prefills the prompt (admission keeps it, so a move to
    # another shard prefills it the same way); None: not said
    prefill_setting: PrefillSetting | None = None


class FenceQuery(msgspec.Struct, kw_only=True):
    """scheduler -> admission, after the scheduler was cut off from NATS or stalled: "which
    of my requests did you end meanwhile?" It holds their stream events until it knows."""

    scheduler_id: str
    # the admission seqs of the tries it holds for that admission (live, or with events
    # waiting): only those can be fenced there, so the answer names no others (its size is
    # bounded by the scheduler's own streams). Empty: every try fenced for this scheduler.
    seqs: list[int] = msgspec.field(default_factory=list)


class FenceUpdate(msgspec.Struct, kw_only=True):
    """admission -> scheduler: the requests admission ended with ``unavailable`` because the
    scheduler holding them was gone (nats-server had dropped its connection). The scheduler
    drops them without another word to their clients: each already has its terminal event."""

    admission_id: str
    # (request_id, admission_seq) of each: the seq names the try, so a client's retry of
    # the same request_id (a new seq) is never dropped for its predecessor
    fenced: list[tuple[str, int]] = msgspec.field(default_factory=list)
    scheduler_lost_s: float = 10.0
