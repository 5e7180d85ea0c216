"""Prefill/decode disaggregation in one process under faults the bus and the KV make:

- pull results lost on the way (their first publication dropped) or acknowledged too late
  (the scheduler gets a copy of a result it has): the worker's outbox publishes each
  result until the scheduler acknowledges it, a copy changes nothing, the blocks land and
  every request decodes from its pulled KV, equal to a colocated run and the oracle;
- small KV on both shards, with pulls that stay open for a while: requests on the decode
  shard are preempted while pulls are open and while they decode; the tokens equal the
  oracle (the compared count asserted), no fallback is counted, and every block is free on
  both shards after the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from messages.kv_transfer import KVPullResult
from messages.sampling import SamplingParams
from services.common.config import KVAdmission, SchedulerConfig
from services.scheduler.core.request import RequestState
from services.worker.kv_transfer.agent import nixl_available
from services.worker.kv_transfer.result_outbox import ResultOutbox
from tests.disaggregation_pair import (
    CONFIGS,
    GREEDY_EXIT,
    PROMPTS,
    Pair,
    colocated,
    compare,
    workload,
)
from tests.engine_harness import assert_matches_oracle, oracle_result

pytestmark = [
    pytest.mark.oracle,
    pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed"),
]

STEP_S = 0.1  # the clock advances this much per step of the pair
RELEASE_S = 0.55  # a release's answer takes this long (past a result's first two retries)


@dataclass
class AckedPair(Pair):
    """A pair whose pull results travel as the services send them: through the worker's
    outbox (published, then again with backoff until acknowledged), with publications and
    acknowledgements lost on demand."""

    outbox: ResultOutbox | None = None
    clock: float = 0.0
    drop_publications: int = 0  # the next this many publications are lost
    drop_acks: int = 0  # the next this many acknowledgements are lost
    publications: int = 0
    copies: int = 0  # results the scheduler already had
    releases: int = 0  # releases sent to the prefill side
    # releases under way: (when the answer comes, transfer id, whether it was held)
    answers: list[tuple[float, str, bool]] = field(default_factory=list)

    def _confirm(self) -> None:
        assert self.outbox is not None
        self.clock += STEP_S
        pulls = self.decode.scheduler.pulls
        for answer in [a for a in self.answers if a[0] <= self.clock]:
            self.answers.remove(answer)
            self.pulled += pulls.confirmed(answer[1], answer[2] and self.release_held)
        for result in self.executor.done:
            self.outbox.add("e", result, self.clock)
        self.executor.done.clear()
        for results in self.outbox.due(self.clock).values():
            self.publications += 1
            if self.drop_publications > 0:
                self.drop_publications -= 1
                continue
            self._deliver(results)
            if self.drop_acks > 0:
                self.drop_acks -= 1
                continue
            self.outbox.confirm(r.transfer_id for r in results)
        for handoff in self.decode.scheduler.take_unused_handoffs():
            self.unused += 1
            self.prefill.scheduler.handoffs.release(handoff.handoff_id)

    def _deliver(self, results: list[KVPullResult]) -> None:
        """What the decode scheduler's service does with a publication."""
        pulls = self.decode.scheduler.pulls
        for result in results:
            handoff = pulls.pulled(result)
            if handoff is None:
                self.copies += 1
                continue
            self.releases += 1
            held = self.prefill.scheduler.handoffs.release(handoff.handoff_id)
            if result.ok:  # its answer comes after the result's first retry would
                self.answers.append((self.clock + RELEASE_S, result.transfer_id, held))


def _acked_pair(model, config: SchedulerConfig) -> AckedPair:  # type: ignore[no-untyped-def]
    base = Pair.build(model, config)
    return AckedPair(base.prefill, base.decode, base.executor, outbox=ResultOutbox())


