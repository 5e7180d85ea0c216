"""Which producers (shards' schedulers) are still there, from their load reports (pure).

A scheduler reports its load several times a second, naming its prefix producer. A producer
whose reports stop for ``lost_s`` of time the index was connected is gone: the index drops
its blocks, so no router sends requests after a prefix no live shard holds. A producer the
index never heard a report from is left alone (e.g. reports are not reaching this replica
yet). What is left of a dropped producer's epoch on the stream (a backlog the index had not
read) is ignored, so it cannot bring the blocks back; a producer that comes back, restarted
(a new epoch) or only silent for a while (it reports again), publishes again
(``PrefixIndex.drop_producer`` / ``revive``).
"""

from __future__ import annotations


class ProducerLiveness:
    def __init__(self, lost_s: float = 10.0) -> None:
        self.lost_s = lost_s
        self._heard: dict[str, float] = {}

    def heard(self, producer_id: str, now: float) -> None:
        if producer_id:
            self._heard[producer_id] = now

    def watch(self, producer_ids: list[str], now: float) -> None:
        """Producers in the index (from a snapshot or the stream's replay) that never
        reported here: from now on they must, or their blocks leave."""
        for pid in producer_ids:
            self._heard.setdefault(pid, now)

    def gone(self, now: float, connected_since: float) -> list[str]:
        """Producers silent for ``lost_s`` (each returned once, until heard again)."""
        out = [
            pid for pid, at in self._heard.items() if now - max(at, connected_since) > self.lost_s
        ]
        for pid in out:
            del self._heard[pid]
        return out
