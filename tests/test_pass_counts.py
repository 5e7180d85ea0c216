"""What a GPU would pay per core pass, counted on the CPU: kernel-launching torch ops (a
``TorchDispatchMode`` over the in-process engine; view ops launch nothing and are not
counted) and host/device copies (every one goes through ``Transfer``).

32 requests decode at fixed depth; ops per layer and outside the layers come from the same
workload on a 2-layer and a 4-layer model: (ops4 - ops2) / 2 per layer."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from messages.sampling import SamplingParams
from services.common.config import SchedulerConfig
from services.engine.engine import LLMEngine
from services.worker.model.ouro import OuroModel
from services.worker.model.toy import random_weights, toy_config
from services.worker.passes.static_decode import DecodeMode

pytestmark = pytest.mark.unit

NUM_REQUESTS = 32
MAX_OPS_PER_LAYER = 12
MAX_OPS_OUTSIDE_LAYERS = 30
# ops that wait for the device (a host read of a device value)
_SYNC_OPS = {"aten._local_scalar_dense.default", "aten.item.default", "aten.nonzero.default"}


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if not func.is_view or not _aliases(out, args[0]):
            # a "view" that made new memory (``.to(dtype)`` under inference mode) copied
            self.ops[str(func)] += 1
        return out


def _aliases(out: object, source: object) -> bool:
    if not isinstance(out, torch.Tensor) or not isinstance(source, torch.Tensor):
        return False
    return out.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()


def _model(layers: int) -> OuroModel:
    cfg = replace(toy_config("toy"), num_hidden_layers=layers)
    return OuroModel(cfg, dict(random_weights(cfg)))


def _decode_counts(layers: int, mode: DecodeMode) -> tuple[Counter[str], int, int, int]:
    """(ops, passes, copies to the device, copies to the host) over decode-only steps."""
    config = SchedulerConfig(block_size=4, num_blocks=1024, max_num_seqs=64)
    engine = LLMEngine(_model(layers), config, decode_mode=mode)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, exit_threshold=1.0)
    for i in range(NUM_REQUESTS):
        engine.add_request(f"r{i}", [1 + i, 2 + i, 3], params)
    for _ in range(12):  # every prompt through prefill: only decode rows from here on
        engine.step()
    runner = engine.runner
    passes0, copies0 = runner.stats.core_passes, runner.transfer.counts
    to_device0, to_host0 = copies0.to_device, copies0.to_host
    with OpCounter() as counter:
        for _ in range(8):
            engine.step()
    passes = runner.stats.core_passes - passes0
    counts = runner.transfer.counts
    return counter.ops, passes, counts.to_device - to_device0, counts.to_host - to_host0


@pytest.mark.parametrize("mode", [DecodeMode.EAGER, DecodeMode.PADDED])
def test_ops_per_layer_and_outside_the_layers_meet_their_bounds(mode: DecodeMode) -> None:
    ops2, passes2, to_device, to_host = _decode_counts(2, mode)
    ops4, passes4, *_ = _decode_counts(4, mode)
    assert passes2 == passes4 > 0
    total2, total4 = sum(ops2.values()), sum(ops4.values())
    per_layer = (total4 - total2) / (2 * passes2)
    outside = total2 / passes2 - 2 * per_layer
    assert per_layer <= MAX_OPS_PER_LAYER, (per_layer, ops4 - ops2)
    assert outside <= MAX_OPS_OUTSIDE_LAYERS, (outside, ops2)
    # the fused ops are what the layers run
    for op in ("rlt.rope_write_kv", "rlt.paged_attention", "rlt.add_rms_norm", "rlt.silu_mul"):
        assert any(name.startswith(op) for name in ops2), (op, ops2)
    # at most one wait for the device per pass: one copy to the host per batch
    assert to_host <= passes2
    assert to_device <= passes2
    assert not _SYNC_OPS & set(ops2), ops2


def test_padded_decode_pass_runs_through_static_buckets() -> None:
    config = SchedulerConfig(block_size=4, num_blocks=256, max_num_seqs=8)
    engine = LLMEngine(_model(2), config, decode_mode=DecodeMode.PADDED)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.generate([[1, 2, 3], [4, 5], [6]], params)
    static = engine.runner.static
    assert static is not None and static.replays > 0
    # buckets that ran: powers of two holding 1..3 rows
    assert {bucket for bucket, _ in static._static} <= {1, 2, 4}


def test_exit_rule_op_equals_the_host_rule_bit_for_bit() -> None:
    from kernels.ops import exit_rule
    from services.common.exit_policy import should_exit, update_survival

    g = torch.Generator().manual_seed(0)
    n = 4096
    gates = torch.randn(n, generator=g) * 4
    remaining = torch.rand(n, generator=g)
    loops = torch.randint(1, 5, (n,), generator=g, dtype=torch.int32)
    low = torch.randint(1, 5, (n,), generator=g, dtype=torch.int32)
    high = torch.randint(1, 5, (n,), generator=g, dtype=torch.int32)
    threshold = torch.rand(n, generator=g)
    threshold[::7] = 1.0
    forced = torch.where(
        torch.rand(n, generator=g) < 0.1,
        torch.randint(1, 5, (n,), generator=g, dtype=torch.int32),
        torch.zeros(n, dtype=torch.int32),
    )
    survived = update_survival(remaining, gates)
    # values exactly at the threshold: the comparison is >=
    threshold[1::5] = (1.0 - survived[1::5]).to(torch.float32)
    got_survived, got_exit = exit_rule(gates, remaining, loops, low, high, threshold, forced)
    assert torch.equal(got_survived, survived)
    for i in range(n):
        if forced[i] > 0:
            want = int(loops[i]) >= int(forced[i])
        else:
            want = should_exit(
                int(loops[i]), float(survived[i]), int(low[i]), int(high[i]), float(threshold[i])
            )
        assert bool(got_exit[i]) == want, i


# ------------------------------------------------------------------ the coda and the sampler


class LmHeadReads(TorchDispatchMode):
    """Ops that read the lm_head's memory (its matmul; views of it launch nothing)."""

    def __init__(self, lm_head: torch.Tensor) -> None:
        super().__init__()
        self.ptr = lm_head.untyped_storage().data_ptr()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if not func.is_view and any(
            isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == self.ptr for a in args
        ):
            self.reads += 1
        return out


