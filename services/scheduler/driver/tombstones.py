"""Aborts that arrived before their request (pure: no NATS, the caller passes the clock).

Admission forwards a generate and a later abort in order, but the scheduler reads submits
and aborts on two subscriptions (and with several admission replicas, or a client's retry,
the two may come from different places), so an abort can reach the scheduler first. It is
remembered for ``keep_s`` and honoured when its request arrives: the request ends at once
with ``finish_reason: abort`` instead of running. An abort aimed at one try (admission id
and seq: a copy admission moved away, or a client's abort of the copy it knows) ends only
that try; an abort of seq 0 ends whichever arrives.
"""

from __future__ import annotations

from collections import OrderedDict

from services.scheduler.driver.step_output import StreamKey

# a try of seq 0: an abort that ends whichever try arrives
ANY: StreamKey = ("", 0)


class AbortTombstones:
    def __init__(self, keep_s: float = 10.0, max_entries: int = 10_000) -> None:
        self.keep_s = keep_s
        self.max_entries = max_entries
        # (tenant, request id) -> (when, the try: (admission id, seq), seq 0 for any)
        self._items: OrderedDict[tuple[str, str], tuple[float, StreamKey]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def add(self, tenant: str, request_id: str, now: float, aimed: StreamKey = ANY) -> None:
        key = (tenant, request_id)
        old = self._items.pop(key, None)
        if old is not None and old[1] == ANY:
            aimed = ANY  # an abort of every copy stays one (else the newest try's wins)
        self._items[key] = (now, aimed)
        self.expire(now)

    def take(self, tenant: str, request_id: str, now: float, try_: StreamKey = ANY) -> bool:
        """Whether an abort for this try of the request is waiting (it is used up)."""
        self.expire(now)
        key = (tenant, request_id)
        entry = self._items.get(key)
        if entry is None or entry[1] not in (ANY, try_):
            return False
        del self._items[key]
        return True

    def expire(self, now: float) -> None:
        while self._items:
            oldest_at = next(iter(self._items.values()))[0]
            if now - oldest_at <= self.keep_s and len(self._items) <= self.max_entries:
                break
            self._items.popitem(last=False)
