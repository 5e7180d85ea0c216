"""Admission's settings: backpressure, KV geometry, loss and retry windows, routing.

Operators set some of them through the environment (``AdmissionConfig.from_env``,
docs/services.md); the service fills in the KV geometry and the bus's max_payload once it
knows them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from messages.sampling import DEFAULT_STRUCTURED_OUTPUTS_BACKEND, StructuredOutputsBackend
from services.common.config import scheduler_lost_s
from services.runtime import subjects


@dataclass(frozen=True)
class AdmissionConfig:
    # backpressure: requests / prompt tokens queued at the scheduler (not yet running)
    max_waiting_requests: int = 1024
    max_waiting_tokens: int = 1 << 20
    max_request_id_length: int = 256
    # KV geometry, to refuse requests that can never fit (None: leave it to the scheduler)
    block_size: int = 16
    num_blocks: int | None = None
    num_kv_planes: int = 1
    enable_prefix_caching: bool = False
    # the grammar engine written into each request with a structured output that names none
    # (the engine's --structured-outputs-backend)
    structured_outputs_backend: StructuredOutputsBackend = DEFAULT_STRUCTURED_OUTPUTS_BACKEND
    # prompt cap in tokens (None: the model's max_position_embeddings)
    max_prompt_tokens: int | None = None
    # the bus's max_payload (set by the service once connected): internal messages and the
    # finished event must fit it, so such requests are refused up front with a clear error
    max_payload: int | None = None
    # a scheduler that holds open requests and has not been heard from for this long (while
    # we were connected) is gone: its requests end with "unavailable"
    scheduler_lost_s: float = field(default_factory=scheduler_lost_s)
    # an open-request entry older than this is forgotten (the scheduler ends it itself)
    max_request_s: float = 3600.0
    # finished events kept to answer a client's retry of the same request_id (the window in
    # which a retry never runs a request twice), and their total size
    finished_record_s: float = 600.0
    finished_record_bytes: int = 64 << 20
    # tenants whose requests may ask for a priority more urgent than the default (< 0);
    # DEFAULT_TENANT ("") names the default tenant (RLT_PRIORITY_TENANTS: "default,acme")
    priority_tenants: frozenset[str] = frozenset()
    # how long the requests a lost scheduler held are remembered for its fence query
    fence_keep_s: float = 600.0
    # "is that scheduler still there?": no answer in this long means connected but stalled
    probe_timeout_s: float = 1.0
    # routing over shards (services/admission/router.py): policy, the prefix index lookup's
    # timeout, and how long a failed index is left alone before it is asked again
    router: str = "prefix"
    # a block of prefill saved against blocks of load (Dynamo's overlap_score_weight);
    # 2 measured better than 1 on hits, tokens/s and TTFT (docs/benchmarks/sharding.md)
    router_overlap_weight: float = 2.0
    # each request already running or queued on a shard counts as this many blocks of load
    router_request_weight: float = 2.0
    prefix_lookup_timeout_s: float = 0.05
    prefix_index_retry_s: float = 1.0
    # a request moved this many times (shard after shard lost) ends with "unavailable"
    max_moves: int = 8

    @classmethod
    def from_env(cls) -> AdmissionConfig:
        """The limits operators set through the environment (docs/services.md)."""
        base, env = cls(), os.environ
        max_prompt = env.get("RLT_MAX_PROMPT_TOKENS")
        return cls(
            max_waiting_requests=int(
                env.get("RLT_MAX_WAITING_REQUESTS", base.max_waiting_requests)
            ),
            max_waiting_tokens=int(env.get("RLT_MAX_WAITING_TOKENS", base.max_waiting_tokens)),
            max_prompt_tokens=int(max_prompt) if max_prompt else None,
            scheduler_lost_s=scheduler_lost_s(),
            max_request_s=float(env.get("RLT_MAX_REQUEST_S", base.max_request_s)),
            finished_record_s=float(env.get("RLT_FINISHED_RECORD_S", base.finished_record_s)),
            priority_tenants=parse_priority_tenants(env.get("RLT_PRIORITY_TENANTS", "")),
            prefix_lookup_timeout_s=float(
                env.get("RLT_PREFIX_LOOKUP_TIMEOUT_S", base.prefix_lookup_timeout_s)
            ),
            router_overlap_weight=float(
                env.get("RLT_ROUTER_OVERLAP_WEIGHT", base.router_overlap_weight)
            ),
            router_request_weight=float(
                env.get("RLT_ROUTER_REQUEST_WEIGHT", base.router_request_weight)
            ),
        )


def parse_priority_tenants(value: str) -> frozenset[str]:
    """``"default,acme"`` -> {"", "acme"}: the tenants that may raise a request's priority."""
    names = [part.strip() for part in value.split(",") if part.strip()]
    return frozenset(
        subjects.DEFAULT_TENANT if name == "default" else subjects.check_tenant(name)
        for name in names
    )
