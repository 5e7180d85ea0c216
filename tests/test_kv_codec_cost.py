"""``rlt eval``'s KV codec cost: int4-delta scored once per anchor interval through the
oracle, an interval of the loop count being plane 0 alone (the default layout)."""

from __future__ import annotations

import pytest
import torch

from services.evaluation.kv_codec_cost import kv_codec_cost

pytestmark = pytest.mark.oracle


def test_each_anchor_interval_is_scored_and_the_loop_count_is_plane_0_alone(oracle) -> None:
    loops = oracle.total_ut_steps
    window = torch.tensor([(29 * j) % 499 + 1 for j in range(40)])
    rows = {r.codec: r for r in kv_codec_cost(oracle, [window], 32, (1, 2, loops))}
    assert set(rows) == {
        "auto",
        "fp8",
        "int4-delta (anchor every 1)",
        "int4-delta (anchor every 2)",
        f"int4-delta (anchor every {loops})",
    }
    assert rows["auto"].loss_ratio == 1.0 and rows["auto"].greedy_agreement == 1.0
    (default,) = [r for r in kv_codec_cost(oracle, [window], 32) if "int4" in r.codec]
    assert default.codec == f"int4-delta (anchor every {loops})"
    assert default.loss == rows[default.codec].loss
    # every interval codes differently: anchors above plane 0 change what is read back
    losses = {rows[f"int4-delta (anchor every {a})"].loss for a in (1, 2, loops)}
    assert len(losses) == 3
