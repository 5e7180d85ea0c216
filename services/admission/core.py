"""Admission's pure core (no NATS): ``AdmissionCore`` validates a request
(``RequestValidator``), applies backpressure and builds the message its shard's scheduler
gets. The other pure parts live by concept: ``config`` (settings), ``validation``,
``tables`` (open requests, fences, finished records), ``shards`` and ``router``; the names
other modules import from here stay importable from here.
"""

from __future__ import annotations

import time
import uuid

from messages.internal import AdmittedRequest
from services.admission.config import AdmissionConfig, parse_priority_tenants
from services.admission.errors import AdmissionError
from services.admission.tables import (
    FenceLog,
    FinishedRecord,
    OpenRequest,
    OpenRequests,
    Retry,
    classify_retry,
)
from services.admission.validation import (
    Prepared,
    RequestValidator,
    clean_trace_id,
    salvage_request_id,
    seed_from_request_id,
)
from services.common.config import ModelLimits
from services.common.tokenizer import TextCodec

__all__ = [
    "AdmissionConfig",
    "AdmissionCore",
    "AdmissionError",
    "FenceLog",
    "FinishedRecord",
    "OpenRequest",
    "OpenRequests",
    "Prepared",
    "Retry",
    "classify_retry",
    "clean_trace_id",
    "parse_priority_tenants",
    "salvage_request_id",
    "seed_from_request_id",
]


class AdmissionCore(RequestValidator):
    """The validator plus what admission decides once a request is valid: whether a shard's
    queue has room for it, and the ``AdmittedRequest`` (with a fresh admission seq) its
    scheduler gets."""

    def __init__(
        self,
        limits: ModelLimits,
        codec: TextCodec | None,
        config: AdmissionConfig | None = None,
        admission_id: str | None = None,
    ) -> None:
        super().__init__(limits, codec, config)
        self.admission_id = admission_id or uuid.uuid4().hex[:12]
        self._seq = 0  # admission seqs: one per submit (a move is a new submit)

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def over_limit(self, num_waiting: int, waiting_tokens: int, num_prompt: int) -> str | None:
        """Why one more request of ``num_prompt`` tokens may not join a queue this long
        (None: it may). The limits hold per scheduler (per shard)."""
        cfg = self.config
        if num_waiting + 1 > cfg.max_waiting_requests:
            return (
                f"{num_waiting} requests are waiting (limit {cfg.max_waiting_requests}); "
                "retry later"
            )
        if waiting_tokens + num_prompt > cfg.max_waiting_tokens:
            return (
                f"{waiting_tokens} prompt tokens are waiting (limit {cfg.max_waiting_tokens}); "
                "retry later"
            )
        return None

    def admit(
        self,
        prepared: Prepared,
        reply_subject: str,
        *,
        shard_id: str = "",
        relay_subject: str | None = None,
    ) -> AdmittedRequest:
        """Builds the message for the scheduler (the shard table counts it as waiting)."""
        seq = self.next_seq()
        return AdmittedRequest(
            request_id=prepared.request_id,
            prompt_token_ids=prepared.prompt_token_ids,
            params=prepared.params,
            reply_subject=reply_subject,
            trace_id=prepared.trace_id,
            admission_id=self.admission_id,
            admission_seq=seq,
            admitted_at=time.time(),
            tenant=prepared.tenant,
            shard_id=shard_id,
            relay_subject=relay_subject,
        )
