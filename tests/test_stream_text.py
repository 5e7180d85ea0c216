"""The stream's text (DESIGN.md §6): the concatenation of a stream's token texts equals the
finished event's text, always, including an incomplete UTF-8 sequence at the end; and the
same ids give the same text whatever the batching."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from messages.api import FinishedEvent, StreamEvent, TokenEvent
from messages.sampling import SamplingParams
from services.common.config import SchedulerConfig
from services.common.tokenizer import TextCodec
from services.engine.engine import LLMEngine
from services.scheduler.output import OutputProcessor

pytestmark = pytest.mark.unit


def _codec(checkpoint) -> TextCodec:  # type: ignore[no-untyped-def]
    codec = TextCodec.from_checkpoint(checkpoint)
    assert codec is not None
    return codec


@settings(max_examples=200, deadline=None)
@given(
    ids=st.lists(st.integers(min_value=0, max_value=511), min_size=1, max_size=24),
    reason=st.sampled_from(["stop", "length", "abort"]),
    per_step=st.integers(min_value=1, max_value=4),
)
def test_concatenated_token_text_equals_final_text(toy_checkpoint, ids, reason, per_step):
    codec = _codec(toy_checkpoint)
    outputs = OutputProcessor(codec)
    streamed: list[str] = []
    events: list[StreamEvent] = [
        TokenEvent(request_id="r", index=i, token_id=t, exit_depth=4, text="")
        for i, t in enumerate(ids)
    ]
    final = FinishedEvent(
        request_id="r", finish_reason=reason, token_ids=ids, exit_depths=[4] * len(ids),
        num_prompt_tokens=1,
    )  # fmt: skip
    steps = [events[i : i + per_step] for i in range(0, len(events), per_step)]
    if reason != "abort":  # stop/length end in the same step as the last token
        steps[-1].append(final)
    for step in steps:  # tokens arrive a few per step
        for e in outputs.process(step):
            if isinstance(e, TokenEvent):
                streamed.append(e.text)
    if reason == "abort":
        outputs.process([final])
    assert "".join(streamed) == final.text
    if reason != "abort":
        assert final.text == codec.decode(ids)  # nothing held back is lost at the end


def test_engine_streams_the_final_text(toy_model, toy_checkpoint):
    codec = _codec(toy_checkpoint)
    config = SchedulerConfig(block_size=4, num_blocks=256, async_scheduling=True)
    engine = LLMEngine(toy_model, config, codec=codec)
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True)
    for i in range(6):
        engine.add_request(f"r{i}", [5 + i, 60, 200 + i], params)
    texts: dict[str, list[str]] = {}
    finished: dict[str, FinishedEvent] = {}
    for event in engine.run_until_done():
        if isinstance(event, TokenEvent):
            texts.setdefault(event.request_id, []).append(event.text)
        elif isinstance(event, FinishedEvent):
            finished[event.request_id] = event
    assert len(finished) == 6
    for rid, event in finished.items():
        assert "".join(texts[rid]) == event.text == codec.decode(event.token_ids)
