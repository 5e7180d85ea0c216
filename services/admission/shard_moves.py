"""Shard loss and moves: when a shard's scheduler is gone, its open requests resume on
another shard with the outputs their clients already have, or end with ``unavailable``.

A shard is lost when its reports stop and nats-server confirms its scheduler's connection
is gone (``rlt.v1.sched.alive.<id>`` has no responders): a scheduler that is only stalled
(SIGSTOP, a long pause) keeps its connection and would go on streaming when it resumes, so
its requests wait for it. A new scheduler instance announcing the shard, nats-server saying
no scheduler received a submit, a shard's own ``unavailable``, and a worker gone while other
shards are healthy move requests too. Every try moved or ended is written to the
``FenceLog``, so its old scheduler drops it should it come back.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import msgspec
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError

from messages.api import FinishedEvent
from messages.errors import ErrorCode
from messages.internal import FenceQuery, FenceUpdate
from messages.kv_transfer import KVHandoff, KVRelease
from services.admission.aborts import Aborts
from services.admission.config import AdmissionConfig
from services.admission.routing import Routing
from services.admission.shards import Shard
from services.admission.tables import FenceLog, OpenRequest, OpenRequests
from services.runtime import subjects
from services.runtime.bus import encode_msgpack
from services.runtime.logging import request_fields
from services.runtime.service import Service

# a shard whose reports have said "no worker" this long gives its requests to healthy shards
NO_WORKER_GRACE_S = 0.5
# a gap this long in our own 0.25 s watch loop means we were stalled ourselves
_OWN_STALL_S = 2.0
_WATCH_EVERY_S = 0.25


class ShardMoves:
    def __init__(
        self,
        actor: Service,
        config: AdmissionConfig,
        open_requests: OpenRequests,
        fences: FenceLog,
        routing: Routing,
        aborts: Aborts,
        next_seq: Callable[[], int],
    ) -> None:
        self._actor = actor
        self._config = config
        self._open = open_requests
        self._fences = fences
        self._routing = routing
        self._aborts = aborts
        self._next_seq = next_seq  # a fresh admission seq: a move is a new submit
        self.num_moved = 0
        self.num_handed_over = 0  # prefill shard -> decode shard, after the first token
        # silence before this (a stall of our own: we could not hear anyone) judges nobody
        self._judge_from = 0.0
        self._stalled_noted: set[str] = set()

    async def watch(self) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(_WATCH_EVERY_S)
            now = time.monotonic()
            if now - before > _OWN_STALL_S:
                self._judge_from = now  # we were stalled: we could not hear anyone either
            if not self._actor.bus_connected:
                continue  # silence while we are cut off says nothing about the schedulers
            try:
                await self._check_shards(now)
            except Exception:
                self._actor.log.exception("shard check failed")

    async def scheduler_replaced(self, shard_id: str, old_scheduler: str) -> None:
        """A new scheduler instance announced ``shard_id``: the old one's requests move."""
        for seq, entry in self._open.on_shard(shard_id).items():
            if entry.owner == old_scheduler:
                await self.move_or_end(entry, "its scheduler restarted", seq)

    def fence_update(self, query: FenceQuery) -> FenceUpdate:
        """What a scheduler that came back must drop: the tries moved or ended for it."""
        fenced = self._fences.for_scheduler(query.scheduler_id, time.monotonic(), query.seqs)
        return FenceUpdate(
            admission_id=self._actor.instance_id,
            fenced=fenced,
            scheduler_lost_s=self._config.scheduler_lost_s,
        )

    async def move_or_end(self, entry: OpenRequest, reason: str, seen_seq: int) -> None:
        if not await self.move(entry, reason, seen_seq):
            self._open.close(entry.seq)
            # if its scheduler comes back, it drops this try without a word (fencing)
            self._fences.add(entry.owner, entry.request_id, entry.seq, time.monotonic())
            if entry.abort_requested:  # it ends, as asked, only not with its usual event
                message = f"aborted; its shard stopped before it confirmed ({reason})"
            else:
                message = f"the scheduler holding this request stopped ({reason}); retry it"
            await self._aborts.end(entry, message)

    async def move(self, entry: OpenRequest, reason: str, seen_seq: int) -> bool:
        """Resubmits ``entry``, seen open under ``seen_seq``, to another healthy shard with the
        outputs the client has; False if it cannot move (no other healthy shard, or moved
        too often). True, doing nothing, if it ended or moved since the caller saw it."""
        if not self._open.is_open(entry, seen_seq):
            return True  # handled while the caller awaited something
        admitted = entry.admitted
        if admitted is None or not self._open.can_move(entry, self._config.max_moves):
            return False
        now = time.monotonic()
        old_shard, old_seq, old_owner = entry.shard, entry.seq, entry.owner
        target = self._routing.choose_healthy(len(admitted.prompt_token_ids), now, old_shard)
        if target is None:
            return False
        seq = self._next_seq()
        resumed = entry.resumed(admitted, seq, target)
        self._open.moved(entry, seq, target, now)
        self._fences.add(old_owner, entry.request_id, old_seq, now)
        # the old copy, if its scheduler still runs, stops and frees its KV (only that copy)
        await self._aborts.forward(
            entry.request_id, None, "", entry.trace_id, admitted.tenant, old_shard, old_seq
        )
        await self._routing.submit(resumed, now)
        self.num_moved += 1
        self._actor.log.warning(
            "request moved to another shard",
            reason=reason,
            from_shard=old_shard,
            to_shard=target,
            resumed_tokens=len(entry.token_ids),
            **request_fields(entry.request_id, entry.trace_id),
        )
        return True

    async def hand_over(
        self, entry: OpenRequest, handoff: KVHandoff, seen_seq: int
    ) -> FinishedEvent | None:
        """A prefill shard ran the prompt and first token of ``entry`` and holds its KV: it
        goes on on a decode shard that pulls that KV (or, with none healthy, on any healthy
        shard, which computes it again). The old try ended there by itself. A client that
        asked to abort it meanwhile (the abort went to the prefill shard, too late) gets
        its end here: returns that ``abort`` event for the caller to pass on. Whatever does
        not reach a decode shard releases the handoff, so the prefill side frees the KV
        now rather than after its hold time."""
        admitted = entry.admitted
        if admitted is None or not self._open.is_open(entry, seen_seq):
            await self._release(handoff)
            return None
        if handoff.prefill_setting is not None:
            # wherever it runs from now on (a decode shard, or any shard after a loss), its
            # prompt is prefilled as the prefill shard did (token-sparse prefill)
            admitted = entry.admitted = msgspec.structs.replace(
                admitted, prefill_setting=handoff.prefill_setting
            )
        now = time.monotonic()
        old_shard = entry.shard
        chosen = None
        if not entry.abort_requested:
            chosen = await self._routing.choose_decode(admitted, now, exclude=old_shard)
        if not self._open.is_open(entry, seen_seq):  # ended (the client gone) meanwhile
            await self._release(handoff)
            return None
        if entry.abort_requested:
            self._open.close(entry.seq)
            await self._release(handoff)
            self._actor.log.info(
                "request aborted at its handover",
                **request_fields(entry.request_id, entry.trace_id),
            )
            return FinishedEvent(
                request_id=entry.request_id,
                finish_reason="abort",
                token_ids=list(entry.token_ids),
                exit_depths=list(entry.exit_depths),
                num_prompt_tokens=len(admitted.prompt_token_ids),
                shard=old_shard,
            )
        source: KVHandoff | None = handoff
        if chosen is None:
            source = None
            await self._release(handoff)
            target = self._routing.choose_healthy(len(admitted.prompt_token_ids), now, "")
            if target is None:
                await self.move_or_end(entry, "no shard can decode it", seen_seq)
                return None
            overlap = 0
        else:
            target, overlap = chosen
        seq = self._next_seq()
        resumed = msgspec.structs.replace(
            entry.resumed(admitted, seq, target), kv_source=source, hand_off=False
        )
        self._open.moved(entry, seq, target, now, handed=True)
        await self._routing.submit(resumed, now, overlap, handoff.traceparent)
        self.num_handed_over += 1
        self._actor.log.info(
            "request handed over",
            from_shard=old_shard,
            to_shard=target,
            kv_pulled=source is not None,
            **request_fields(entry.request_id, entry.trace_id),
        )
        return None

    async def _release(self, handoff: KVHandoff) -> None:
        """The prefill scheduler may free the handoff's blocks: nobody will read them."""
        release = KVRelease(handoff_id=handoff.handoff_id, request_id=handoff.request_id)
        try:
            await self._actor.nc.publish(
                subjects.sched_kv_release(handoff.scheduler_id), encode_msgpack(release)
            )
        except Exception as exc:  # its hold time frees them anyway
            self._actor.log.warning("handoff release not sent", error=repr(exc)[:200])

    async def _check_shards(self, now: float) -> None:
        for entry in self._open.expired(now):
            limit = f"RLT_MAX_REQUEST_S ({self._config.max_request_s:g} s)"
            await self._aborts.abort_and_end(entry, f"request exceeded {limit}", ErrorCode.TIMEOUT)
        since = max(self._actor.bus_connected_since, self._judge_from)
        shards = self._routing.shards
        silent = shards.silent(now, since)
        suspects = self._open.suspects(now, since)
        if silent or suspects:
            await self._judge(silent, suspects)
        for shard in shards.without_worker(now, NO_WORKER_GRACE_S):
            if not shards.healthy(now, exclude=shard.shard_id):
                continue  # nowhere better: they wait for a worker there
            for seq, entry in self._open.on_shard(shard.shard_id).items():
                await self.move(entry, "its shard has no worker", seq)

    async def _judge(self, silent: list[Shard], suspects: dict[int, OpenRequest]) -> None:
        """Moves (or ends) the requests of silent shards and schedulers once nats-server
        confirms each scheduler's connection is gone: one that is merely stalled keeps its
        connection and would resume streaming, so its requests wait for it."""
        owners = {e.owner for e in suspects.values() if e.owner is not None}
        owners |= {s.scheduler_id for s in silent}
        known = sorted(owners | set(self._open.schedulers()))
        verdicts = dict(zip(known, await asyncio.gather(*map(self._probe, known)), strict=True))
        self._note(verdicts)
        for shard in silent:
            if verdicts.get(shard.scheduler_id) != "gone":
                continue
            if self._routing.shards.shards.get(shard.shard_id) is not shard:
                continue  # a new scheduler announced it while we probed: that path moved them
            self._routing.forget_shard(shard.shard_id)
            entries = self._open.on_shard(shard.shard_id)
            self._actor.log.warning(
                "shard lost: its reports stopped and its scheduler is gone",
                shard=shard.shard_id,
                scheduler=shard.scheduler_id,
                open_requests=len(entries),
            )
            for seq, entry in entries.items():
                await self.move_or_end(entry, "its shard was lost", seq)
        # a request no scheduler accepted may sit in any stalled scheduler's inbound queue
        nobody_stalled = all(v != "stalled" for v in verdicts.values())
        for seq, entry in suspects.items():
            gone = verdicts.get(entry.owner) == "gone" if entry.owner else nobody_stalled
            if gone:
                await self.move_or_end(entry, "the scheduler holding it stopped", seq)

    def _note(self, verdicts: dict[str, str]) -> None:
        """An alive scheduler was heard from; a stalled one is logged once per stall."""
        for sid, verdict in verdicts.items():
            if verdict == "alive":
                self._open.heard_from(sid, time.monotonic())
            elif verdict == "stalled" and sid not in self._stalled_noted:
                self._stalled_noted.add(sid)
                self._actor.log.warning(
                    "scheduler silent but still connected; its requests wait", scheduler=sid
                )
            if verdict != "stalled":
                self._stalled_noted.discard(sid)

    async def _probe(self, scheduler_id: str) -> str:
        """ "gone": nats-server has no subscriber for that scheduler any more (its connection
        was closed: nothing more can come from it); "stalled": connected but not answering;
        "alive": it answered."""
        try:
            await self._actor.nc.request(
                subjects.sched_alive(scheduler_id), b"", timeout=self._config.probe_timeout_s
            )
        except NoRespondersError:
            return "gone"
        except (TimeoutError, NatsError):
            return "stalled"
        return "alive"
