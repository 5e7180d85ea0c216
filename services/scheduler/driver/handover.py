"""The scheduler service's part in prefill/decode disaggregation (pure: no NATS).

Prefill role: after each step, every request that asked to be handed off and has its
first token leaves (``Handoffs``): its stream here ends with a ``KVHandoff`` relayed to
admission (which resubmits it to a decode shard) instead of a terminal event, its blocks
stay held until the decode side releases them or ``hold_s`` passes.

Decode role: the worker's pull results come back on their own subject; a failed pull
prefills the request at once, a pull that read everything waits for the prefill side to
confirm (the release's answer) that the blocks were still held while they were read. The
shell sends the releases (request/reply) and feeds the answers back (``confirmed``).
"""

from __future__ import annotations

from typing import Any

from messages.internal import RelayedEvent
from messages.kv_transfer import KVHandoff, KVPullResult
from services.runtime.logging import request_fields
from services.scheduler.driver.step_output import Relay


class Handover:
    def __init__(self, driver: Any) -> None:
        """``driver``: the ``SchedulerDriver`` this is part of (its scheduler, streams,
        telemetry, worker binding and output)."""
        self._driver = driver
        self.num_handed_off = 0
        self.num_pulled = 0
        self.num_pull_failures = 0
        self.num_expired = 0

    def hand_off_due(self, now: float) -> None:
        """Detaches every request ready to leave and relays its handoff."""
        d = self._driver
        scheduler = d.scheduler
        due = list(scheduler.handoffs.due())
        if not due or d.worker_id is None:
            return
        for request in due:
            rid = request.request_id
            handoff = scheduler.handoffs.hand_off(
                request,
                shard_id=d.shard_id,
                worker_id=d.worker_id,
                worker_epoch=d.epoch,
                block_format=scheduler.block_format,
                now=now,
            )
            d.core.outputs.forget(rid)
            stream = d.streams.end(rid, handed_off=True)
            handoff.traceparent = d.telemetry.handed_off(rid)
            if stream is None:  # nobody to hand it to (fenced meanwhile): let it go
                scheduler.handoffs.release(handoff.handoff_id)
                continue
            item = RelayedEvent(seq=stream.admission_seq, handoff=handoff)
            d._out.relays.append(Relay(stream.relay, stream.admission_id, item))
            self.num_handed_off += 1
            d.log.info(
                "request handed off",
                handoff=handoff.handoff_id,
                blocks=sum(len(t) for t in handoff.plane_blocks),
                **request_fields(rid, stream.trace_id),
            )

    def release(self, handoff_id: str) -> bool:
        """The decode side is done with a handoff: True if it was still held."""
        return self._driver.scheduler.handoffs.release(handoff_id)

    def expire(self, now: float) -> None:
        """Handoffs nobody released in time (prefill role) and pulls whose result never
        came (decode role)."""
        scheduler, log = self._driver.scheduler, self._driver.log
        for rid in scheduler.handoffs.expire(now):
            self.num_expired += 1
            log.warning("handoff expired; its KV is freed", request_id=rid)
        for rid in scheduler.pulls.expire(now):
            self.num_pull_failures += 1
            log.warning(
                "KV pull result never came; prefilling here, its landing blocks kept out of use",
                request_id=rid,
            )

    def pulled(self, result: KVPullResult) -> KVHandoff | None:
        """A pull's outcome from the worker; returns the handoff to release (None: the
        pull is not ours any more)."""
        handoff = self._driver.scheduler.pulls.pulled(result)
        if handoff is not None and not result.ok:
            self.num_pull_failures += 1
            self._driver.log.warning(
                "KV pull failed; prefilling here",
                cause=result.cause,
                error=result.message[:200],
                request_id=result.request_id,
            )
        return handoff

    def confirmed(self, transfer_id: str, request_id: str, held: bool) -> None:
        if self._driver.scheduler.pulls.confirmed(transfer_id, held):
            self.num_pulled += 1
        elif not held:
            self.num_pull_failures += 1
            self._driver.log.warning(
                "KV pulled but its handoff was no longer held; prefilling here",
                request_id=request_id,
            )

    def health(self) -> dict[str, Any]:
        s = self._driver.scheduler
        return {
            "handed_off": self.num_handed_off,
            "handoffs_held": len(s.handoffs),
            "handoffs_expired": self.num_expired,
            "kv_pulls_open": len(s.pulls),
            "kv_pulled": self.num_pulled,
            "kv_pull_failures": self.num_pull_failures,
            "kv_blocks_quarantined": s.pulls.num_quarantined_blocks,
        }
