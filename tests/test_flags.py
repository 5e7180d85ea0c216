"""The shared engine flags: every SchedulerConfig field survives config -> flags -> config, so
a process started from flags runs exactly the config it was given."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from messages.sampling import StructuredOutputsBackend
from services.cli import build_parser
from services.common.config import KVAdmission, KVLayout, SchedulerConfig
from services.common.flags import add_engine_flags, engine_args, scheduler_config_from_args
from services.launcher import service_processes
from services.runtime.service import PARENT_PID_ENV

pytestmark = pytest.mark.unit


def _configs() -> st.SearchStrategy[SchedulerConfig]:
    return st.builds(
        SchedulerConfig,
        max_num_seqs=st.integers(1, 512),
        max_num_batched_tokens=st.integers(1, 8192),
        prefill_chunk_size=st.integers(1, 1024),
        split_prefill=st.booleans(),
        wavefront_chunked_prefill=st.booleans(),
        block_size=st.integers(1, 64),
        num_blocks=st.integers(1, 100_000),
        kv_layout=st.just(KVLayout.LAST_EXITED),
        refill=st.booleans(),
        enable_prefix_caching=st.booleans(),
        share_inflight_prefill=st.booleans(),
        async_scheduling=st.booleans(),
        max_inflight_batches=st.integers(1, 8),
        kv_admission=st.sampled_from(list(KVAdmission)),
        kv_watermark=st.floats(0.0, 1.0),
        max_admission_bypasses=st.integers(0, 16),
        structured_outputs_backend=st.sampled_from(list(StructuredOutputsBackend)),
        speculative_tokens=st.integers(0, 16),
        draft_loops=st.integers(1, 3),
        kv_cache_dtype=st.sampled_from(["auto", "fp8", "int4-delta"]),
        kv_int4_anchor_every=st.integers(0, 4),
    )


@settings(max_examples=50, deadline=None)
@given(config=_configs())
def test_config_round_trips_through_the_flags(config: SchedulerConfig) -> None:
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    back = scheduler_config_from_args(parser.parse_args(engine_args(config)))
    assert dataclasses.asdict(back) == dataclasses.asdict(config)


def test_rlt_up_children_run_the_deployment_they_were_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``rlt up``'s `rlt service` children: a worker and a scheduler per shard, each parsed
    by the real CLI back to rlt up's config, shard and router; their own credentials in the
    environment (none of the shell's), never on the command line; each its own folder for
    its identity file."""
    monkeypatch.setenv("RLT_NATS_CREDS", "/home/me/operator.creds")
    monkeypatch.setenv("RLT_NATS_TOKEN", "the-shells-token")
    monkeypatch.setenv("RLT_NATS_PASSWORD_FILE", "/run/secrets/mine")
    config = SchedulerConfig(max_num_seqs=7, enable_prefix_caching=True, async_scheduling=True)
    children = service_processes(
        "nats://127.0.0.1:4222",
        tmp_path / "ckpt",
        config,
        tmp_path / "run",
        dtype="bfloat16",
        shards=2,
        router="least-loaded",
        url_for=lambda name: f"nats://{name}:s3cret@127.0.0.1:4222",
    )
    keys = [(c.name, c.run_dir.name) for c in children]
    assert keys == [
        ("worker", "worker-0"),
        ("worker", "worker-1"),
        ("prefix-cache", "prefix-cache"),
        ("scheduler", "scheduler-0"),
        ("scheduler", "scheduler-1"),
        ("admission", "admission"),
    ]
    parser = build_parser()
    for child in children:
        argv = child.command()
        assert argv[:3] == [sys.executable, "-m", "services.cli"] and "s3cret" not in argv
        args = parser.parse_args(argv[3:])
        assert args.name == child.name and args.nats_url == "nats://127.0.0.1:4222"
        assert (child.env["RLT_NATS_USER"], child.env["RLT_NATS_PASSWORD"]) == (
            child.name,
            "s3cret",
        )
        assert not {"RLT_NATS_CREDS", "RLT_NATS_TOKEN", "RLT_NATS_PASSWORD_FILE"} & set(child.env)
        assert child.env["RLT_RUN_DIR"] == str(child.run_dir) and child.run_dir.is_dir()
        assert child.env[PARENT_PID_ENV] == str(os.getpid())
        back = scheduler_config_from_args(args)
        assert dataclasses.asdict(back) == dataclasses.asdict(config)
        assert args.dtype == "bfloat16"
        if child.name in ("worker", "scheduler"):
            assert args.shard == child.run_dir.name.rsplit("-", 1)[1]
        if child.name == "prefix-cache":
            assert args.checkpoint is None
        else:
            assert args.checkpoint == str(tmp_path / "ckpt")
        if child.name == "admission":
            assert args.router == "least-loaded"
    with pytest.raises(ValueError, match="--shards must be >= 1"):
        service_processes("nats://x:1", tmp_path, config, tmp_path, shards=0)


def test_a_negative_int4_anchor_interval_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="kv_int4_anchor_every"):
        SchedulerConfig(kv_cache_dtype="int4-delta", kv_int4_anchor_every=-1)
