"""The device check's kernel sections (``scripts/device_check.py`` runs them): memory
bandwidth and the kernels alone, away from the engine.

* ``copy``: the device's copy bandwidth (bytes read + written per second), measured in the
  same run, so every bandwidth share in the report reads right on an H100 and an H200 alike.
* ``attention``: decode attention alone on synthetic paged KV (each row's context in
  shuffled blocks) at the model's shape: the Triton split kernel against the same kernel
  with one split and against the torch reference, its error, and its bandwidth share.
* ``sampler``: the sampler alone over the model's vocabulary, rows that all filter
  (temperature 0.8, top-p 0.9, top-k 40): the Triton kernel against the torch reference
  (same tokens required) and against a greedy pass's argmax.
* ``flash_attn``: flash-attn 4 on attention cases where its carried wheels import, and the
  decode backend the worker would choose at start (``kernels.ops.backends``).

On a CPU (``--quick``) the Triton kernels run under the interpreter: the numbers are not
speeds, the errors and tokens are still checked.
"""

from __future__ import annotations

import importlib

import torch

from scripts.device_check_common import Child, free_device, median_ms, share_of_copy

BLOCK_SIZE = 16
# the Triton attention kernels' tolerance against the reference in bf16
TOLERANCE = 3e-2


def section_copy(c: Child) -> None:
    n = c.plan.copy_mib * 2**20
    src = torch.ones(n // 4, dtype=torch.float32, device=c.device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), c.device, c.plan.repeats)
    bytes_per_s = 2 * n / (ms / 1e3)
    c.res.add(
        "copy",
        f"{c.plan.copy_mib} MiB {c.device} copy",
        f"{bytes_per_s / 1e12:.3f} TB/s",
        f"bytes read + written / the median of {c.plan.repeats} copies ({ms:.3f} ms): "
        "the bandwidth every later share in this report is of",
        bytes_per_s=bytes_per_s,
    )


def _shape(c: Child) -> tuple[int, int, int]:
    from services.worker.model.toy import toy_config

    cfg = toy_config(c.plan.shape)
    return cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim


def _pool_bytes(c: Child) -> int:
    return int(c.plan.kv_pool_gib * 2**30)


def _max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got.float() - want.float()).abs() / (1 + want.float().abs())).max())


def _time_attention(args: tuple, c: Child) -> tuple[float, float, float, float]:
    """(max error against the reference, then the median ms of the Triton split kernel, the
    same kernel with one split, and the torch reference) on one case's arguments."""
    from kernels.ops import attention

    want = attention.paged_attention_reference(*args, split_decode=False)
    error = _max_error(attention.paged_attention_triton(*args), want)
    repeats = c.plan.repeats
    split_ms = median_ms(lambda: attention.paged_attention_triton(*args), c.device, repeats)
    one_ms = median_ms(
        lambda: attention.paged_attention_triton(*args, num_splits=1), c.device, repeats
    )
    ref_ms = median_ms(
        lambda: attention.paged_attention_reference(*args, split_decode=False), c.device, repeats
    )
    return error, split_ms, one_ms, ref_ms


def section_attention(c: Child) -> None:
    from kernels.ops._triton import decode_splits, num_sms
    from kernels.ops.paged_case import paged_decode_case

    num_heads, kv_heads, head_dim = _shape(c)
    interpreted = c.device.type != "cuda"
    for rows, context in c.plan.attention_cases:
        label = f"{rows} row{'s' if rows > 1 else ''} x {context}"
        if c.out_of_time("attention", label):
            continue
        try:
            case = paged_decode_case(
                rows,
                context,
                num_heads,
                kv_heads,
                head_dim,
                BLOCK_SIZE,
                torch.bfloat16,
                c.device,
                seed=rows * context,
                max_pool_bytes=_pool_bytes(c),
            )
            error, split_ms, one_ms, ref_ms = _time_attention(case.args(), c)
        except Exception as exc:
            c.res.error("attention", label, exc)
            continue
        finally:
            free_device(c.device)
        splits = decode_splits(rows, num_heads, num_sms(c.device))
        bytes_per_s = case.kv_bytes() / (split_ms / 1e3)
        c.res.add(
            "attention",
            label,
            f"{split_ms * 1e3:.1f} us",
            f"Triton, {splits} splits: {bytes_per_s / 1e9:.1f} GB/s of K/V, "
            f"{share_of_copy(bytes_per_s, c.copy_bytes_per_s)}; one split {one_ms * 1e3:.1f} us "
            f"({one_ms / split_ms:.2f}x the split kernel's time); torch reference "
            f"{ref_ms * 1e3:.1f} us ({ref_ms / split_ms:.2f}x); max error {error:.2g} "
            f"(tolerance {TOLERANCE:g}); "
            f"bf16, {num_heads} heads of {head_dim}, shuffled blocks of {BLOCK_SIZE}"
            + ("; rows share blocks (pool capped)" if case.aliased else "")
            + ("; CPU interpreter: not a speed" if interpreted else ""),
            failed=error > TOLERANCE,
            rows=rows,
            context=context,
            us=split_ms * 1e3,
            one_split_us=one_ms * 1e3,
            reference_us=ref_ms * 1e3,
            bytes_per_s=bytes_per_s,
            error=error,
        )


