"""Host-memory KV arenas kept allocated for a while after they leave NIXL.

A peer may still READ a prefill worker's KV after that worker's runner was replaced (a new
epoch resets it): a pull of a handoff made before the reset, started late or under way.
Over TCP or shared memory, UCX serves such a read in this process, by copying from the
arena's address, whether or not the memory is still registered; freed and unmapped, that
copy kills the process (a segfault, seen in the P/D fault soak). So a host arena is kept
for ``hold_s`` after it is retired (what a peer may still read there is stale, and its
release is answered "not held"), at most ``max_arenas`` of them. Device memory is freed at
once: the new runner's KV needs it, and a NIC reading freed device memory does not harm
this process.
"""

from __future__ import annotations

from collections import deque

from services.worker.kv_transfer.agent import KVArena

# a peer's pull may start up to the handoff's hold (30 s) after the handoff and then run
# for its deadline (10 s) and an abort's grace: past this nobody reads an old arena
HOLD_S = 60.0
MAX_ARENAS = 4


class RetiredArenas:
    def __init__(self, hold_s: float = HOLD_S, max_arenas: int = MAX_ARENAS) -> None:
        self.hold_s = hold_s
        self.max_arenas = max_arenas
        self._held: deque[tuple[float, KVArena]] = deque()
        self.num_dropped_early = 0  # pushed out by the bound before their time

    def __len__(self) -> int:
        return len(self._held)

    def keep(self, arena: KVArena, now: float) -> None:
        """``arena`` just left NIXL: a host one stays allocated until ``now + hold_s``."""
        self.expire(now)
        if arena.mem_type != "DRAM" or self.hold_s <= 0:
            return
        self._held.append((now + self.hold_s, arena))
        while len(self._held) > self.max_arenas:
            self._held.popleft()
            self.num_dropped_early += 1

    def expire(self, now: float) -> None:
        """Frees the arenas held long enough."""
        while self._held and self._held[0][0] <= now:
            self._held.popleft()
