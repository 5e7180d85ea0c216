"""Token-sparse prefill's schedule: which loops are sparse, where a position's window lies,
how many tokens each loop keeps in a window (docs/sparse_prefill.md).

Pure arithmetic that the scheduler (readiness, charging, fragments) and the worker (how
many tokens it keeps) both read. Which tokens are kept is the worker's alone: it holds the
hidden states they are scored by.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from messages.errors import RequestError
from messages.prefix import encode_extra_keys, prompt_block_hashes
from messages.sampling import PrefillSetting, SamplingParams, SparsePrefill, check_retention

# FlashLoop's LoopFreeze defaults for Ouro's four loops: two dense loops, then a quarter
# and a tenth of the tokens
FLASHLOOP_RETENTION = (1.0, 1.0, 0.25, 0.1)
DEFAULT_SPARSE_WINDOW = 1024


def default_retention(total_ut_steps: int) -> tuple[float, ...]:
    """FlashLoop's defaults for a four-loop model; for another loop count the same shape:
    two dense loops, a quarter at the third, a tenth from the fourth on."""
    tail = (0.25,) + (0.1,) * max(0, total_ut_steps - 3)
    return ((1.0,) * min(2, total_ut_steps) + tail)[:total_ut_steps]


@dataclass(frozen=True)
class SparseSchedule:
    """One request's sparse prefill: windows of ``window`` tokens, ``retention[l]`` per
    loop. Loops from the first retention below 1 on are sparse (nested), those before are
    dense; a schedule without such a loop is dense throughout."""

    window: int
    retention: tuple[float, ...]
    first_sparse_loop: int

    @classmethod
    def of(cls, window: int, retention: Sequence[float]) -> SparseSchedule:
        if window < 1:
            raise ValueError(f"sparse window must be >= 1, got {window}")
        ratios = tuple(float(r) for r in retention)
        first = next((i for i, r in enumerate(ratios) if r < 1.0), len(ratios))
        return cls(window, ratios, first)

    @classmethod
    def from_wire(cls, sparse: SparsePrefill) -> SparseSchedule:
        return cls.of(sparse.window, sparse.retention)

    def to_wire(self) -> SparsePrefill:
        return SparsePrefill(window=self.window, retention=self.retention)

    @property
    def total_loops(self) -> int:
        return len(self.retention)

    def is_sparse(self, loop: int) -> bool:
        return loop >= self.first_sparse_loop

    def window_bounds(self, position: int, prompt_len: int) -> tuple[int, int]:
        """[start, end) of the window holding ``position``: anchored at absolute prompt
        positions, the last one cut at the prompt's end."""
        start = position - position % self.window
        return start, min(start + self.window, prompt_len)

    def active_counts(self, length: int) -> list[int]:
        """Active tokens per loop of a window of ``length`` tokens: all of them at a dense
        loop; ``min(max(1, ceil(length * r_l)), n_{l-1})`` at a sparse one (the product in
        float64, as FlashLoop computes it)."""
        counts: list[int] = []
        previous = length
        for loop, r in enumerate(self.retention):
            n = (
                length
                if loop < self.first_sparse_loop
                else min(max(1, math.ceil(length * r)), previous)
            )
            counts.append(n)
            previous = n
        return counts

    def active_count(self, loop: int, length: int) -> int:
        return self.active_counts(length)[loop]

    def last_reusable_position(self, prompt_len: int) -> int:
        """Where the prompt's last window starts: KV before it can be reused by another
        prompt (its windows are whole and hold no forced last token), KV from it on cannot."""
        return self.window_bounds(prompt_len - 1, prompt_len)[0] if prompt_len else 0

    def whole_window_blocks(self, blocks: int, block_size: int) -> int:
        """A run of ``blocks`` cached leading blocks, cut to what a request may claim: a hit
        must end where both a block and a window end (a window's active tokens are chosen
        from all of it)."""
        step = math.lcm(self.window, block_size) // block_size
        return blocks - blocks % step

    def cache_key(self) -> bytes:
        """What a prefix block's hash must include: KV made under another window or
        retention is other KV."""
        return encode_extra_keys(
            "sparse-prefill", str(self.window), ",".join(repr(r) for r in self.retention)
        )


