"""Prefill/decode disaggregation in the scheduler core (pure: no NATS, no clock of its own).

Prefill side (``Handoffs``): a request admitted with ``hand_off`` runs its prompt and first
token here and then leaves the running set with its KV kept under a holder key (the worker
is told to forget it, its blocks stay): a ``KVHandoff`` names them for the decode shard. The
blocks go back on the decode side's release, or after ``hold_s`` without one, or with the
whole KV when the worker is lost.

Decode side (``Pulls``): a request submitted with a ``kv_source`` is started as any request
is (its seat, its local prefix hit), then, instead of prefilling, reserves landing blocks
for the rest of its prompt and sends its worker a ``KVPull`` (in the next batch, which may
carry nothing else). It runs no rows meanwhile (``RECEIVING_KV``, guarded like a request
with work in flight, so nothing preempts it while the blocks are written). When the pull
succeeded and the prefill side confirmed it still held the blocks, they join the request's
tables, its prompt counts as prefilled and it decodes from the first token on (under
int4-delta only the prompt's full blocks move, sealed codes and scales: the tokens of a last
block that is not full, fewer than a block, are prefilled here from them). A request
whose landing blocks do not fit yet goes back to the waiting queue with its handoff (bounded
like any waiting request: admission sees the queue and refuses past it) and tries again as
KV frees, rather than prefilling here, which is the interference the split exists to
remove. Only a pull that cannot work (its source lost or reset, a layout that differs, a
handoff no longer held, a prompt larger than this shard's KV) prefills the prompt here: its
known first token is replayed, so the tokens are the same either way, and each such
fallback is counted by reason (``SchedulerStats.kv_transfer_fallbacks``). A handoff this
shard will not read (the request ended before its pull, or prefills here) goes back at once
(``unused_handoffs``), so the prefill side does not hold its blocks until ``hold_s``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from kernels.kv_codec import INT4_DELTA
from messages.kv_transfer import KVBlockFormat, KVHandoff, KVPull, KVPullResult
from services.common.sparse_prefill import prefill_setting
from services.scheduler.core.request import PREFILL_STATES, Request, RequestState
from services.scheduler.core.running import detach, unadmit
from services.scheduler.core.state import SchedulerState

_DEFAULT_HOLD_S = 30.0
_DEFAULT_PULL_TIMEOUT_S = 10.0
# past its own deadline, a pull's result comes within the worker's abort grace (2 s per
# chunk in flight) and a message's way: one not come this long past the deadline is lost
_RESULT_GRACE_S = 10.0

# why a request prefilled on the decode shard after all (the metric's label values)
FALLBACK_UNUSABLE = "unusable"  # another block format, or a handoff that misses the prompt
FALLBACK_TOO_LARGE = "too_large"  # its landing blocks exceed this shard's whole KV
FALLBACK_PULL_FAILED = "pull_failed"  # the worker's pull failed (the result names the cause)
FALLBACK_NOT_HELD = "not_held"  # the prefill side no longer held the blocks it read
FALLBACK_NO_RESULT = "no_result"  # no result came long past the pull's deadline
FALLBACK_WORKER_LOST = "worker_lost"  # this shard's worker was lost mid-pull
# int4-delta: the prompt fills no block, so none of it is sealed (coded) to be pulled
FALLBACK_NO_SEALED_BLOCK = "no_sealed_block"


@dataclass
class _Held:
    holder: str
    request_id: str
    until: float


@dataclass
class _Pull:
    request: Request
    incarnation: int
    holder: str
    handoff: KVHandoff
    origin_blocks: int  # the local prefix hit: pulled from this block on
    tokens: int  # prompt tokens whose KV is here once it landed (the rest prefill here)
    pulled: bool = False  # the worker read them; waiting for the prefill side's word
    waiting_since: float | None = None  # first seen by ``expire`` without a result


class Handoffs:
    """The prefill side: requests handed off and the blocks they left behind."""

    def __init__(
        self, state: SchedulerState, scheduler_id: str, hold_s: float = _DEFAULT_HOLD_S
    ) -> None:
        self._state = state
        self.scheduler_id = scheduler_id  # whom a decode shard asks to release (instance)
        self.hold_s = hold_s
        self._held: dict[str, _Held] = {}
        self._count = 0

    def __len__(self) -> int:
        return len(self._held)

    def due(self) -> Iterator[Request]:
        """Running requests ready to leave: their first token applied, nothing in flight."""
        for request in self._state.running:
            if (
                request.hand_off
                and request.state is RequestState.RECURRENT
                and request.output_token_ids
                and request.inflight_batches == 0
                and not request.awaiting_output
            ):
                yield request

    def hand_off(
        self,
        request: Request,
        *,
        shard_id: str,
        worker_id: str,
        worker_epoch: str,
        block_format: KVBlockFormat,
        now: float,
    ) -> KVHandoff:
        """Detaches ``request`` (its stream ends here without a terminal event) and returns
        where its prompt KV is."""
        self._count += 1
        # the epoch in it: a new core counts from 1 again, and a late release of the old
        # core's handoff must not free (and vouch for) the new one's of the same number
        handoff_id = f"{worker_epoch}.{self._count}"
        holder = f"handoff:{handoff_id}"
        tables = detach(self._state, request, holder)
        blocks = math.ceil(request.num_prompt_tokens / self._state.config.block_size)
        self._held[handoff_id] = _Held(holder, request.request_id, now + self.hold_s)
        return KVHandoff(
            handoff_id=handoff_id,
            request_id=request.request_id,
            shard_id=shard_id,
            scheduler_id=self.scheduler_id,
            worker_id=worker_id,
            worker_epoch=worker_epoch,
            block_format=block_format,
            num_tokens=request.num_prompt_tokens,
            plane_blocks=[list(t[:blocks]) for t in tables],
            hold_s=self.hold_s,
            prefill_setting=prefill_setting(request.sparse),
        )

    def release(self, handoff_id: str) -> bool:
        """The decode side is done with it: True if it was still held (so what it read
        meanwhile was the request's KV)."""
        held = self._held.pop(handoff_id, None)
        if held is None:
            return False
        self._state.kv.free(held.holder)
        return True

    def expire(self, now: float) -> list[str]:
        """Frees handoffs nobody released in time; returns their request ids."""
        late = [hid for hid, h in self._held.items() if now > h.until]
        out = []
        for hid in late:
            held = self._held.pop(hid)
            self._state.kv.free(held.holder)
            out.append(held.request_id)
        return out

    def clear(self) -> None:
        """The worker's KV is gone (and the KV manager with it): nothing is held any more."""
        self._held.clear()


class Pulls:
    """The decode side: requests whose prompt KV comes from a prefill worker."""

    def __init__(self, state: SchedulerState, block_format: KVBlockFormat) -> None:
        self._state = state
        self.block_format = block_format  # ours (the workers check the rest)
        self.timeout_s = _DEFAULT_PULL_TIMEOUT_S
        self._pulls: dict[str, _Pull] = {}
        self._count = 0
        # landing blocks of pulls that may still be written (no result came, or NIXL could
        # not confirm an abort), by transfer id: out of use until a result that says the
        # pull is over arrives late, or the worker's KV is reset
        self._quarantined: dict[str, str] = {}
        self.num_quarantined_blocks = 0

    def __len__(self) -> int:
        return len(self._pulls)

    def usable(self, handoff: KVHandoff, num_prompt_tokens: int) -> str | None:
        """Why ``handoff`` cannot be pulled here (None: it can)."""
        why = self.block_format.mismatch(handoff.block_format)
        if why is not None:
            return f"KV block formats differ ({why})"
        blocks = math.ceil(num_prompt_tokens / self.block_format.block_size)
        if handoff.num_tokens != num_prompt_tokens or len(handoff.plane_blocks) != (
            self.block_format.num_planes
        ):
            return "the handoff does not cover the prompt"
        if any(len(t) != blocks for t in handoff.plane_blocks):
            return "the handoff does not cover the prompt"
        return None

    def start_pending(self) -> None:
        """Requests that just started with a ``kv_source``: their landing blocks and pulls
        (called after admission, before selection). One whose blocks do not fit yet goes
        back to the waiting queue, its handoff kept, and is tried again when admitted."""
        state = self._state
        for request in list(state.pending_new):
            source = request.kv_source
            if source is None or request.state not in PREFILL_STATES:
                continue
            if self.usable(source, request.num_prompt_tokens) is not None:
                self._prefill_here(request, FALLBACK_UNUSABLE)
                continue
            bs = state.config.block_size
            origin = request.prefill_window_origin // bs
            total = self.pullable_blocks(request)
            if total <= origin:
                self._prefill_here(request, FALLBACK_NO_SEALED_BLOCK)
                continue
            if (total - origin) * state.kv.num_planes > state.kv.num_blocks:
                self._prefill_here(request, FALLBACK_TOO_LARGE)
                continue
            transfer_id = f"{request.request_id}#{request.incarnation}.{self._count + 1}"
            holder = f"pull:{transfer_id}"
            landing = state.kv.reserve(holder, total - origin)
            if landing is None:  # waits for decode KV: nothing ran, the worker never saw it
                unadmit(state, request)
                state.stats.num_kv_waits += 1
                continue
            self._count += 1
            request.kv_source = None  # one pull per handoff: a later restart prefills
            tokens = min(total * bs, request.num_prompt_tokens)
            self._pulls[transfer_id] = _Pull(
                request, request.incarnation, holder, source, origin, tokens
            )
            request.state = RequestState.RECEIVING_KV
            request.inflight_batches += 1  # nothing may preempt it while blocks land
            state.pending_pulls.append(
                KVPull(
                    transfer_id=transfer_id,
                    request_id=request.request_id,
                    worker_id=source.worker_id,
                    worker_epoch=source.worker_epoch,
                    remote_blocks=[b for t in source.plane_blocks for b in t[origin:total]],
                    local_blocks=[b for t in landing for b in t],
                    timeout_s=self.timeout_s,
                    traceparent=source.traceparent,
                )
            )

    def pulled(self, result: KVPullResult) -> KVHandoff | None:
        """The worker's word on a pull. A failed one prefills at once; a read one waits for
        the prefill side's confirmation. Returns the handoff to release (None: unknown).
        A result that comes after its pull was given up frees the landing blocks kept out
        of use meanwhile: the worker says nothing writes them any more. A copy of a
        result already applied changes nothing (None)."""
        pull = self._pulls.get(result.transfer_id)
        if pull is None:
            holder = self._quarantined.get(result.transfer_id)
            if holder is not None and not result.abort_unconfirmed:
                del self._quarantined[result.transfer_id]
                self.num_quarantined_blocks -= self._state.kv.num_held_blocks(holder)
                self._state.kv.free(holder)
            return None
        if pull.pulled:
            return None  # a copy of a result we have (the worker sends until acknowledged)
        if result.ok and self._live(pull):
            pull.pulled = True
        else:
            reason = FALLBACK_PULL_FAILED if not result.ok else ""
            self._fall_back(result.transfer_id, landed=not result.abort_unconfirmed, reason=reason)
        return pull.handoff

    def confirmed(self, transfer_id: str, held: bool) -> bool:
        """The prefill side's answer to our release: the request decodes from its pulled
        prompt (True) or prefills it here."""
        pull = self._pulls.get(transfer_id)
        if pull is None or not pull.pulled:
            return False
        if not (held and self._live(pull)):
            self._fall_back(transfer_id, reason=FALLBACK_NOT_HELD)
            return False
        del self._pulls[transfer_id]
        request = pull.request
        request.inflight_batches -= 1
        kv = self._state.kv
        kv.attach(pull.holder, request.request_id)
        request.reset_prefill(origin=pull.tokens)  # every depth of these tokens is here
        if pull.tokens < request.num_prompt_tokens:  # int4-delta's open last block
            request.state = self._prefill_state()
        else:
            request.state = RequestState.RECURRENT
        self._publish(request)
        return True

    def pullable_blocks(self, request: Request) -> int:
        """Blocks of the prompt a pull moves: all of them, except under int4-delta, where
        a last block that is not full is open on the prefill worker (its tokens exact in a
        full-precision tail, coded only once the block fills), so its tokens, fewer than a
        block, are prefilled here again from the sealed blocks before them. Under
        token-sparse prefill that prefill starts where a window starts, as a prefix hit's
        does (a window's active tokens are chosen from all of it)."""
        bs = self.block_format.block_size
        prompt = request.num_prompt_tokens
        if self.block_format.kv_cache_dtype != INT4_DELTA:
            return math.ceil(prompt / bs)
        blocks = prompt // bs
        if request.sparse is not None and blocks * bs < prompt:
            blocks = request.sparse.whole_window_blocks(blocks, bs)
        return blocks

    def _prefill_state(self) -> RequestState:
        split = self._state.config.split_prefill
        return RequestState.PREFILLING_PRELUDE if split else RequestState.PREFILL

    def expire(self, now: float) -> list[str]:
        """Pulls still open long past their deadline: a result that never came (the worker
        publishes it until acknowledged, so its worker is gone or cut off) or an answer
        that never came. Past ``timeout_s`` twice (the
        worker's deadline starts when the batch runs, not when it was sent) and a grace,
        the request prefills here and its handoff goes back; the landing blocks of a pull
        without a result stay out of use (the worker may still be writing them). Returns
        the ids of their requests. Called periodically: a pull's wait counts from the
        first call that sees it."""
        late = []
        for transfer_id, pull in self._pulls.items():
            if pull.waiting_since is None:
                pull.waiting_since = now
            elif now - pull.waiting_since > 2 * self.timeout_s + _RESULT_GRACE_S:
                late.append(transfer_id)
        out = []
        for transfer_id in late:
            pull = self._pulls[transfer_id]
            self._state.unused_handoffs.append(pull.handoff)
            self._fall_back(transfer_id, landed=pull.pulled, reason=FALLBACK_NO_RESULT)
            out.append(pull.request.request_id)
        return out

    def clear(self) -> None:
        """The worker's KV is gone (and the KV manager with it): results still coming are
        stale, the requests were requeued by the worker-loss reset (they prefill here), and
        the handoffs go back."""
        self._state.unused_handoffs += [pull.handoff for pull in self._pulls.values()]
        for pull in self._pulls.values():
            if self._live(pull):
                self._count_fallback(FALLBACK_WORKER_LOST)
        self._pulls.clear()
        self._quarantined.clear()
        self.num_quarantined_blocks = 0

    def _live(self, pull: _Pull) -> bool:
        request = pull.request
        return (
            not request.is_finished
            and request.incarnation == pull.incarnation
            and request.state is RequestState.RECEIVING_KV
        )

    def _prefill_here(self, request: Request, reason: str) -> None:
        """A request that will not pull: its handoff goes back and it prefills here."""
        assert request.kv_source is not None
        self._state.unused_handoffs.append(request.kv_source)
        request.kv_source = None
        self._count_fallback(reason)

    def _count_fallback(self, reason: str) -> None:
        fallbacks = self._state.stats.kv_transfer_fallbacks
        fallbacks[reason] = fallbacks.get(reason, 0) + 1

    def _fall_back(self, transfer_id: str, *, landed: bool = True, reason: str = "") -> None:
        """The pull is over without usable KV: its landing blocks go back (unless a write
        may still land in them: ``landed`` False keeps them out of use), and a request
        still waiting for them prefills its prompt here."""
        pull = self._pulls.pop(transfer_id)
        if landed:
            self._state.kv.free(pull.holder)
        else:
            self._quarantined[transfer_id] = pull.holder
            self.num_quarantined_blocks += self._state.kv.num_held_blocks(pull.holder)
        if not self._live(pull):
            return
        if reason:
            self._count_fallback(reason)
        request = pull.request
        request.inflight_batches -= 1
        request.state = self._prefill_state()

    def _publish(self, request: Request) -> None:
        """Full prompt blocks just pulled become this shard's prefix cache too."""
        if not request.block_hashes:
            return
        kv, bs = self._state.kv, self._state.config.block_size
        complete = min(request.num_prompt_tokens // bs, len(request.block_hashes))
        seq = self._state.next_seq - 1  # written before any batch still to come reads them
        for index in range(request.num_published_blocks, complete):
            parent = request.block_hashes[index - 1] if index else None
            kv.publish(request.request_id, index, request.block_hashes[index], parent, seq)
        request.num_published_blocks = max(request.num_published_blocks, complete)
