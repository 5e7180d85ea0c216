"""Aborts that arrived before their request (pure: no NATS, the caller passes the clock).

Admission forwards a generate and a later abort in order, but the scheduler reads submits
and aborts on two subscriptions (and with several admission replicas, or a client's retry,
the two may come from different places), so an abort can reach the scheduler first. It is
remembered for ``keep_s`` and honoured when its request arrives: the request ends at once
with ``finish_reason: abort`` instead of running.
"""

from __future__ import annotations

from collections import OrderedDict


class AbortTombstones:
    def __init__(self, keep_s: float = 10.0, max_entries: int = 10_000) -> None:
        self.keep_s = keep_s
        self.max_entries = max_entries
        self._items: OrderedDict[tuple[str, str], float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def add(self, tenant: str, request_id: str, now: float) -> None:
        key = (tenant, request_id)
        self._items.pop(key, None)
        self._items[key] = now
        self.expire(now)

    def take(self, tenant: str, request_id: str, now: float) -> bool:
        """Whether an abort for this request is waiting (it is used up)."""
        self.expire(now)
        return self._items.pop((tenant, request_id), None) is not None

    def expire(self, now: float) -> None:
        while self._items:
            oldest_at = next(iter(self._items.values()))
            if now - oldest_at <= self.keep_s and len(self._items) <= self.max_entries:
                break
            self._items.popitem(last=False)