def prefix_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    schedule: SparseSchedule | None,
    salt: bytes = b"",
    kv_cache_dtype: str = "auto",
) -> list[int]:
    """The prompt's block hashes as a scheduler publishes and claims them, and as admission
    must ask the prefix index for them. Under token-sparse prefill a block's KV depends on
    the window and retention (they go into its hash) and on whether its window holds the
    prompt's last token (always kept): only blocks before the last window are another
    prompt's. A block stored under a KV codec other than ``auto`` is other bytes: the codec
    goes into its hash, so no block is ever shared across codecs (``auto`` adds nothing,
    keeping the hashes every existing index holds)."""
    if kv_cache_dtype != "auto":
        salt += encode_extra_keys("kv-cache-dtype", kv_cache_dtype)
    if schedule is None:
        return prompt_block_hashes(token_ids, block_size, salt)
    reusable = schedule.last_reusable_position(len(token_ids)) // block_size
    return prompt_block_hashes(
        token_ids, block_size, salt + schedule.cache_key(), max_blocks=reusable
    )


@dataclass(frozen=True)
class SparseDefaults:
    """The server's side of the option (``--token-sparse-prefill``, ``--prefill-retention``,
    ``--sparse-window``): what a request that leaves it unset gets."""

    enabled: bool = False
    retention: tuple[float, ...] | None = None  # None: default_retention(total_ut_steps)
    window: int = DEFAULT_SPARSE_WINDOW

    def offer(self, total_ut_steps: int) -> SparsePrefill:
        """What a request that asks for the option without its own retention runs under
        (a shard announces it: admission keys its prefix lookups the way the shard keys its
        blocks)."""
        retention = self.retention or default_retention(total_ut_steps)
        return SparsePrefill(window=self.window, retention=tuple(retention))

    @classmethod
    def offered(cls, offer: SparsePrefill, enabled: bool) -> SparseDefaults:
        """A shard's defaults from its announcement (``offer``'s inverse)."""
        return cls(enabled=enabled, retention=tuple(offer.retention), window=offer.window)


def resolve_sparse_prefill(
    params: SamplingParams,
    defaults: SparseDefaults,
    total_ut_steps: int,
    *,
    split_prefill: bool,
    carried: PrefillSetting | None = None,
) -> SparseSchedule | None:
    """The schedule a request runs under (None: dense), or RequestError naming why not.
    ``carried``: the setting the shard that first ran it resolved (a resumed request keeps
    it; this shard's defaults do not apply)."""
    if carried is not None:
        return _carried_schedule(carried, total_ut_steps, split_prefill=split_prefill)
    wanted = params.wants_sparse_prefill
    if wanted is None:
        # the server's default does not apply where it cannot: prompt logprobs need every
        # position at full depth
        wanted = defaults.enabled and params.prompt_logprobs is None
    if not wanted:
        return None
    if not split_prefill:
        raise RequestError(
            "token_sparse_prefill needs split or wavefront prefill; this engine runs atomic prefill"
        )
    retention = params.prefill_retention or defaults.retention
    if retention is None:
        retention = default_retention(total_ut_steps)
    check_retention(list(retention), "prefill_retention")
    if len(retention) != total_ut_steps:
        raise RequestError(
            f"prefill_retention has {len(retention)} entries; the model runs {total_ut_steps} "
            "loops (one entry per loop)"
        )
    return SparseSchedule.of(defaults.window, retention)


def prefill_setting(schedule: SparseSchedule | None) -> PrefillSetting:
    """What a request carries to the next shard it runs on."""
    return PrefillSetting(sparse_prefill=None if schedule is None else schedule.to_wire())


def _carried_schedule(
    carried: PrefillSetting, total_ut_steps: int, *, split_prefill: bool
) -> SparseSchedule | None:
    sparse = carried.sparse_prefill
    if sparse is None:
        return None
    if not split_prefill:
        raise RequestError(
            "the request runs token-sparse prefill (the shard that started it resolved so), "
            "which needs split or wavefront prefill; this engine runs atomic prefill"
        )
    if isinstance(sparse.window, bool) or sparse.window < 1:
        raise RequestError(f"sparse prefill window must be >= 1, got {sparse.window!r}")
    check_retention(list(sparse.retention), "prefill_retention")
    if len(sparse.retention) != total_ut_steps:
        raise RequestError(
            f"the request's prefill_retention has {len(sparse.retention)} entries; this "
            f"model runs {total_ut_steps} loops"
        )
    return SparseSchedule.from_wire(sparse)