@pytest.mark.parametrize("lost", ["publication", "acknowledgement", "both"])
def test_lost_pull_results_are_published_again_until_acknowledged(toy_model, oracle, lost):
    config = CONFIGS["wcpb-async-prefix"]
    requests = workload(GREEDY_EXIT)
    expected = colocated(toy_model, config, requests)
    pair = _acked_pair(toy_model, config)
    pair.drop_publications = 2 if lost != "acknowledgement" else 0
    pair.drop_acks = 2 if lost != "publication" else 0
    for request in requests:
        pair.add(*request)
    pair.run()
    compare(pair, expected)
    assert pair.outbox is not None
    assert pair.outbox.num_resent >= 2 and len(pair.outbox) == 0  # every result acknowledged
    assert pair.drop_publications == 0 and pair.drop_acks == 0  # the losses did happen
    if lost != "publication":
        assert pair.copies >= 1  # a result the scheduler had came again: no effect
    assert pair.releases == pair.handed_off  # one release per handoff, copies or not
    # every prompt decoded from its pulled KV: nothing fell back, nothing was kept aside
    assert pair.handed_off == len(requests) and pair.pulled == len(requests)
    decode = pair.decode.scheduler
    assert decode.stats.kv_transfer_fallbacks == {}
    assert decode.pulls.num_quarantined_blocks == 0
    compared = 0
    for rid, prompt, p in requests:
        want = oracle_result(oracle, prompt, p.resolve(toy_model.cfg.total_ut_steps, 512), config)
        compared += assert_matches_oracle(pair.finished()[rid], want, rid)
    assert compared == len(requests) * GREEDY_EXIT.max_tokens
    pair.check_no_leaks(config)


@dataclass
class Preemptions:
    mid_pull: int = 0  # decode-shard preemptions while some pull was open
    mid_decode: int = 0  # of requests that had decoded past their handed-over first token


class WatchedPair(AckedPair):
    """Counts the decode shard's preemptions by what was going on when they struck."""

    seen: Preemptions

    def run(self) -> None:
        self.seen = Preemptions()
        for _ in range(20_000):
            if not (
                self.prefill.has_unfinished_requests() or self.decode.has_unfinished_requests()
            ):
                return
            self.events += self.prefill.step()
            self._hand_over()
            decode = self.decode.scheduler
            pulling = any(r.state is RequestState.RECEIVING_KV for r in decode.running)
            before = {
                r.request_id: (r.incarnation, len(r.output_token_ids)) for r in decode.running
            }
            self.events += self.decode.step()
            for request in decode.requests.values():
                was = before.get(request.request_id)
                if was is None or request.incarnation == was[0]:
                    continue
                self.seen.mid_pull += pulling
                self.seen.mid_decode += was[1] > 1
            self._confirm()
        raise AssertionError("no progress")


SMALL = {
    "incremental": SchedulerConfig(
        block_size=4, num_blocks=40, max_num_seqs=4, max_num_batched_tokens=8,
        prefill_chunk_size=4, kv_admission=KVAdmission.INCREMENTAL,
    ),
    "incremental-prefix": SchedulerConfig(
        block_size=4, num_blocks=44, max_num_seqs=5, max_num_batched_tokens=8,
        prefill_chunk_size=4, kv_admission=KVAdmission.INCREMENTAL, enable_prefix_caching=True,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(SMALL))
def test_small_kv_preempts_mid_pull_and_mid_decode_with_exact_tokens(toy_model, oracle, name):
    """Pull results come late (each first publication lost: a pull stays open for a few
    steps), KV is small on both shards, and requests outnumber it: the decode shard preempts
    while pulls are open and while requests decode; every token equals the oracle and a
    colocated run, no fallback is counted, and no block is held on either shard after."""
    small = SMALL[name]
    params = SamplingParams(
        max_tokens=14, temperature=0.0, min_loops=1, exit_threshold=0.6, ignore_eos=True
    )
    requests = [
        (f"{rid}{k}", [*prompt, k + 1], params) for k in range(2) for rid, prompt in PROMPTS.items()
    ]
    expected = colocated(toy_model, small, requests)
    base = Pair.build(toy_model, small)
    pair = WatchedPair(base.prefill, base.decode, base.executor, outbox=ResultOutbox())
    pair.drop_publications = 6
    for request in requests:
        pair.add(*request)
    pair.run()
    compare(pair, expected)
    stats = pair.decode.scheduler.stats
    assert pair.seen.mid_pull > 0, pair.seen
    assert pair.seen.mid_decode > 0, pair.seen
    assert stats.kv_transfer_fallbacks == {}
    assert pair.pulled == len(requests)
    compared = 0
    for rid, prompt, p in requests:
        want = oracle_result(oracle, prompt, p.resolve(toy_model.cfg.total_ut_steps, 512), small)
        compared += assert_matches_oracle(pair.finished()[rid], want, rid)
    assert compared == len(requests) * params.max_tokens
    pair.check_no_leaks(small)
