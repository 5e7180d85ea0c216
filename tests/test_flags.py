"""The shared engine flags: every SchedulerConfig field survives config -> flags -> config, so
a process started from flags runs exactly the config it was given."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.config import KVAdmission, KVLayout, SchedulerConfig
from services.common.flags import add_engine_flags, engine_args, scheduler_config_from_args

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
    )


@settings(max_examples=50, deadline=None)
@given(config=_configs())
def test_config_round_trips_through_the_flags(config: SchedulerConfig) -> None:
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    back = scheduler_config_from_args(parser.parse_args(engine_args(config)))
    assert dataclasses.asdict(back) == dataclasses.asdict(config)
