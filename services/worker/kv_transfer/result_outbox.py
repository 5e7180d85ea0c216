"""Pull results the scheduler has not confirmed yet (pure: no NATS, no clock of its own).

A pull's result is the only word the decode scheduler gets on its landing blocks: lost on
the bus, the blocks would stay out of use until its pull expires (and then until the next
KV reset, since nothing says no write can still land in them). So every result stays here
from its first publication until the scheduler acknowledges its transfer id
(``KVPullResultsAck``) and is published again meanwhile, after 0.25 s, then twice as long
each time up to 4 s. The scheduler treats a result it already has as a no-op, so a copy
whose acknowledgement was lost costs nothing. Bounded: past ``max_entries`` the oldest
result is dropped, and one unconfirmed for ``give_up_s`` (its scheduler is gone: its
successor reset the KV anyway) is given up; both are counted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from messages.kv_transfer import KVPullResult

FIRST_RETRY_S = 0.25
MAX_RETRY_S = 4.0
# past the scheduler's own horizon for a pull (twice its timeout and a grace: 30 s)
GIVE_UP_S = 60.0
MAX_ENTRIES = 4096


@dataclass
class _Unconfirmed:
    epoch: str
    result: KVPullResult
    first_sent: float
    next_send: float
    retry_s: float
    sends: int = 0


class ResultOutbox:
    def __init__(
        self,
        *,
        first_retry_s: float = FIRST_RETRY_S,
        max_retry_s: float = MAX_RETRY_S,
        give_up_s: float = GIVE_UP_S,
        max_entries: int = MAX_ENTRIES,
    ) -> None:
        if not 0 < first_retry_s <= max_retry_s or give_up_s <= 0 or max_entries < 1:
            raise ValueError("ResultOutbox needs 0 < first_retry_s <= max_retry_s, give_up_s > 0")
        self.first_retry_s = first_retry_s
        self.max_retry_s = max_retry_s
        self.give_up_s = give_up_s
        self.max_entries = max_entries
        self._open: OrderedDict[str, _Unconfirmed] = OrderedDict()  # by transfer id
        self.num_resent = 0  # publications after the first
        self.num_confirmed = 0
        self.num_dropped = 0  # pushed out by the bound
        self.num_given_up = 0  # never confirmed within give_up_s

    def __len__(self) -> int:
        return len(self._open)

    def add(self, epoch: str, result: KVPullResult, now: float) -> None:
        """A result to publish now (and again until confirmed)."""
        self._open.pop(result.transfer_id, None)
        self._open[result.transfer_id] = _Unconfirmed(
            epoch, result, first_sent=now, next_send=now, retry_s=self.first_retry_s
        )
        while len(self._open) > self.max_entries:
            self._open.popitem(last=False)
            self.num_dropped += 1

    def due(self, now: float) -> dict[str, list[KVPullResult]]:
        """The results to publish now, by epoch; each is scheduled again after its backoff
        (and those unconfirmed past ``give_up_s`` are dropped)."""
        out: dict[str, list[KVPullResult]] = {}
        for transfer_id in list(self._open):
            entry = self._open[transfer_id]
            if now - entry.first_sent > self.give_up_s:
                del self._open[transfer_id]
                self.num_given_up += 1
                continue
            if entry.next_send > now:
                continue
            if entry.sends:
                self.num_resent += 1
                entry.retry_s = min(2 * entry.retry_s, self.max_retry_s)
            entry.sends += 1
            entry.next_send = now + entry.retry_s
            out.setdefault(entry.epoch, []).append(entry.result)
        return out

    def confirm(self, transfer_ids: Iterable[str]) -> int:
        """The scheduler has these: returns how many were still open."""
        n = 0
        for transfer_id in transfer_ids:
            if self._open.pop(transfer_id, None) is not None:
                n += 1
        self.num_confirmed += n
        return n

    def wait_s(self, now: float) -> float | None:
        """Seconds until the next result is due (None: nothing open)."""
        if not self._open:
            return None
        soonest = min(e.next_send for e in self._open.values())
        return max(0.0, soonest - now)

    def health(self) -> dict[str, int]:
        return {
            "kv_results_unconfirmed": len(self._open),
            "kv_results_resent": self.num_resent,
            "kv_results_confirmed": self.num_confirmed,
            "kv_results_dropped": self.num_dropped,
            "kv_results_given_up": self.num_given_up,
        }
