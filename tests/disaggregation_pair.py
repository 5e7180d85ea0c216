"""Two in-process engines as a prefill and a decode shard: the prefill engine runs each
prompt and its first token and hands the request over, the decode engine pulls the prompt's
KV (every plane) from the prefill engine's runner with NIXL (two agents, real READs) and
decodes. Shared by the disaggregation tests."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from messages.api import FinishedEvent, TokenEvent
from messages.batch import BatchResult
from messages.kv_transfer import KVPull, KVPullResult
from messages.sampling import SamplingParams
from services.common.config import KVLayout, SchedulerConfig
from services.engine.engine import LLMEngine
from services.engine.executor import InProcessExecutor
from services.scheduler.core.intake import KnownOutputs
from services.worker.kv_transfer.agent import KVTransferAgent
from services.worker.kv_transfer.pulls import arena_of, num_planes

_names = itertools.count()
SHARED_PREFIX = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3]
PROMPTS = {
    "a": [5, 9, 33, 71, 2, 18, 40, 41, 42, 43, 44],
    "b": [101, 7, 7, 250],
    "c": [*SHARED_PREFIX, 44, 45, 46],
    "d": [*SHARED_PREFIX, 60, 61, 62, 63, 64, 65],
    "e": [11] * 23,
}


class PullingExecutor(InProcessExecutor):
    """Runs each batch's pulls (NIXL READs from the prefill runner) before its rows, as the
    worker does once every earlier batch ran; ``fail`` makes them fail instead."""

    def __init__(self, runner, agent: KVTransferAgent, source: KVTransferAgent) -> None:
        super().__init__(runner)
        self.agent, self.source = agent, source
        self.fail = False
        self.unconfirmed = False  # a failed pull's abort NIXL could not confirm
        self.done: list[KVPullResult] = []
        self.bytes = 0
        self.source_runner = None  # the prefill engine's runner (set by ``Pair.build``)

    def take_results(self) -> list[BatchResult]:
        if self._queued:
            for pull in self._queued[0].wire.kv_pulls:
                self.done.append(self._pull(pull))
        return super().take_results()

    def _pull(self, pull: KVPull) -> KVPullResult:
        if self.fail:
            return KVPullResult(
                transfer_id=pull.transfer_id, request_id=pull.request_id, ok=False,
                cause="timeout", abort_unconfirmed=self.unconfirmed,
            )  # fmt: skip
        source_int4 = getattr(self.source_runner, "int4", None)
        if source_int4 is not None:  # only sealed blocks move: their codes are final
            assert source_int4.store.sealed[pull.remote_blocks].all(), pull.remote_blocks
        moved = self.agent.read(
            self.source.source_info(), pull.remote_blocks, pull.local_blocks, 10.0
        )
        self.bytes += moved
        return KVPullResult(
            transfer_id=pull.transfer_id, request_id=pull.request_id, ok=True, num_bytes=moved
        )


@dataclass
class Pair:
    prefill: LLMEngine
    decode: LLMEngine
    executor: PullingExecutor
    release_held: bool = True  # False: the prefill side let the handoff go (expired)
    events: list = field(default_factory=list)
    handed_off: int = 0
    pulled: int = 0
    unused: int = 0  # handoffs the decode side released without reading them

    @classmethod
    def build(
        cls, model, config: SchedulerConfig, decode_config: SchedulerConfig | None = None
    ) -> Pair:
        """``decode_config``: the decode engine's, when its server defaults differ."""
        prefill, decode = LLMEngine(model, config), LLMEngine(model, decode_config or config)
        planes = num_planes(str(config.kv_layout), model.cfg.total_ut_steps)
        agents = []
        for engine in (prefill, decode):
            agent = KVTransferAgent(f"test-{next(_names)}")
            arena = arena_of(engine.runner)
            agent.register(arena, "e", arena.layout(str(config.kv_layout), planes))
            agents.append(agent)
        executor = PullingExecutor(decode.runner, agents[1], agents[0])
        executor.source_runner = prefill.runner
        decode.core.executor = executor
        return cls(prefill, decode, executor)

    def add(self, rid: str, prompt: list[int], params: SamplingParams) -> None:
        self.prefill.core.add_request(rid, prompt, params, hand_off=True)

    def run(self) -> None:
        for _ in range(20_000):
            if not (
                self.prefill.has_unfinished_requests() or self.decode.has_unfinished_requests()
            ):
                return
            self.events += self.prefill.step()
            self._hand_over()
            self.events += self.decode.step()
            self._confirm()
        raise AssertionError("no progress")

    def _hand_over(self) -> None:
        scheduler = self.prefill.scheduler
        for request in list(scheduler.handoffs.due()):
            handoff = scheduler.handoffs.hand_off(
                request,
                shard_id="p",
                worker_id="wp",
                worker_epoch="e",
                block_format=scheduler.block_format,
                now=0.0,
            )
            self.prefill.core.outputs.forget(request.request_id)
            known = KnownOutputs(list(request.output_token_ids), list(request.output_exit_loops))
            self.handed_off += 1
            self.events += self.decode.core.add_request(
                request.request_id,
                request.prompt_token_ids,
                request.params,
                known_outputs=known,
                kv_source=handoff,
            )

    def _confirm(self) -> None:
        pulls = self.decode.scheduler.pulls
        for result in self.executor.done:
            handoff = pulls.pulled(result)
            assert handoff is not None
            held = self.prefill.scheduler.handoffs.release(handoff.handoff_id)
            if result.ok:
                self.pulled += pulls.confirmed(result.transfer_id, held and self.release_held)
        self.executor.done.clear()
        for handoff in self.decode.scheduler.take_unused_handoffs():  # as the service does
            self.unused += 1
            self.prefill.scheduler.handoffs.release(handoff.handoff_id)

    def finished(self) -> dict[str, FinishedEvent]:
        return {e.request_id: e for e in self.events if isinstance(e, FinishedEvent)}

    def check_no_leaks(self, config: SchedulerConfig) -> None:
        for engine in (self.prefill, self.decode):
            kv = engine.scheduler.kv
            kv.check_consistency()
            assert kv.num_free_blocks == config.num_blocks
        assert len(self.prefill.scheduler.handoffs) == 0
        assert len(self.decode.scheduler.pulls) == 0


