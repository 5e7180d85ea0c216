"""Which kernel each op runs on CUDA, chosen once at start from what this machine does.

* ``rlt::sample``: the Triton sampler where it draws the torch reference's tokens and bad
  flags on a probe batch here (bf16-rounded logits with many ties, every filter), else the
  reference. The contract is the same tokens bit for bit, so any difference keeps the
  reference.
* ``rlt::paged_attention`` decode passes: flash-attn 4 where it imports, agrees with the
  reference within the Triton kernel's tolerance and is at least ``MIN_SPEEDUP`` times
  faster than the Triton decode kernel on the model's shape; else the Triton kernel (which
  stays the reference's stand-in and the fallback). ``RLT_FLASH_ATTN=0`` skips the probe
  (its compilation takes seconds) and keeps the Triton kernel.

``select_backends`` returns what it chose and why, for the caller to log. On a CPU nothing is
chosen: the CPU ops are the torch references.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from kernels.ops import attention, sample
from kernels.ops._triton import triton_available
from kernels.ops.attention_flash import MIN_SPEEDUP, flash_version, varlen_function
from kernels.ops.paged_case import PagedDecodeCase, paged_decode_case

# the tolerance the Triton attention kernels are held to against the reference in bf16
BF16_TOLERANCE = 3e-2


@dataclass(frozen=True)
class Choice:
    op: str
    backend: str
    reason: str


def select_backends(
    device: torch.device,
    *,
    vocab_size: int,
    num_heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
) -> list[Choice]:
    """Chooses and installs each op's CUDA backend (start-up, before graphs are captured).
    A second call for the same device and shapes returns the first one's choices (they stay
    installed): a worker's runners are rebuilt, the machine is the same."""
    if device.type != "cuda":
        return []
    key = (str(device), vocab_size, num_heads, kv_heads, head_dim, block_size, dtype)
    if key not in _chosen:
        _chosen.clear()  # another shape's choices are not installed any more
        _chosen[key] = [
            select_sampler(device, vocab_size),
            select_decode_attention(device, num_heads, kv_heads, head_dim, block_size, dtype),
        ]
    return _chosen[key]


_chosen: dict[tuple[object, ...], list[Choice]] = {}


def sampler_probe(vocab_size: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """64 rows over the whole vocabulary: greedy, plain sampled, top-k, top-p and both, bf16
    logits (ties), a row of one value and -inf logits."""
    gen = torch.Generator().manual_seed(7)
    rows = 64
    logits = (torch.randn(rows, vocab_size, generator=gen) * 4).to(torch.bfloat16).float()
    logits[1] = 0.5
    logits[2, ::2] = float("-inf")
    temperature = torch.tensor([0.0, 0.8, 1.0, 0.5] * 16, dtype=torch.float32)
    top_k = torch.tensor([0, 40, 1, vocab_size - 1] * 16, dtype=torch.int32)
    top_p = torch.tensor([1.0] * 4 + [0.9] * 4 + [0.5] * 4 + [0.999999] * 4, dtype=torch.float32)
    top_p = top_p.repeat(4)
    seed = torch.randint(-(2**62), 2**62, (rows,), generator=gen)
    index = torch.randint(0, 2**31, (rows,), generator=gen)
    args = (logits, temperature, top_k, top_p, seed, index)
    return tuple(t.to(device) for t in args)


def select_sampler(device: torch.device, vocab_size: int) -> Choice:
    sample.use_triton_on_cuda(False)
    if not triton_available():
        return Choice("sample", "torch", "triton does not import")
    args = sampler_probe(vocab_size, device)
    try:
        got = sample.sample_triton(*args)
    except Exception as exc:
        return Choice("sample", "torch", f"the Triton sampler failed: {exc!r}"[:300])
    want = sample.sample_reference(*args, filters=True)
    differ = int((got[0] != want[0]).sum()) + int((got[1] != want[1]).sum())
    if differ:
        return Choice(
            "sample",
            "torch",
            f"the Triton sampler differs from the reference on {differ} of 64 probe rows",
        )
    sample.use_triton_on_cuda(True)
    return Choice("sample", "triton", "same tokens and bad rows as the reference on 64 probe rows")


def time_ms(fn, repeats: int = 20) -> float:  # type: ignore[no-untyped-def]
    """Median milliseconds of ``fn()`` on the current CUDA stream (CUDA events)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def compare_flash(case: PagedDecodeCase) -> tuple[float, float, float]:
    """(max error of flash-attn against the reference relative to 1 + |reference|, Triton
    ms, flash-attn ms) on one case."""
    from kernels.ops import attention_flash

    want = attention.paged_attention_reference(*case.args(), split_decode=False).float()
    got = attention_flash.paged_decode(*case.args()).float()
    error = float(((got - want).abs() / (1 + want.abs())).max())
    triton_ms = time_ms(lambda: attention.paged_attention_triton(*case.args()))
    flash_ms = time_ms(lambda: attention_flash.paged_decode(*case.args()))
    return error, triton_ms, flash_ms


def replays_in_a_graph(case: PagedDecodeCase) -> bool:
    """Whether flash-attn, captured in a CUDA graph as the static decode passes capture it,
    replays to its eager output (a capture that fails raises: then it is not chosen, rather
    than failing the runner's capture at start)."""
    from kernels.ops import attention_flash

    want = attention_flash.paged_decode(*case.args())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        attention_flash.paged_decode(*case.args())
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = attention_flash.paged_decode(*case.args())
    got.zero_()
    graph.replay()
    torch.cuda.synchronize()
    return bool(torch.equal(got, want))


def select_decode_attention(
    device: torch.device,
    num_heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
) -> Choice:
    attention.use_flash_decode(None)
    if not triton_available():
        return Choice("paged_attention", "torch", "triton does not import")
    if os.environ.get("RLT_FLASH_ATTN") == "0":
        return Choice("paged_attention", "triton", "flash-attn turned off (RLT_FLASH_ATTN=0)")
    if varlen_function() is None:
        return Choice("paged_attention", "triton", "flash-attn 4 does not import")
    version = flash_version()
    t0 = time.perf_counter()
    try:
        worst, slowest = 0.0, float("inf")
        for rows, context in ((1, 4096), (32, 1024)):
            case = paged_decode_case(
                rows, context, num_heads, kv_heads, head_dim, block_size, dtype, device
            )
            error, triton_ms, flash_ms = compare_flash(case)
            worst = max(worst, error)
            slowest = min(slowest, triton_ms / flash_ms)
        replays = replays_in_a_graph(case)
    except Exception as exc:
        return Choice("paged_attention", "triton", f"flash-attn {version} failed: {exc!r}"[:300])
    seconds = time.perf_counter() - t0
    facts = (
        f"flash-attn {version}: error {worst:.2g}, {slowest:.2f}x the Triton kernel "
        f"({seconds:.1f} s)"
    )
    if worst > BF16_TOLERANCE:
        return Choice("paged_attention", "triton", f"{facts}: not exact")
    if slowest < MIN_SPEEDUP:
        return Choice("paged_attention", "triton", f"{facts}: under {MIN_SPEEDUP}x")
    if not replays:
        return Choice("paged_attention", "triton", f"{facts}: a CUDA graph replays it wrong")
    attention.use_flash_decode(dtype)
    return Choice("paged_attention", "flash_attn_4", facts)
