"""Moving KV blocks between workers with NIXL: the one module that imports it.

A worker's KV is two arenas (K and V), each ``[layers, blocks, block_size, kv_heads,
head_dim]``; planes share the block pool, so a block is the same byte range in every layer
of both arenas. ``KVArena`` turns block lists into NIXL descriptors (a run of consecutive
blocks on both sides is one descriptor per layer and arena); ``KVTransferAgent`` owns one
NIXL agent (UCX backend: host memory between processes, device memory on a GPU), registers
this worker's arenas, describes them to peers (``KVSourceInfo``) and READs a peer's blocks
into its own, a pull cut into chunks (``ReadPlan``) that are posted and polled one by one.
Every call may block: the worker makes them on its transfer thread (``pull_queue.py``),
never on the event loop. NIXL's own errors become ``TransferError`` with a cause
(``source_lost``, ``timeout``, ``layout_mismatch``, ``error``).
"""

from __future__ import annotations

import contextlib
import importlib
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch

from messages.kv_transfer import KVLayoutInfo, KVSourceInfo

# causes a pull may fail with (the metric's label values)
SOURCE_LOST = "source_lost"  # the source worker is gone or unreachable
SOURCE_RESET = "source_reset"  # its KV belongs to another epoch now
TIMEOUT = "timeout"
LAYOUT_MISMATCH = "layout_mismatch"
ERROR = "error"
UNAVAILABLE = "unavailable"  # no NIXL on this worker
LOCAL_RESET = "local_reset"  # this worker's KV was rebuilt (a new epoch) before it landed

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


