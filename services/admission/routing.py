"""Routing a request to a shard over NATS, and submitting it there.

The shard table says which shards may take it (fresh reports; backpressure per shard), the
prefix index (``rlt.v1.prefix.lookup``) how much of its prompt each already caches, and
``Router`` (pure) which one's cost is lowest. When the index cannot answer, routing goes by
load only and asks it again later (``IndexGate``). With no shard known, shards are asked to
announce themselves and the request waits a moment for one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator

import msgspec
from nats.errors import Error as NatsError

from messages.errors import ErrorCode
from messages.internal import AdmittedRequest
from messages.prefix import PrefixLookup, PrefixLookupReply
from services.admission.config import AdmissionConfig
from services.admission.errors import AdmissionError
from services.admission.membership import ShardMembership
from services.admission.prefix_keys import PrefixKeys
from services.admission.router import IndexGate, RecentRoutes, Router
from services.admission.shards import Shard, ShardLoad
from services.admission.validation import Prepared
from services.runtime import subjects
from services.runtime.bus import decode_msgpack, encode_msgpack
from services.runtime.service import Service
from services.runtime.tracing import TRACEPARENT

# why one more request of this many prompt tokens may not join a queue of (requests,
# tokens) (``AdmissionCore.over_limit``); None: it may
OverLimit = Callable[[int, int, int], str | None]


class RoutesInFlight:
    """Generates being routed, by request id. Routing may wait for the prefix index: an
    abort arriving meanwhile waits for its generate rather than overtake it, and drain
    waits for them before its last look at the open requests."""

    def __init__(self) -> None:
        self._routed: dict[str, asyncio.Future[None]] = {}

    def __len__(self) -> int:
        return len(self._routed)

    @contextlib.contextmanager
    def routing(self, request_id: str) -> Iterator[None]:
        routed = self._routed[request_id] = asyncio.get_running_loop().create_future()
        try:
            yield
        finally:
            self._routed.pop(request_id, None)
            routed.set_result(None)

    async def wait(self, request_id: str, timeout: float) -> None:
        """Until ``request_id`` is routed (or refused), at most ``timeout`` seconds."""
        routed = self._routed.get(request_id)
        if routed is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(routed), timeout)


class Routing:
    def __init__(
        self,
        actor: Service,
        config: AdmissionConfig,
        membership: ShardMembership,
        block_size: int,
    ) -> None:
        self._actor = actor
        self._lookup_timeout_s = config.prefix_lookup_timeout_s
        self._membership = membership
        self.shards = membership.shards
        self.router = Router(
            config.router, block_size, config.router_overlap_weight, config.router_request_weight
        )
        self.recent = RecentRoutes()
        self.index = IndexGate(config.prefix_index_retry_s)
        self.lookup_us: deque[float] = deque(maxlen=2000)
        self.routed: dict[str, int] = {}  # shard -> requests submitted there
        self.in_flight = RoutesInFlight()

    async def route(
        self, prepared: Prepared, over_limit: OverLimit, exclude: str = ""
    ) -> tuple[str, int]:
        """The shard for a request and the prefix blocks it is expected to hold there
        (raises AdmissionError when no shard can take it)."""
        rid = prepared.request_id
        now = time.monotonic()
        candidates = [s for s in self.shards.routable(now) if s.shard_id != exclude]
        if not candidates and not exclude:
            candidates = await self._discover_shards()
        # a new request starts with its prefill: on a decode shard only if nothing else runs
        candidates = [s for s in candidates if s.role != "decode"] or candidates
        if not candidates:
            raise AdmissionError(rid, ErrorCode.UNAVAILABLE, "no scheduler is running")
        loads = [self.shards.load(s, now) for s in candidates]
        prompt = prepared.prompt_token_ids
        open_loads = [
            load
            for load in loads
            if over_limit(load.num_waiting, load.waiting_tokens, len(prompt)) is None
        ]
        if not open_loads:
            least = min(loads, key=lambda s: (s.num_waiting, s.waiting_tokens))
            why = over_limit(least.num_waiting, least.waiting_tokens, len(prompt))
            raise AdmissionError(rid, ErrorCode.OVERLOADED, f"server overloaded: {why}")
        keys: PrefixKeys | None = None
        overlaps: dict[str, int] | None = None
        caching = any(s.prefix_caching for s in candidates)
        # a request scoring its prompt computes all of it: no shard's cache helps it
        scores_prompt = prepared.params.prompt_logprobs is not None
        if self.router.uses_overlap and caching and len(open_loads) > 1 and not scores_prompt:
            open_ids = {load.shard_id for load in open_loads}
            keys = PrefixKeys.of(
                prompt,
                self.shards.block_size,
                prepared.params,
                None,
                (s for s in candidates if s.shard_id in open_ids),
            )
            overlaps = await self._overlaps(keys, open_loads, rid, prepared.trace_id)
        choice = self.router.choose(open_loads, len(prompt), overlaps)
        if keys is not None and (hashes := keys.of_shard(choice.shard_id)):
            self.recent.record(hashes, choice.shard_id, now)
        return choice.shard_id, choice.overlap_blocks

    def choose_healthy(self, num_prompt_tokens: int, now: float, exclude: str) -> str | None:
        """A healthy shard other than ``exclude`` for a request moving there, by load (its
        prefix is not asked for); None when there is none."""
        healthy = self.shards.healthy(now, exclude=exclude)
        if not healthy:
            return None
        loads = [self.shards.load(s, now) for s in healthy]
        return self.router.choose(loads, num_prompt_tokens).shard_id

    async def choose_decode(
        self, admitted: AdmittedRequest, now: float, exclude: str
    ) -> tuple[str, int] | None:
        """The decode shard for a request a prefill shard handed over: by load and by the
        prompt prefix it already caches (it then pulls only the rest); None if none is
        healthy."""
        targets = self.shards.decode_targets(now, exclude=exclude)
        if not targets:
            return None
        loads = [self.shards.load(s, now) for s in targets]
        prompt = admitted.prompt_token_ids
        overlaps = None
        if self.router.uses_overlap and len(loads) > 1 and any(s.prefix_caching for s in targets):
            keys = PrefixKeys.of(
                prompt, self.shards.block_size, admitted.params, admitted.prefill_setting, targets
            )
            overlaps = await self._overlaps(keys, loads, admitted.request_id, admitted.trace_id)
        choice = self.router.choose(loads, len(prompt), overlaps)
        return choice.shard_id, choice.overlap_blocks

    async def submit(
        self, admitted: AdmittedRequest, now: float, overlap_blocks: int = 0, traceparent: str = ""
    ) -> None:
        shard = admitted.shard_id
        if admitted.kv_source is None and self.shards.hands_off(shard, now):
            admitted = msgspec.structs.replace(admitted, hand_off=True)
        seq = admitted.admission_seq
        prompt = len(admitted.prompt_token_ids)
        prefill = max(0, prompt - overlap_blocks * self.shards.block_size)
        self.shards.sent(shard, seq, prompt, now, prefill)
        self.routed[shard] = self.routed.get(shard, 0) + 1
        # the tracking subject as reply: the "accepted" notice, or "no responders"
        await self._actor.nc.publish(
            subjects.sched_submit(shard),
            encode_msgpack(admitted),
            reply=subjects.admission_track(self._actor.instance_id, seq),
            headers={TRACEPARENT: traceparent} if traceparent else None,
        )

    def forget_shard(self, shard_id: str) -> None:
        """A lost shard: no longer in the table, nor followed for its recent prefixes."""
        self.shards.remove(shard_id)
        self.recent.forget_shard(shard_id)

    async def _overlaps(
        self, keys: PrefixKeys, loads: list[ShardLoad], request_id: str, trace_id: str
    ) -> dict[str, int] | None:
        """{shard: the cached leading blocks its scheduler would claim}, one index lookup
        per way the shards key the prompt (one when their flags agree); None (load only)
        when there is nothing to look up or the index cannot answer."""
        out: dict[str, int] | None = None
        for hashes, shard_ids in keys.groups():
            group = [load for load in loads if load.shard_id in shard_ids]
            found = await self._lookup(hashes, group, request_id, trace_id)
            if found is None:
                return None
            out = out or {}
            for shard_id, blocks in found.items():
                if shard_id in shard_ids:
                    out[shard_id] = keys.claimable(shard_id, blocks)
        return out

    async def _lookup(
        self, hashes: list[int], loads: list[ShardLoad], request_id: str, trace_id: str
    ) -> dict[str, int] | None:
        """{shard: cached leading blocks}: the prefix index's per-producer answer, topped up
        with what this router sent each shard recently. None (load only) when the index
        cannot answer."""
        now = time.monotonic()
        if not self.index.should_ask(now):
            return None
        lookup = PrefixLookup(
            block_hashes=hashes,
            request_id=request_id,
            trace_id=trace_id,
            per_producer=True,
        )
        started = time.perf_counter()
        try:
            msg = await self._actor.nc.request(
                subjects.PREFIX_LOOKUP, encode_msgpack(lookup), timeout=self._lookup_timeout_s
            )
            answer = decode_msgpack(msg.data, PrefixLookupReply)
        except (NatsError, TimeoutError, msgspec.DecodeError) as exc:
            if self.index.failed(time.monotonic()):
                self._actor.log.warning(
                    "prefix index unreachable; routing by load only", error=repr(exc)[:200]
                )
            return None
        self.lookup_us.append((time.perf_counter() - started) * 1e6)
        if self.index.succeeded():
            self._actor.log.info("prefix index reachable again; routing by prefix overlap")
        by_producer = {load.producer_id: load.shard_id for load in loads}
        out = {by_producer[p]: n for p, n in answer.overlaps.items() if p in by_producer}
        for shard_id, n in self.recent.overlaps(hashes, now).items():
            out[shard_id] = max(out.get(shard_id, 0), n)
        return out

    async def _discover_shards(self) -> list[Shard]:
        """No shard known: ask them to announce and report, and wait a moment."""
        await self._membership.ask_shards()
        try:
            msg = await self._actor.nc.request(subjects.SCHED_LOAD_GET, b"", timeout=1.0)
            await self._membership.reported(msg.data)
        except (NatsError, TimeoutError) as exc:
            self._actor.log.warning("scheduler unreachable", error=repr(exc))
            return []
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            routable = self.shards.routable(time.monotonic())
            if routable:
                return routable
            await asyncio.sleep(0.01)
        return []
