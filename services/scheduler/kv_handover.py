"""The scheduler service's prefill/decode handlers on the bus (docs/sharding.md, "Prefill
and decode shards"): the decode side's pull results and the releases it sends, the prefill
side's answers to them. What they change is the driver's (``driver/handover.py``).

``KVHandover`` is mixed into ``SchedulerService`` and uses its ``driver``, ``nc``, ``log``,
``spawn``, ``_wake``, ``_publish`` and ``_maybe_publish_load``.
"""

from __future__ import annotations

import msgspec
from nats.aio.msg import Msg

from messages.kv_transfer import (
    KVHandoff,
    KVPullResult,
    KVPullResults,
    KVPullResultsAck,
    KVRelease,
    KVReleaseAck,
)
from services.runtime import subjects
from services.runtime.bus import decode_msgpack, encode_msgpack

# a prefill scheduler that does not answer a release in this long cannot vouch for its KV
_RELEASE_TIMEOUT_S = 2.0


class KVHandover:
    async def _on_kv_results(self, msg: Msg) -> None:
        """Our worker's KV pulls: a failed one prefills here now; one that read everything
        is confirmed with the prefill scheduler that held the blocks (off this handler).
        Every result is acknowledged to the worker, which publishes it until then."""
        assert self.driver is not None
        try:
            batch = decode_msgpack(msg.data, KVPullResults)
        except msgspec.DecodeError as exc:
            self.log.error("undecodable KV pull results", error=str(exc)[:200])
            return
        if batch.epoch == self.driver.epoch:  # else: its requests were requeued
            for result in batch.results:
                handoff = self.driver.kv_pulled(result)
                if handoff is not None:
                    self.spawn(self._release(handoff, result), "kv-release")
            self._wake.set()
        if msg.reply:  # we have them (a copy of one we had is a no-op): stop sending
            ack = KVPullResultsAck(transfer_ids=[r.transfer_id for r in batch.results])
            try:
                await self.nc.publish(msg.reply, encode_msgpack(ack))
            except Exception as exc:  # the worker sends them again; we ack again
                self.log.warning("KV results ack not sent", error=repr(exc)[:200])

    async def _release(self, handoff: KVHandoff, result: KVPullResult) -> None:
        """Tells the prefill scheduler we are done with its blocks; for a pull that read
        them, its answer says whether they were still held (else: prefill here)."""
        assert self.driver is not None
        release = KVRelease(handoff_id=handoff.handoff_id, request_id=handoff.request_id)
        held = False
        try:
            reply = await self.nc.request(
                subjects.sched_kv_release(handoff.scheduler_id),
                encode_msgpack(release),
                timeout=_RELEASE_TIMEOUT_S,
            )
            held = decode_msgpack(reply.data, KVReleaseAck).held
        except Exception as exc:  # gone, slow or garbled: the KV cannot be vouched for
            self.log.warning(
                "handoff release unanswered", error=repr(exc)[:200], request_id=handoff.request_id
            )
        if result.ok:
            await self._publish(
                self.driver.kv_confirmed(result.transfer_id, handoff.request_id, held)
            )
            self._wake.set()

    async def _on_kv_release(self, msg: Msg) -> None:
        assert self.driver is not None
        try:
            release = decode_msgpack(msg.data, KVRelease)
        except msgspec.DecodeError as exc:
            self.log.error("undecodable KV release", error=str(exc)[:200])
            return
        held = self.driver.release_handoff(release.handoff_id)
        if msg.reply:
            ack = KVReleaseAck(handoff_id=release.handoff_id, held=held)
            await self.nc.publish(msg.reply, encode_msgpack(ack))
        self.log.info("handoff released", handoff=release.handoff_id, held=held)
        self._wake.set()  # its blocks are free again
        await self._maybe_publish_load()
