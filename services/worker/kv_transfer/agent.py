"""Moving KV blocks between workers with NIXL: the one module that imports it.

A worker's KV is two arenas (K and V), each ``[layers, blocks, block_size, kv_heads,
head_dim]``, and under fp8 two more, their scales ``[layers, blocks, block_size,
kv_heads]``; planes share the block pool, so a block is the same byte range in every layer
of each arena. Codes and scales move together: a decode worker gets what the prefill worker
stored, never decoded values. ``KVTransferAgent`` owns one NIXL agent (UCX backend: host
memory between processes, device memory on a GPU), registers this worker's arenas,
describes them to peers (``KVSourceInfo``) and READs a peer's blocks into its own.
Descriptors are prepared once: one per block of each layer of each arena (``block_table``,
``arena.py``), for our arenas when they are registered and for a peer's when it is first
read from (NIXL's prepared lists); a pull is then a list of indices into both
(``block_indices``, array arithmetic), cut into chunks (``ReadPlan``) that are posted and
polled one by one (NIXL merges consecutive blocks). Every call may block: the worker makes
them on its transfer thread (``pull_queue.py``), never on the event loop. NIXL's own errors
become ``TransferError`` with a cause (``source_lost``, ``timeout``, ``layout_mismatch``,
``error``).
"""

from __future__ import annotations

import contextlib
import importlib
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from messages.kv_transfer import KVLayoutInfo, KVSourceInfo
from services.worker.kv_transfer.arena import (
    KVArena,
    block_indices,
    block_table,
    source_block_bytes,
    split_indices,
)

# causes a pull may fail with (the metric's label values)
SOURCE_LOST = "source_lost"  # the source worker is gone or unreachable
SOURCE_RESET = "source_reset"  # its KV belongs to another epoch now
TIMEOUT = "timeout"
LAYOUT_MISMATCH = "layout_mismatch"
ERROR = "error"
UNAVAILABLE = "unavailable"  # no NIXL on this worker
LOCAL_RESET = "local_reset"  # this worker's KV was rebuilt (a new epoch) before it landed
REGISTRATION_FAILED = "registration_failed"  # the source could not register its KV with NIXL

# a pull moves in chunks of this many bytes at most, so a short pull never waits behind
# all of a long one (RLT_KV_TRANSFER_CHUNK_BYTES)
DEFAULT_CHUNK_BYTES = 8 << 20
# how long an abort NIXL has not confirmed at once is waited for
ABORT_GRACE_S = 2.0


class TransferError(Exception):
    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause


