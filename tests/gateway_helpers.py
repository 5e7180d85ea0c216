"""Helpers for the gateway tests: a request body, scraping /metrics into sums, and reading a
completion's tokens back as a FinishedEvent (for the oracle comparison)."""

from __future__ import annotations

import json
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from messages.api import FinishedEvent


def json_body(**fields: object) -> bytes:
    """A request body for the served model (``toy``) with ``fields``."""
    return json.dumps({"model": "toy", **fields}).encode()


# labels that say where a sample came from: summed over, as `sum by (...)` would
_WHERE = {"instance", "service", "model_name", "shard"}

# the metrics issue 17 names, by their exposed sample names
REQUIRED_METRICS = (
    "rlt:num_requests_running",
    "rlt:num_requests_waiting",
    "rlt:kv_cache_usage_perc",
    "rlt:prefix_cache_queries_total",
    "rlt:prefix_cache_hits_total",
    "rlt:time_to_first_token_seconds_count",
    "rlt:inter_token_latency_seconds_count",
    "rlt:e2e_request_latency_seconds_count",
    "rlt:request_queue_time_seconds_count",
    "rlt:request_success_total",
    "rlt:num_preemptions_total",
    # looped-model metrics
    "rlt:exit_depth_count",
    "rlt:core_passes_total",
    "rlt:rows_per_core_pass_count",
    "rlt:loops_saved_total",
    "rlt:wasted_follow_on_rows_total",
    "rlt:bus_overhead_seconds_count",
)


def metric_sums(text: str) -> dict[str, float]:
    """``name{label="v",...}`` -> value summed over instances; plain ``name`` -> the sum of
    every series of that sample name."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k not in _WHERE}
            out[s.name] = out.get(s.name, 0.0) + s.value
            if labels:
                key = s.name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
                out[key] = out.get(key, 0.0) + s.value
    return out


def as_finished(choice: dict[str, Any], usage: dict[str, Any], request_id: str) -> FinishedEvent:
    """A completion (``return_token_ids``) as the NATS API's finished event."""
    return FinishedEvent(
        request_id=request_id,
        finish_reason=choice["finish_reason"],
        token_ids=list(choice["token_ids"]),
        exit_depths=list(choice["exit_depths"]),
        num_prompt_tokens=usage["prompt_tokens"],
        num_cached_tokens=usage["prompt_tokens_details"]["cached_tokens"],
    )
