"""Public client API (JSON on ``rlt.v1.generate`` / ``rlt.v1.abort``) and stream events."""

from __future__ import annotations

import msgspec

from messages.sampling import SamplingParams


class GenerateRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    request_id: str | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_loops: int = 2
    max_loops: int | None = None
    exit_threshold: float = 1.0
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    priority: int = 0

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            min_loops=self.min_loops,
            max_loops=self.max_loops,
            exit_threshold=self.exit_threshold,
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            priority=self.priority,
        )


class AbortRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    request_id: str


class TokenEvent(msgspec.Struct, kw_only=True, tag="token", tag_field="type"):
    request_id: str
    index: int
    token_id: int
    exit_depth: int
    text: str = ""


class FinishedEvent(msgspec.Struct, kw_only=True, tag="finished", tag_field="type"):
    request_id: str
    finish_reason: str
    token_ids: list[int]
    exit_depths: list[int]
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    text: str = ""


class ErrorEvent(msgspec.Struct, kw_only=True, tag="error", tag_field="type"):
    request_id: str
    code: str
    message: str


StreamEvent = TokenEvent | FinishedEvent | ErrorEvent

TERMINAL_EVENTS = (FinishedEvent, ErrorEvent)