def load_nixl() -> ModuleType:
    """NIXL's Python API: the ``nixl`` meta package if installed, else ``nixl_cu12`` (which
    pip installs alone without pulling a second CUDA build). Raises TransferError."""
    for name in ("nixl._api", "nixl_cu12._api"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise TransferError(UNAVAILABLE, "NIXL is not installed (pip install nixl-cu12)")


def nixl_available() -> bool:
    try:
        load_nixl()
    except TransferError:
        return False
    return True


@dataclass
class ReadPlan:
    """One pull's descriptors cut into chunks of at most ``chunk_bytes``: the unit a pull
    is posted, timed and interleaved with other pulls by (``pull_queue.py``)."""

    agent_name: str  # the source's NIXL agent
    # (local indices, remote indices) into the prepared lists; index i pairs with index i
    chunks: list[tuple[np.ndarray, np.ndarray]]
    chunk_bytes: list[int]  # bytes each chunk moves
    arena: KVArena  # the landing arena: kept alive while the plan runs
    local_list: Any = None  # NIXL's prepared descriptor lists (ours, the source's)
    remote_list: Any = None

    @property
    def num_bytes(self) -> int:
        return sum(self.chunk_bytes)


@dataclass
class PostedChunk:
    """One posted chunk of a pull (NIXL's transfer request)."""

    handle: Any
    done: bool  # the post itself finished it (a shared-memory copy does)
    arena: KVArena | None = None  # where it lands: kept while an abort is unconfirmed


class KVTransferAgent:
    """One NIXL agent per worker process; not thread-safe (one transfer thread uses it).

    A READ is planned (``plan``: checks, descriptors in chunks), each chunk posted
    (``start``) and polled (``finished``) or aborted (``abort``); ``read`` does all of it
    in order for one pull."""

    def __init__(self, name: str) -> None:
        nixl = load_nixl()
        self.name = name
        self._agent = nixl.nixl_agent(name, nixl.nixl_agent_config(backends=["UCX"]))
        self._registered: Any = None
        self._arena: KVArena | None = None
        self._epoch = ""
        self._layout: KVLayoutInfo | None = None
        # remote agents loaded, by name: the metadata they were loaded from
        self._remotes: dict[str, bytes] = {}
        # chunks whose abort NIXL did not confirm, with the arena they land in: that memory
        # must outlive them (a late write must not land in memory a new arena reuses)
        self._unconfirmed: list[tuple[Any, KVArena | None]] = []
        self._local_list: Any = None  # our arenas' prepared descriptors
        # a peer's prepared descriptors, by agent name: (what they were prepared from, list)
        self._remote_lists: dict[str, tuple[tuple[Any, ...], Any]] = {}
        self._registration_error = ""  # why the last registration failed ("" if none)

    @property
    def arena(self) -> KVArena | None:
        return self._arena

    def register(self, arena: KVArena, epoch: str, layout: KVLayoutInfo) -> None:
        """Makes ``arena`` this worker's KV for peers (the previous one is deregistered)."""
        if self._arena is not None and self._arena.k is arena.k:
            self._epoch, self._layout = epoch, layout
            return
        self.deregister()
        try:
            self._registered = self._agent.register_memory(arena.tensors)
            table = block_table(
                arena.addresses, arena.num_blocks, arena.num_layers, arena.arena_block_bytes,
                arena.device_id,
            )  # fmt: skip
            self._local_list = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", table, arena.mem_type)
        except Exception as exc:  # peers are told why (source_info), the worker logs it
            self._registration_error = f"{type(exc).__name__}: {exc}"[:300]
            raise TransferError(REGISTRATION_FAILED, self._registration_error) from exc
        self._registration_error = ""
        self._arena, self._epoch, self._layout = arena, epoch, layout

    def deregister(self) -> None:
        local, self._local_list = self._local_list, None
        if local is not None:
            with contextlib.suppress(Exception):
                self._agent.release_dlist_handle(local)
        if self._registered is not None:
            # nothing left to protect if it fails: the arena is going away
            with contextlib.suppress(Exception):
                self._agent.deregister_memory(self._registered)
        self._registered = self._arena = self._layout = None
        self._epoch = ""

    def source_info(self) -> KVSourceInfo:
        """What a peer needs to read from us (``error`` says why it cannot)."""
        arena, layout = self._arena, self._layout
        if arena is None or layout is None:
            empty = KVLayoutInfo(
                kv_layout="", block_size=0, num_planes=0, num_layers=0,
                num_kv_heads=0, head_dim=0, dtype="",
            )  # fmt: skip
            failed = self._registration_error
            return KVSourceInfo(
                agent_name=self.name, agent_metadata=b"", epoch="", layout=empty,
                arena_addresses=[], num_blocks=0, block_bytes=0,
                error=f"KV registration failed: {failed}" if failed else "no KV registered yet",
                error_cause=REGISTRATION_FAILED if failed else ERROR,
            )  # fmt: skip
        return KVSourceInfo(
            agent_name=self.name,
            agent_metadata=self._agent.get_agent_metadata(),
            epoch=self._epoch,
            layout=layout,
            arena_addresses=arena.addresses,
            num_blocks=arena.num_blocks,
            block_bytes=arena.block_bytes,
            device_id=arena.device_id,
            arena_block_bytes=arena.arena_block_bytes,
        )

    def plan(
        self,
        source: KVSourceInfo,
        remote_blocks: list[int],
        local_blocks: list[int],
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> ReadPlan:
        """The READ of the source's ``remote_blocks`` into our ``local_blocks`` (every layer
        of every arena: K, V and any scales), in chunks. Raises TransferError (a layout
        mismatch, blocks out of range, a source that cannot be reached)."""
        arena, layout = self._arena, self._layout
        if arena is None or layout is None:
            raise TransferError(ERROR, "this worker has no KV registered")
        why = layout.mismatch(source.layout)
        if why is not None:
            raise TransferError(LAYOUT_MISMATCH, f"KV layouts differ ({why})")
        theirs = source_block_bytes(source)
        if theirs != arena.arena_block_bytes:
            raise TransferError(
                LAYOUT_MISMATCH, f"block bytes differ: {arena.arena_block_bytes} vs {theirs}"
            )
        bad = [b for b in remote_blocks if not 0 <= b < source.num_blocks]
        bad += [b for b in local_blocks if not 0 <= b < arena.num_blocks]
        if bad:
            raise TransferError(ERROR, f"block ids out of range: {bad[:4]}")
        if len(remote_blocks) != len(local_blocks):
            raise TransferError(
                ERROR, f"{len(remote_blocks)} remote blocks but {len(local_blocks)} local ones"
            )
        if not remote_blocks:
            return ReadPlan(source.agent_name, [], [], arena)
        self._load_remote(source)
        remote_list = self._remote_list(source, arena)
        sizes_of = arena.arena_block_bytes
        local = block_indices(local_blocks, len(sizes_of), arena.num_layers, arena.num_blocks)
        remote = block_indices(remote_blocks, len(sizes_of), arena.num_layers, source.num_blocks)
        # arena by arena (block_indices is arena-major), each cut by its own block bytes
        lane = arena.num_layers * len(local_blocks)
        chunks, sizes = [], []
        for a, block_bytes in enumerate(sizes_of):
            part = slice(a * lane, (a + 1) * lane)
            for lo, re in split_indices(local[part], remote[part], block_bytes, chunk_bytes):
                chunks.append((lo, re))
                sizes.append(lo.size * block_bytes)
        return ReadPlan(source.agent_name, chunks, sizes, arena, self._local_list, remote_list)

    def _remote_list(self, source: KVSourceInfo, arena: KVArena) -> Any:
        """The source's prepared descriptors (prepared on its first read, again when its
        arenas changed)."""
        key = (
            source.agent_metadata, tuple(source.arena_addresses), source.num_blocks,
            tuple(source_block_bytes(source)), source.device_id, arena.num_layers,
        )  # fmt: skip
        known = self._remote_lists.get(source.agent_name)
        if known is not None and known[0] == key:
            return known[1]
        if known is not None:
            self._release_remote_list(source.agent_name)
        table = block_table(
            source.arena_addresses, source.num_blocks, arena.num_layers,
            source_block_bytes(source), source.device_id,
        )  # fmt: skip
        try:
            prepared = self._agent.prep_xfer_dlist(source.agent_name, table, arena.mem_type)
        except Exception as exc:
            raise _as_transfer_error(exc) from exc
        self._remote_lists[source.agent_name] = (key, prepared)
        return prepared

    def _release_remote_list(self, agent_name: str) -> None:
        known = self._remote_lists.pop(agent_name, None)
        if known is not None:
            with contextlib.suppress(Exception):
                self._agent.release_dlist_handle(known[1])

    def start(self, plan: ReadPlan, index: int) -> PostedChunk:
        """Posts chunk ``index`` of ``plan``. Raises TransferError."""
        local, remote = plan.chunks[index]
        try:
            handle = self._agent.make_prepped_xfer(
                "READ", plan.local_list, local, plan.remote_list, remote
            )
        except Exception as exc:
            raise _as_transfer_error(exc) from exc
        transfer = PostedChunk(handle, done=False, arena=plan.arena)
        try:
            state = self._agent.transfer(handle)
        except Exception as exc:
            self.abort(transfer)
            raise _as_transfer_error(exc) from exc
        if state == "DONE":
            transfer.done = True
            self._release(transfer)
        elif state != "PROC":
            self.abort(transfer)
            raise TransferError(SOURCE_LOST, f"transfer failed ({state})")
        return transfer

    def finished(self, transfer: PostedChunk) -> bool:
        """Whether a posted chunk is done (its handle is released then). Raises
        TransferError if it failed."""
        if transfer.done:
            return True
        try:
            state = self._agent.check_xfer_state(transfer.handle)
        except Exception as exc:
            self.abort(transfer)
            raise _as_transfer_error(exc) from exc
        if state == "PROC":
            return False
        if state != "DONE":
            self.abort(transfer)
            raise TransferError(SOURCE_LOST, f"transfer failed ({state})")
        transfer.done = True
        self._release(transfer)
        return True

    def abort(self, transfer: PostedChunk, grace_s: float = ABORT_GRACE_S) -> bool:
        """Stops a posted chunk: True once NIXL confirms nothing of it lands any more (an
        abort it could not confirm within ``grace_s``: False, the landing blocks may still
        be written; the handle is kept, with its arena, and released again by
        ``retry_aborts`` until NIXL confirms)."""
        if transfer.handle is None:
            return True
        deadline = time.monotonic() + grace_s
        while True:
            if self._try_release(transfer.handle):  # aborts one still in progress
                transfer.handle = None
                return True
            if time.monotonic() > deadline:
                self._unconfirmed.append((transfer.handle, transfer.arena))
                transfer.handle = None
                return False
            with contextlib.suppress(Exception):  # the abort is under way: let it move
                self._agent.check_xfer_state(transfer.handle)
            time.sleep(0.005)

    def retry_aborts(self) -> int:
        """Releases again every chunk whose abort was not confirmed; one NIXL now confirms
        lets go of its arena (no transfer can write it any more). Returns how many remain."""
        self._unconfirmed = [
            (handle, arena) for handle, arena in self._unconfirmed if not self._try_release(handle)
        ]
        return len(self._unconfirmed)

    @property
    def num_unconfirmed(self) -> int:
        return len(self._unconfirmed)

    def _try_release(self, handle: Any) -> bool:
        """NIXL's public release (it aborts a transfer still in progress): True once done,
        False while the abort is under way."""
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:
            return False
        return True

    def read(
        self,
        source: KVSourceInfo,
        remote_blocks: list[int],
        local_blocks: list[int],
        timeout_s: float,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> int:
        """One pull start to end, chunk after chunk: returns the bytes moved. Raises
        TransferError; on a timeout the transfer is aborted before it returns."""
        deadline = time.monotonic() + timeout_s
        plan = self.plan(source, remote_blocks, local_blocks, chunk_bytes)
        for index in range(len(plan.chunks)):
            transfer = self.start(plan, index)
            pause = 0.0002
            while not self.finished(transfer):
                if time.monotonic() > deadline:
                    self.abort(transfer)
                    raise TransferError(TIMEOUT, f"transfer not done after {timeout_s:g} s")
                time.sleep(pause)
                pause = min(pause * 2, 0.005)
        return plan.num_bytes

    def forget(self, agent_name: str) -> None:
        """Drops a peer (it is gone, or its memory changed)."""
        self._release_remote_list(agent_name)
        if self._remotes.pop(agent_name, None) is not None:
            with contextlib.suppress(Exception):
                self._agent.remove_remote_agent(agent_name)

    def _release(self, transfer: PostedChunk) -> None:
        """Frees a finished chunk's handle."""
        handle, transfer.handle = transfer.handle, None
        if handle is not None:
            with contextlib.suppress(Exception):
                handle.release()

    def _load_remote(self, source: KVSourceInfo) -> None:
        known = self._remotes.get(source.agent_name)
        if known == source.agent_metadata:
            return
        if known is not None:
            self.forget(source.agent_name)
        try:
            self._agent.add_remote_agent(source.agent_metadata)
        except Exception as exc:
            raise _as_transfer_error(exc) from exc
        self._remotes[source.agent_name] = source.agent_metadata


def _as_transfer_error(exc: Exception) -> TransferError:
    kind = type(exc).__name__
    cause = SOURCE_LOST if kind in ("nixlRemoteDisconnectError", "nixlNotFoundError") else ERROR
    return TransferError(cause, f"{kind}: {exc}"[:300])