def _sampler_args(rows: int, vocab: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Every row sampled with the issue's filters; bf16-rounded logits (ties)."""
    gen = torch.Generator().manual_seed(rows)
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(torch.bfloat16).float()
    return tuple(
        t.to(device)
        for t in (
            logits,
            torch.full((rows,), 0.8),
            torch.full((rows,), 40, dtype=torch.int32),
            torch.full((rows,), 0.9),
            torch.randint(0, 2**62, (rows,), generator=gen),
            torch.arange(rows, dtype=torch.int64),
        )
    )


def _time_sampler(args: tuple, c: Child) -> tuple[bool, float, float, float]:
    """(same tokens and bad rows, Triton ms, reference ms, greedy argmax ms)."""
    sample = importlib.import_module("kernels.ops.sample")

    got = sample.sample_triton(*args)
    want = sample.sample_reference(*args, filters=True)
    same = bool(torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]))
    repeats = c.plan.repeats
    logits = args[0]
    triton_ms = median_ms(lambda: sample.sample_triton(*args), c.device, repeats)
    ref_ms = median_ms(lambda: sample.sample_reference(*args, filters=True), c.device, repeats)
    greedy_ms = median_ms(
        lambda: (torch.argmax(logits, dim=-1), torch.isnan(logits).any(dim=-1)), c.device, repeats
    )
    return same, triton_ms, ref_ms, greedy_ms


def section_sampler(c: Child) -> None:
    from services.worker.model.toy import toy_config

    vocab = toy_config(c.plan.shape).vocab_size
    interpreted = c.device.type != "cuda"
    for rows in c.plan.sampler_rows:
        label = f"{rows} row{'s' if rows > 1 else ''} x {vocab}, t 0.8 / p 0.9 / k 40"
        if c.out_of_time("sampler", label):
            continue
        try:
            same, triton_ms, ref_ms, greedy_ms = _time_sampler(
                _sampler_args(rows, vocab, c.device), c
            )
        except Exception as exc:
            c.res.error("sampler", label, exc)
            continue
        c.res.add(
            "sampler",
            label,
            f"{triton_ms * 1e3:.1f} us",
            ("same tokens as the reference" if same else "MISMATCH with the reference")
            + f"; torch reference {ref_ms * 1e3:.1f} us ({ref_ms / triton_ms:.2f}x the kernel's "
            f"time); a greedy pass's argmax {greedy_ms * 1e3:.1f} us"
            + ("; CPU interpreter: not a speed" if interpreted else ""),
            failed=not same,
            rows=rows,
            us=triton_ms * 1e3,
            reference_us=ref_ms * 1e3,
            greedy_us=greedy_ms * 1e3,
        )


def section_flash_attn(c: Child) -> None:
    from kernels.ops import backends
    from kernels.ops.attention_flash import MIN_SPEEDUP, flash_version, varlen_function
    from kernels.ops.paged_case import paged_decode_case

    if c.device.type != "cuda":
        c.res.add("flash_attn", "flash-attn 4", "not run", "needs CUDA (Hopper or Blackwell)")
        return
    if varlen_function() is None:
        c.res.add(
            "flash_attn",
            "flash-attn 4",
            "not installed",
            "its wheels were not carried (scripts/device_wheels.sh): the Triton kernel is the "
            "decode backend",
        )
        return
    num_heads, kv_heads, head_dim = _shape(c)
    for rows, context in ((1, 8192), (32, 2048)):
        label = f"{rows} row{'s' if rows > 1 else ''} x {context}"
        if c.out_of_time("flash_attn", label):
            return
        try:
            case = paged_decode_case(
                rows,
                context,
                num_heads,
                kv_heads,
                head_dim,
                BLOCK_SIZE,
                torch.bfloat16,
                c.device,
                max_pool_bytes=_pool_bytes(c),
            )
            error, triton_ms, flash_ms = backends.compare_flash(case)
        except Exception as exc:
            c.res.error("flash_attn", label, exc)
            continue
        finally:
            free_device(c.device)
        speedup = triton_ms / flash_ms
        bytes_per_s = case.kv_bytes() / (flash_ms / 1e3)
        c.res.add(
            "flash_attn",
            label,
            f"{flash_ms * 1e3:.1f} us",
            f"flash-attn {flash_version()}: {speedup:.2f}x the Triton split kernel "
            f"({triton_ms * 1e3:.1f} us); {share_of_copy(bytes_per_s, c.copy_bytes_per_s)}; "
            f"max error {error:.2g}; chosen where exact and >= {MIN_SPEEDUP}x",
            rows=rows,
            context=context,
            speedup=speedup,
            error=error,
        )
    choice = backends.select_decode_attention(
        c.device, num_heads, kv_heads, head_dim, BLOCK_SIZE, torch.bfloat16
    )
    c.res.add("flash_attn", "start-up choice", choice.backend, choice.reason)