def _may_exit(live, params: SamplingParams) -> bool:  # type: ignore[no-untyped-def]
    """The exit rule's host side, written out: whether a row may exit at the loop it runs."""
    loops = live.depth + 1
    if loops >= (live.row.max_loops or params.max_loops or 4):
        return True
    return params.exit_threshold < 1.0 and loops >= params.min_loops


def _coda_per_pass(mode: DecodeMode) -> list[tuple[bool, int]]:
    """(some row may exit, lm_head reads) of every decode-only pass: rows at mixed depths,
    some that may exit from loop 3 on, some only at loop 4."""
    config = SchedulerConfig(block_size=4, num_blocks=512, max_num_seqs=16)
    engine = LLMEngine(_model(2), config, decode_mode=mode)
    runner = engine.runner
    params = {}
    passes: list[tuple[bool, int]] = []
    run_pass = runner._run_pass

    def counted(active, first_pass):  # type: ignore[no-untyped-def]
        may = any(_may_exit(live, params[live.row.request_id]) for live in active)
        with LmHeadReads(runner.model.lm_head) as reads:
            out = run_pass(active, first_pass)
        if all(live.is_decode for live in active):
            passes.append((may, reads.reads))
        return out

    runner._run_pass = counted  # type: ignore[method-assign]
    for i in range(8):  # arrivals one step apart: their loops interleave
        p = SamplingParams(
            max_tokens=6,
            temperature=0.0,
            ignore_eos=True,
            min_loops=3,
            exit_threshold=0.5 if i % 2 else 1.0,
        )
        params[f"r{i}"] = p
        engine.add_request(f"r{i}", [1 + i, 2, 3 + i], p)
        engine.step()
    engine.run_until_done()
    return passes


@pytest.mark.parametrize("mode", [DecodeMode.EAGER, DecodeMode.PADDED])
def test_the_coda_runs_at_most_once_per_loop_where_a_row_may_exit(mode: DecodeMode) -> None:
    passes = _coda_per_pass(mode)
    assert all(reads <= 1 for _, reads in passes), passes
    # no lm_head read at a loop below every row's min_loops (and below fixed depth)
    assert all(reads == 0 for may, reads in passes if not may), passes
    assert sum(not may for may, _ in passes) >= 4 and sum(reads for _, reads in passes) >= 4


def _ops_per_coda_pass(mode: DecodeMode, sampled: bool) -> tuple[float, int]:
    """Kernel-launching ops over the decode passes, and how many passes ran the coda."""
    config = SchedulerConfig(block_size=4, num_blocks=1024, max_num_seqs=64)
    engine = LLMEngine(_model(2), config, decode_mode=mode)
    params = SamplingParams(
        max_tokens=40,
        ignore_eos=True,
        exit_threshold=1.0,
        **(
            {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 3}
            if sampled
            else {"temperature": 0.0}
        ),
    )
    for i in range(NUM_REQUESTS):
        engine.add_request(f"r{i}", [1 + i, 2 + i, 3], params)
    for _ in range(12):
        engine.step()
    runner = engine.runner
    passes0 = runner.stats.core_passes
    with OpCounter() as counter, LmHeadReads(runner.model.lm_head) as reads:
        for _ in range(8):
            engine.step()
    assert runner.stats.core_passes - passes0 == 8
    return sum(counter.ops.values()), reads.reads


@pytest.mark.parametrize("mode", [DecodeMode.EAGER, DecodeMode.PADDED])
def test_sampled_rows_add_at_most_four_ops_per_pass_over_greedy(mode: DecodeMode) -> None:
    greedy, coda_greedy = _ops_per_coda_pass(mode, sampled=False)
    sampled, coda_sampled = _ops_per_coda_pass(mode, sampled=True)
    assert coda_greedy == coda_sampled > 0  # the same passes, the same codas
    assert (sampled - greedy) / coda_sampled <= 4, (sampled, greedy, coda_sampled)
