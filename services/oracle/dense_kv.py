"""The oracle's KV: plain tensors indexed [plane][layer][position] -> [kv_heads, head_dim],
no paging, and the codec's effect on what a query reads (``services/oracle/kv_codec.py``).
"""

from __future__ import annotations

import torch

from services.oracle.kv_codec import CODECS, fp8_round_trip, int4_delta_group

# channels per int4 value scale (FlashLoop's 64, or the whole head when it is smaller)
VALUE_GROUP = 64
# relative rms of ``jitter_seed``'s noise: a few float32 roundings (the engine's K/V and
# these differ by ~1e-6 relative: other summation orders, the same values)
JITTER = 2e-6


class DenseKV:
    """K/V of every plane, layer and position, as the codec ``codec`` stores them.

    ``auto`` and ``fp8`` keep what a query reads (fp8: the rounded values, since the engine
    codes a token as it writes it). ``int4-delta`` keeps the exact values, each token's
    ``top`` plane and the anchor interval; ``read`` gives both the exact and the read-back
    history, and a query takes the exact one for its own group of ``group_size`` positions
    only.
    """

    def __init__(
        self,
        planes: int,
        layers: int,
        capacity: int,
        kv_heads: int,
        hd: int,
        codec: str = "auto",
        group_size: int = 16,
        anchor_every: int = 0,
        jitter_seed: int | None = None,
    ) -> None:
        """``jitter_seed``: every K/V written is perturbed by relative noise of float32's
        resolution (``JITTER``), from this seed: the same arithmetic under other roundings,
        so that a codec's code that sits one rounding from its boundary may land on either
        side, as it may in the engine, whose K/V differ from these by such roundings."""
        if codec not in CODECS:
            raise ValueError(f"kv_cache_dtype must be one of {CODECS}, got {codec!r}")
        if anchor_every < 0:
            raise ValueError(f"int4 anchor interval must be >= 0, got {anchor_every}")

        def plane() -> list[torch.Tensor]:
            return [torch.zeros(capacity, kv_heads, hd, dtype=torch.float32) for _ in range(layers)]

        self.k = [plane() for _ in range(planes)]
        self.v = [plane() for _ in range(planes)]
        self.codec = codec
        self.group_size = group_size
        self.anchor_every = anchor_every  # int4-delta: 0 is plane 0 as the only anchor
        self.value_group = min(VALUE_GROUP, hd)
        self.top = torch.full((capacity,), planes - 1, dtype=torch.int64)
        self._jitter: torch.Generator | None = None
        if jitter_seed is not None:
            self._jitter = torch.Generator().manual_seed(jitter_seed)
        # read-backs of (plane, layer, group), with the exact inputs they were made from
        self._coded: dict[tuple[int, int, int], tuple[torch.Tensor, ...]] = {}

    @property
    def coded_groups(self) -> bool:
        return self.codec == "int4-delta"

    def write(
        self, plane: int, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        if self._jitter is not None:
            k, v = self._jittered(k), self._jittered(v)
        if self.codec == "fp8":
            k, v = fp8_round_trip(k), fp8_round_trip(v)
        self.k[plane][layer][positions] = k
        self.v[plane][layer][positions] = v

    def _jittered(self, x: torch.Tensor) -> torch.Tensor:
        assert self._jitter is not None
        noise = torch.randn(x.shape, generator=self._jitter, dtype=x.dtype)
        return x * (1.0 + JITTER * noise)

    def copy_up(self, position: int, src: int) -> None:
        """LAST_EXITED: propagate one token's KV at plane ``src`` to all higher planes."""
        for dst in range(src + 1, len(self.k)):
            for layer in range(len(self.k[src])):
                self.k[dst][layer][position] = self.k[src][layer][position]
                self.v[dst][layer][position] = self.v[src][layer][position]
        self.top[position] = min(int(self.top[position]), src)

    def freeze(self, plane: int, positions: torch.Tensor) -> None:
        """Token-sparse prefill: ``positions`` did not run loop ``plane``; their K/V there
        is their K/V of the plane below (copied by the caller), so the plane stores none."""
        self.top[positions] = torch.clamp(self.top[positions], max=plane - 1)

    def read(
        self, plane: int, layer: int, end: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(exact K, exact V, read-back K, read-back V) of positions 0 .. end - 1. Without
        int4-delta the read-back is the stored K/V itself."""
        k, v = self.k[plane][layer][:end], self.v[plane][layer][:end]
        if not self.coded_groups:
            return k, v, k, v
        rk, rv = k.clone(), v.clone()
        size = self.group_size
        for g in range(end // size):  # groups wholly before `end`: the only ones read coded
            span = slice(g * size, (g + 1) * size)
            rk[span], rv[span] = self._group(plane, layer, g, span)
        return k, v, rk, rv

    def _group(self, plane: int, layer: int, g: int, span: slice) -> tuple[torch.Tensor, ...]:
        # planes 0..plane of this group: SHARED has one plane, coded on its own
        ks = [self.k[j][layer][span] for j in range(plane + 1)]
        vs = [self.v[j][layer][span] for j in range(plane + 1)]
        top = self.top[span]
        inputs = (*ks, *vs, top)
        key = (plane, layer, g)
        cached = self._coded.get(key)
        if cached is not None and all(
            torch.equal(a, b) for a, b in zip(cached[:-2], inputs, strict=True)
        ):
            return cached[-2:]
        every = self.anchor_every
        rk = int4_delta_group(ks, top, True, self.value_group, anchor_every=every)[-1]
        rv = int4_delta_group(vs, top, False, self.value_group, anchor_every=every)[-1]
        self._coded[key] = (*(t.clone() for t in inputs), rk, rv)
        return rk, rv