@dataclass(frozen=True)
class KVArena:
    """One worker's K and V tensors, contiguous, ``[layers, blocks, block_size, heads, dim]``."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def block_bytes(self) -> int:
        return self.k[0, 0].numel() * self.k.element_size()

    @property
    def addresses(self) -> list[int]:
        return [self.k.data_ptr(), self.v.data_ptr()]

    @property
    def mem_type(self) -> str:
        return "DRAM" if self.k.device.type == "cpu" else "VRAM"

    @property
    def device_id(self) -> int:
        return 0 if self.k.device.type == "cpu" else self.k.device.index or 0

    def layout(self, kv_layout: str, num_planes: int) -> KVLayoutInfo:
        _, _, block_size, heads, dim = self.k.shape
        return KVLayoutInfo(
            kv_layout=kv_layout,
            block_size=block_size,
            num_planes=num_planes,
            num_layers=self.num_layers,
            num_kv_heads=heads,
            head_dim=dim,
            dtype=str(self.k.dtype).removeprefix("torch."),
        )


def block_runs(remote: list[int], local: list[int]) -> list[tuple[int, int, int]]:
    """``(remote start, local start, count)`` runs where both lists go up by one together
    (a prompt's blocks are often consecutive on both sides: one descriptor per run)."""
    if len(remote) != len(local):
        raise ValueError(f"{len(remote)} remote blocks but {len(local)} local ones")
    runs: list[tuple[int, int, int]] = []
    for r, m in zip(remote, local, strict=True):
        if runs:
            r0, m0, n = runs[-1]
            if r == r0 + n and m == m0 + n:
                runs[-1] = (r0, m0, n + 1)
                continue
        runs.append((r, m, 1))
    return runs


def descriptors(
    runs: list[tuple[int, int, int]],
    addresses: list[int],
    num_blocks: int,
    num_layers: int,
    block_bytes: int,
    *,
    remote: bool,
    device_id: int = 0,
) -> np.ndarray:
    """An Nx3 ``(address, length, device)`` array over one side's arenas: for each arena, each
    layer, each run. Both sides list them in the same order, so row i pairs with row i."""
    rows = np.empty((len(addresses) * num_layers * len(runs), 3), dtype=np.uint64)
    i = 0
    for base in addresses:
        for layer in range(num_layers):
            layer_base = base + layer * num_blocks * block_bytes
            for r, m, n in runs:
                start = r if remote else m
                rows[i] = (layer_base + start * block_bytes, n * block_bytes, device_id)
                i += 1
    return rows


@dataclass
class ReadPlan:
    """One pull's descriptors cut into chunks of at most ``chunk_bytes``: the unit a pull
    is posted, timed and interleaved with other pulls by (``pull_queue.py``)."""

    agent_name: str  # the source's NIXL agent
    chunks: list[tuple[np.ndarray, np.ndarray]]  # (local rows, remote rows), row i pairs
    chunk_bytes: list[int]  # bytes each chunk moves
    arena: KVArena  # the landing arena: kept alive while the plan runs

    @property
    def num_bytes(self) -> int:
        return sum(self.chunk_bytes)


@dataclass
class Transfer:
    """One posted chunk."""

    handle: Any
    done: bool  # the post itself finished it (a shared-memory copy does)


def split_rows(
    local: np.ndarray, remote: np.ndarray, block_bytes: int, chunk_bytes: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Groups paired descriptor rows into chunks of at most ``chunk_bytes`` (a row longer
    than that is cut at block boundaries; a chunk holds at least one block)."""
    cap = max(block_bytes, chunk_bytes // block_bytes * block_bytes)
    chunks: list[tuple[list[list[int]], list[list[int]]]] = []
    size = cap  # the current chunk is full: the first piece starts one
    for (l_addr, length, l_dev), (r_addr, _, r_dev) in zip(
        local.tolist(), remote.tolist(), strict=True
    ):
        offset = 0
        while offset < length:
            piece = min(cap, length - offset)
            if size + piece > cap:
                chunks.append(([], []))
                size = 0
            chunks[-1][0].append([l_addr + offset, piece, l_dev])
            chunks[-1][1].append([r_addr + offset, piece, r_dev])
            size += piece
            offset += piece
    return [(np.array(lo, dtype=np.uint64), np.array(re, dtype=np.uint64)) for lo, re in chunks]


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

    @property
    def arena(self) -> KVArena | None:
        return self._arena

    def register(self, arena: KVArena, epoch: str, layout: KVLayoutInfo) -> None:
        """Makes ``arena`` this worker's KV for peers (the previous one is deregistered)."""
        if self._arena is not None and self._arena.k is arena.k:
            self._epoch, self._layout = epoch, layout
            return
        self.deregister()
        self._registered = self._agent.register_memory([arena.k, arena.v])
        self._arena, self._epoch, self._layout = arena, epoch, layout

    def deregister(self) -> None:
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
            return KVSourceInfo(
                agent_name=self.name, agent_metadata=b"", epoch="", layout=empty,
                arena_addresses=[], num_blocks=0, block_bytes=0, error="no KV registered yet",
            )  # fmt: skip
        return KVSourceInfo(
            agent_name=self.name,
            agent_metadata=self._agent.get_agent_metadata(),
            epoch=self._epoch,
            layout=layout,
            arena_addresses=arena.addresses,
            num_blocks=arena.num_blocks,
            block_bytes=arena.block_bytes,
        )

    def plan(
        self,
        source: KVSourceInfo,
        remote_blocks: list[int],
        local_blocks: list[int],
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> ReadPlan:
        """The READ of the source's ``remote_blocks`` into our ``local_blocks`` (every layer,
        K and V), in chunks. Raises TransferError (a layout mismatch, blocks out of range,
        a source that cannot be reached)."""
        arena, layout = self._arena, self._layout
        if arena is None or layout is None:
            raise TransferError(ERROR, "this worker has no KV registered")
        why = layout.mismatch(source.layout)
        if why is not None:
            raise TransferError(LAYOUT_MISMATCH, f"KV layouts differ ({why})")
        if source.block_bytes != arena.block_bytes:
            raise TransferError(
                LAYOUT_MISMATCH, f"block bytes differ: {arena.block_bytes} vs {source.block_bytes}"
            )
        bad = [b for b in remote_blocks if not 0 <= b < source.num_blocks]
        bad += [b for b in local_blocks if not 0 <= b < arena.num_blocks]
        if bad:
            raise TransferError(ERROR, f"block ids out of range: {bad[:4]}")
        runs = block_runs(remote_blocks, local_blocks)
        if not runs:
            return ReadPlan(source.agent_name, [], [], arena)
        self._load_remote(source)
        layers, block_bytes = arena.num_layers, arena.block_bytes
        local = descriptors(
            runs, arena.addresses, arena.num_blocks, layers, block_bytes,
            remote=False, device_id=arena.device_id,
        )  # fmt: skip
        remote = descriptors(
            runs, source.arena_addresses, source.num_blocks, layers, block_bytes, remote=True
        )
        chunks = split_rows(local, remote, block_bytes, chunk_bytes)
        sizes = [int(lo[:, 1].sum()) for lo, _ in chunks]
        return ReadPlan(source.agent_name, chunks, sizes, arena)

    def start(self, plan: ReadPlan, index: int) -> Transfer:
        """Posts chunk ``index`` of ``plan``. Raises TransferError."""
        local, remote = plan.chunks[index]
        mem = plan.arena.mem_type
        try:
            handle = self._agent.initialize_xfer(
                "READ",
                self._agent.get_xfer_descs(local, mem),
                self._agent.get_xfer_descs(remote, mem),
                plan.agent_name,
            )
        except Exception as exc:
            raise _as_transfer_error(exc) from exc
        transfer = Transfer(handle, done=False)
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

    def finished(self, transfer: Transfer) -> bool:
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

    def abort(self, transfer: Transfer, grace_s: float = ABORT_GRACE_S) -> bool:
        """Stops a posted chunk: True once NIXL confirms nothing of it lands any more (an
        abort it could not confirm within ``grace_s``: False, the landing blocks may still
        be written)."""
        if transfer.handle is None:
            return True
        deadline = time.monotonic() + grace_s
        while True:
            try:
                transfer.handle.release()  # aborts one still in progress
                transfer.handle = None
                return True
            except Exception:  # the abort is under way: wait for it, then release again
                if time.monotonic() > deadline:
                    # kept from the GC (whose release would fail the same way)
                    self._agent._leaked_xfer_handles.append(transfer.handle._handle)
                    transfer.handle = None
                    return False
                with contextlib.suppress(Exception):
                    self._agent.check_xfer_state(transfer.handle)
                time.sleep(0.005)

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
        if self._remotes.pop(agent_name, None) is not None:
            with contextlib.suppress(Exception):
                self._agent.remove_remote_agent(agent_name)

    def _release(self, transfer: Transfer) -> None:
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
