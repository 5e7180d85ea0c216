"""Attention backends behind one interface, chosen once at worker start-up.

* ``reference``: the torch ``paged_attention`` (float32 softmax). CPU default, bit-for-bit the
  original behaviour, and the oracle the other backends are tested against.
* ``sdpa``: context gather + ``scaled_dot_product_attention`` (CPU and CUDA, any dtype).
* ``flash``: ``flash_attn_with_kvcache`` on the paged cache (CUDA, fp16/bf16, flash-attn 2.x
  with block_size % 256 == 0; see ``kernels/flash.py``).

Default on CUDA: flash when it can serve the setup, else sdpa. A request for a backend that
cannot run falls back to the device default, and the single start-up log line says why.
Every backend takes per-pass preparation (``prepare(meta)``) so the index tensors are derived
once per core pass, not once per layer; ``forward`` prepares lazily if the caller did not.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from kernels.flash import (
    FlashKVCacheFn,
    FlashPassState,
    build_flash_state,
    flash_paged_attention,
    flash_unsupported_reason,
    load_flash_kvcache_fn,
)
from kernels.paged_attention import AttentionMetadata, paged_attention
from kernels.sdpa_attention import SdpaPassState, build_sdpa_state, sdpa_paged_attention

BACKEND_NAMES = ("reference", "sdpa", "flash")

try:  # structlog is what the services log with; kernels must still import without it
    import structlog

    _log: Any = structlog.get_logger("rlt")
except ImportError:  # pragma: no cover - exercised only on bare GPU images
    _log = None


def _log_selection(backend: AttentionBackend, **fields: Any) -> None:
    if _log is not None:
        _log.info("attention_backend", backend=backend.name, reason=backend.reason, **fields)
    else:
        logging.getLogger("rlt.kernels").info(
            "attention_backend backend=%s reason=%s %s", backend.name, backend.reason, fields
        )


class AttentionBackend(ABC):
    """``forward(q, k_cache_layer, v_cache_layer, meta, scale) -> out`` plus ``prepare(meta)``.

    q: [T, H, hd]; caches: one layer [num_blocks, block_size, kvh, hd] already holding this
    pass's K/V; out: [T, H, hd] in q's dtype.
    """

    name: ClassVar[str]

    def __init__(self, reason: str = "") -> None:
        self.reason = reason
        # Identity-keyed cache of the last pass's derived tensors (one pass = one metadata).
        self._meta: AttentionMetadata | None = None
        self._state: Any = None

    def prepare(self, meta: AttentionMetadata) -> None:
        """Build this pass's derived tensors once; every layer then reuses them."""
        if meta is not self._meta:
            self._state = self._build_state(meta)
            self._meta = meta

    def _pass_state(self, meta: AttentionMetadata) -> Any:
        self.prepare(meta)
        return self._state

    def _build_state(self, meta: AttentionMetadata) -> Any:
        return None

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...

    def __repr__(self) -> str:
        return f"{type(self).__name__}(reason={self.reason!r})"


class ReferenceBackend(AttentionBackend):
    name = "reference"

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        return paged_attention(q, k_cache, v_cache, meta, scale)


class SdpaBackend(AttentionBackend):
    name = "sdpa"

    def _build_state(self, meta: AttentionMetadata) -> SdpaPassState:
        return build_sdpa_state(meta)

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        return sdpa_paged_attention(q, k_cache, v_cache, meta, scale, self._pass_state(meta))


class FlashBackend(AttentionBackend):
    """``kernel`` defaults to flash-attn's ``flash_attn_with_kvcache``; tests inject a stand-in
    with the same semantics to check the padding / block-table math on CPU."""

    name = "flash"

    def __init__(self, reason: str = "", kernel: FlashKVCacheFn | None = None) -> None:
        super().__init__(reason)
        self._kernel = kernel if kernel is not None else load_flash_kvcache_fn()

    def _build_state(self, meta: AttentionMetadata) -> FlashPassState:
        return build_flash_state(meta)

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        return flash_paged_attention(
            q, k_cache, v_cache, meta, scale, self._pass_state(meta), self._kernel
        )


def select_attention_backend(
    device: torch.device | str,
    dtype: torch.dtype,
    block_size: int,
    head_dim: int,
    prefer: str | None = None,
) -> AttentionBackend:
    """Pick the attention backend for a worker, once; logs one line with the choice and why.

    ``prefer``: None/"auto" (device default), "reference", "sdpa" or "flash". An unusable
    "flash" falls back to the device default (sdpa on CUDA, reference elsewhere).
    """
    if prefer not in (None, "auto", *BACKEND_NAMES):
        raise ValueError(
            f"unknown attention backend {prefer!r}; choose one of {', '.join(BACKEND_NAMES)} "
            "or auto"
        )
    dev = torch.device(device)
    on_cuda = dev.type == "cuda"
    backend: AttentionBackend
    if prefer == "reference":
        backend = ReferenceBackend("requested")
    elif prefer == "sdpa":
        backend = SdpaBackend("requested")
    else:
        why_not = flash_unsupported_reason(dev, dtype, block_size, head_dim)
        flash: AttentionBackend | None = None
        if why_not is None:
            try:
                flash = FlashBackend(
                    "requested"
                    if prefer == "flash"
                    else "CUDA default: flash-attn can serve this setup"
                )
            except Exception as exc:  # e.g. a wheel whose kernel symbol fails to load
                why_not = f"flash_attn_with_kvcache failed to load: {exc}"
        if flash is not None:
            backend = flash
        elif prefer == "flash":
            fallback = "sdpa" if on_cuda else "reference"
            backend = (SdpaBackend if on_cuda else ReferenceBackend)(
                f"flash requested but unusable: {why_not}; falling back to {fallback}"
            )
        elif on_cuda:
            backend = SdpaBackend(f"CUDA default without flash: {why_not}")
        else:
            backend = ReferenceBackend(f"default on {dev.type}")
    _log_selection(
        backend,
        requested=prefer or "auto",
        device=str(dev),
        dtype=str(dtype).removeprefix("torch."),
        block_size=block_size,
        head_dim=head_dim,
    )
    return backend