def colocated(model, config: SchedulerConfig, requests) -> dict[str, FinishedEvent]:
    engine = LLMEngine(model, config)
    for rid, prompt, params in requests:
        engine.core.add_request(rid, prompt, params)
    return {e.request_id: e for e in engine.run_until_done() if isinstance(e, FinishedEvent)}


def workload(params: SamplingParams) -> list[tuple[str, list[int], SamplingParams]]:
    return [(rid, prompt, params) for rid, prompt in PROMPTS.items()]


GREEDY_EXIT = SamplingParams(
    max_tokens=9, temperature=0.0, min_loops=1, exit_threshold=0.6, ignore_eos=True
)

CONFIGS = {
    "wcpb-async-prefix": SchedulerConfig(
        block_size=4, num_blocks=160, max_num_batched_tokens=8, prefill_chunk_size=4,
        enable_prefix_caching=True,
    ),
    "atomic-sync": SchedulerConfig(
        block_size=4, num_blocks=160, split_prefill=False, async_scheduling=False
    ),
    "shared-layout": SchedulerConfig(
        block_size=4, num_blocks=160, kv_layout=KVLayout.SHARED, prefill_chunk_size=5
    ),
    # the decode shard speculates (the prefill shard hands off after the first token)
    "speculative-decode": SchedulerConfig(
        block_size=4, num_blocks=160, speculative_tokens=3, draft_loops=2
    ),
}  # fmt: skip


def compare(pair: Pair, expected: dict[str, FinishedEvent]) -> None:
    got = pair.finished()
    assert set(got) == set(expected)
    for rid, want in expected.items():
        assert (got[rid].token_ids, got[rid].exit_depths) == (want.token_ids, want.exit_depths)
        streamed = [e for e in pair.events if isinstance(e, TokenEvent) and e.request_id == rid]
        assert [e.index for e in streamed] == list(range(len(want.token_ids)))  # each once
