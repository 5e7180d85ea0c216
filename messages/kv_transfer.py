"""Prefill/decode disaggregation: the messages that move a prompt's KV between shards.

A prefill shard runs a request's prompt and first token, then hands the request over
(``KVHandoff``, relayed to admission with the stream's events); admission resubmits it to a
decode shard with the handoff attached; the decode shard's scheduler asks its worker to
pull the blocks (``KVPull``, in a batch), the worker reads them from the prefill worker with
NIXL and says how it went (``KVPullResult``); the decode scheduler then tells the prefill
scheduler it is done with them (``KVRelease``), and only a release answered "held" proves
the blocks were not reused while they were read. Map encoding; new fields get defaults.
"""

from __future__ import annotations

import msgspec

from messages.sampling import PrefillSetting


class _Comparable(msgspec.Struct, frozen=True, kw_only=True):
    def mismatch(self, other: _Comparable) -> str | None:
        """The first field that differs, as ``name: ours vs theirs``; None if none does."""
        for name in self.__struct_fields__:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"{name}: {mine} vs {theirs}"
        return None


class KVBlockFormat(_Comparable, frozen=True, kw_only=True):
    """What schedulers know of a block and must share to hand a request over: announced by
    every shard, so a mismatch between the roles is refused by name at start."""

    kv_layout: str
    block_size: int
    num_planes: int
    # the KV codec (``--kv-cache-dtype``): a block's bytes mean K/V only under the same one
    kv_cache_dtype: str = "auto"
    # int4-delta's anchor interval: which planes' codes are deltas (0 under other codecs)
    kv_int4_anchor_every: int = 0


class KVLayoutInfo(_Comparable, frozen=True, kw_only=True):
    """What must be equal on both workers for a block to mean the same bytes: a mismatch
    fails the pull by name (``layout_mismatch``)."""

    kv_layout: str
    block_size: int
    num_planes: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    # before ``dtype``: a codec's codes have a dtype of their own, the codec is the cause
    kv_cache_dtype: str = "auto"
    kv_int4_anchor_every: int = 0  # as ``KVBlockFormat``'s
    dtype: str


class KVHandoff(msgspec.Struct, kw_only=True):
    """prefill scheduler -> admission -> decode scheduler: where a request's prompt KV is.

    ``plane_blocks[p][i]`` is the prefill worker's physical block holding logical block i of
    plane p; blocks ``[0, ceil(num_tokens / block_size))`` of every plane are complete."""

    handoff_id: str  # unique per prefill scheduler instance
    request_id: str
    shard_id: str
    scheduler_id: str  # the prefill scheduler instance that holds the blocks
    worker_id: str  # its worker, whose memory holds them
    worker_epoch: str  # the epoch the worker's KV belongs to (a reset makes it void)
    block_format: KVBlockFormat
    num_tokens: int
    plane_blocks: list[list[int]]
    hold_s: float = 30.0  # the prefill side frees them after this without a release
    traceparent: str = ""  # the prefill scheduler's span of the request
    # how the prefill shard prefilled the prompt (None: not said, as by an older scheduler):
    # the decode shard keys, claims and, if the pull fails, recomputes the prompt under it
    prefill_setting: PrefillSetting | None = None


class KVPull(msgspec.Struct, kw_only=True):
    """decode scheduler -> its worker, in a batch: copy these remote blocks into these local
    ones (every plane's list pairs up by index). Started once every earlier batch ran."""

    transfer_id: str
    request_id: str
    worker_id: str  # the source worker
    worker_epoch: str
    remote_blocks: list[int]
    local_blocks: list[int]
    timeout_s: float = 10.0
    traceparent: str = ""


class KVPullResult(msgspec.Struct, kw_only=True):
    """decode worker -> its scheduler: one pull's outcome. ``cause`` names a failure
    (``source_lost``, ``timeout``, ``layout_mismatch``, ``source_reset``, ``local_reset``,
    ``unavailable``, ``error``)."""

    transfer_id: str
    request_id: str
    ok: bool
    cause: str = ""
    message: str = ""
    num_bytes: int = 0
    seconds: float = 0.0  # handed to the transfer thread -> over (what the request waited)
    copy_s: float = 0.0  # its own chunks' transfer time (bytes / copy_s: the link's rate)
    # a failed pull whose abort NIXL did not confirm: its landing blocks may still be
    # written, so they must never be reused (the worker's next KV reset frees them)
    abort_unconfirmed: bool = False


class KVPullResults(msgspec.Struct, kw_only=True):
    """decode worker -> its scheduler, on the epoch's result subject + ``.kv``, with the
    worker's acknowledgement subject as reply subject."""

    epoch: str
    worker_id: str
    results: list[KVPullResult] = msgspec.field(default_factory=list)


class KVPullResultsAck(msgspec.Struct, kw_only=True):
    """decode scheduler -> its worker (to a ``KVPullResults``' reply subject): it has these
    results; the worker publishes a result again until it is acknowledged."""

    transfer_ids: list[str] = msgspec.field(default_factory=list)


class KVSourceInfo(msgspec.Struct, kw_only=True):
    """prefill worker -> a decode worker that asks (``rlt.v1.worker.kvmeta.<worker>``): its
    NIXL agent, the epoch its KV belongs to, the layout, and where each arena starts.
    An arena is ``[layers, blocks, ...]``, layer-major: K and V (``[block_size, kv_heads,
    head_dim]`` of ``block_bytes`` a block), then, under fp8, the K and V scales
    (``[block_size, kv_heads]`` float32); ``arena_block_bytes`` gives each arena's."""

    agent_name: str
    agent_metadata: bytes
    epoch: str
    layout: KVLayoutInfo
    arena_addresses: list[int]  # K then V (codes under a codec), then their scales if any
    num_blocks: int  # per layer, the scratch block included
    block_bytes: int  # of a K (or V) block in one layer
    error: str = ""  # why it cannot serve (no transfer agent, no KV yet)
    # the arenas' device on the source (a GPU worker need not use device 0)
    device_id: int = 0
    # the pull's failure cause when ``error`` is set (``registration_failed``, ``error``)
    error_cause: str = ""
    # bytes of one block of one layer, per arena (empty: ``block_bytes`` for each)
    arena_block_bytes: list[int] = msgspec.field(default_factory=list)


class KVRelease(msgspec.Struct, kw_only=True):
    """decode scheduler -> prefill scheduler (request/reply): done with this handoff."""

    handoff_id: str
    request_id: str = ""


class KVReleaseAck(msgspec.Struct, kw_only=True):
    """Whether the handoff was still held when the release came: only then is what was read
    before it the prompt's KV."""

    handoff_id: str
    held: bool
