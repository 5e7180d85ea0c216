"""``rlt train``: the corpus split, the objective, the trainable model against the serial
oracle, resuming, and that training learns."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from services.oracle import ExitTracker, SerialOracle
from services.train.corpus import build_corpus
from services.train.export import TRAINING_FILE, export_checkpoint
from services.train.model import LoopedLM
from services.train.objective import exit_distribution, stage1_loss, stage2_loss
from services.train.settings import TrainSettings
from services.train.tokenizer import train_tokenizer
from services.train.trainer import TokenizedCorpus, Trainer

pytestmark = pytest.mark.unit

TINY = TrainSettings(
    vocab_size=300,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    total_ut_steps=3,
    seq_len=16,
    batch_size=4,
    lr=1e-2,
    warmup_steps=2,
    threads=1,
    bf16=False,
    max_position_embeddings=64,
    eval_every_s=1e9,
    save_every_s=1e9,
)
TEXTS = [f"def f{i}(x):\n    return x + {i}\n" for i in range(40)] + ['{"a": 1, "b": [true]}']


@pytest.fixture(scope="module")
def tiny_data() -> TokenizedCorpus:
    tok = train_tokenizer(TEXTS, TINY.vocab_size)
    ids = [i for t in TEXTS for i in [*tok.encode(t).ids, 0]]
    stream = torch.tensor(ids * 4, dtype=torch.int64)
    return TokenizedCorpus(stream, stream[:200], tok.to_str(), {})


def _sources() -> list[tuple[str, str]]:
    body = 'def area(r):\n    """Return the area of a circle of radius r."""\n    return 3 * r\n'
    return [(f"pkg/mod{i}.py", body.replace("area", f"area{i}")) for i in range(60)]


def test_corpus_split_is_deterministic_and_held_out_files_stay_out_of_training() -> None:
    a = build_corpus(seed=3, held_out_share=0.2, sources=_sources())
    b = build_corpus(seed=3, held_out_share=0.2, sources=_sources())
    assert a == b
    train_files = {d.source for d in a.train}
    held_files = {d.source for d in a.held_out}
    assert held_files and train_files and not held_files & train_files
    # every kind of document derived from a held-out file is held out with it
    assert {d.kind for d in a.held_out} == {"python", "json", "chat"}
    assert build_corpus(seed=4, held_out_share=0.2, sources=_sources()).held_out != a.held_out
    for doc in a.train:
        if doc.kind == "json":
            json.loads(doc.text)
        if doc.kind == "chat":
            assert doc.text.startswith("<|im_start|>user\n") and doc.text.endswith("<|im_end|>\n")


def test_exit_distribution_is_the_serving_exit_rule() -> None:
    gates = torch.randn(4, 50)
    p = exit_distribution(gates)
    assert torch.allclose(p.sum(0), torch.ones(50))
    cdf = p.cumsum(0)
    for j in range(50):
        tracker = ExitTracker(min_loops=1, max_loops=4, threshold=0.999)
        for r in range(3):
            tracker.observe(gates[r, j])
            assert float(tracker.cdf) == pytest.approx(float(cdf[r, j]), abs=1e-6)


def test_stage1_is_the_expected_loss_and_stage2_teaches_where_loops_stop_paying() -> None:
    loss = torch.tensor([[3.0], [2.0], [2.5], [2.4999]])
    gates = torch.zeros(4, 1)
    expected = (exit_distribution(gates) * loss).sum()
    assert float(stage1_loss(loss, gates, beta=0.0)) == pytest.approx(float(expected))
    # continuing after loop 1 gains a nat, after loop 2 it loses half of one, after loop 3
    # it gains 1e-4, under gamma: the soft label to stop there is 1 - sigmoid(k (1e-4 - g))
    gate = torch.zeros(4, 1, requires_grad=True)
    opt = torch.optim.SGD([gate], lr=5.0)
    for _ in range(200):
        opt.zero_grad()
        stage2_loss(loss, gate).backward()
        opt.step()
    hazard = torch.sigmoid(gate.detach()[:3, 0])
    assert hazard[0] < 0.02 and hazard[1] > 0.98
    soft = 1 - torch.sigmoid(torch.tensor(50.0 * (1e-4 - 0.005)))
    assert float(hazard[2]) == pytest.approx(float(soft), abs=0.01)


def test_exported_checkpoint_is_the_trained_model_in_the_oracle(
    tiny_data: TokenizedCorpus, tmp_path: Path
) -> None:
    model = LoopedLM(TINY.model_config())
    model.init_weights(seed=1)
    with torch.no_grad():  # a gate that exits at varied loops
        model.model.early_exit_gate.bias.fill_(0.0)
        model.model.early_exit_gate.weight.normal_(0, 2.0)
    ckpt = export_checkpoint(model, tiny_data.tokenizer_json, tmp_path / "ckpt", {"x": 1})
    assert json.loads((ckpt / TRAINING_FILE).read_text()) == {"x": 1}
    ids = tiny_data.train[:20].tolist()
    oracle = SerialOracle(ckpt)
    with torch.no_grad():
        out = model.loops(torch.tensor([ids]))
        ours = model.logits(out.hidden[-1])[0]
    assert torch.allclose(ours, oracle.prompt_logits(ids), atol=1e-5)
    reloaded = LoopedLM.from_checkpoint(ckpt)
    for (name, a), (_, b) in zip(
        model.state_dict().items(), reloaded.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_resumed_run_equals_an_uninterrupted_one(
    tiny_data: TokenizedCorpus, tmp_path: Path
) -> None:
    settings = replace(TINY, max_steps=8, minutes=10.0, stage2_share=0.25)
    whole = Trainer(tmp_path / "whole", settings, tiny_data)
    whole.run()
    first = Trainer(tmp_path / "parts", settings, tiny_data)
    first.run(until_step=4)
    assert first.step == 4
    second = Trainer(tmp_path / "parts", settings, tiny_data)
    assert second.step == 4
    second.run()
    assert second.step == whole.step == 8
    for name, value in whole.model.state_dict().items():
        assert torch.equal(value, second.model.state_dict()[name]), name
    with pytest.raises(SystemExit, match="other settings"):
        Trainer(tmp_path / "parts", replace(settings, lr=1.0), tiny_data)
    # more minutes stretch the schedule of a resumed run; nothing else may change
    assert Trainer(tmp_path / "parts", replace(settings, minutes=20.0), tiny_data).step == 8


def test_training_lowers_held_out_loss_at_every_loop(
    tiny_data: TokenizedCorpus, tmp_path: Path
) -> None:
    settings = replace(TINY, max_steps=60, minutes=10.0)
    trainer = Trainer(tmp_path / "w", settings, tiny_data)
    log = tmp_path / "w" / "train_log.jsonl"
    trainer.run(until_step=1)
    before = json.loads(log.read_text().splitlines()[-1])["held_out_loss_per_loop"]
    trainer.run()
    after = json.loads(log.read_text().splitlines()[-1])["held_out_loss_per_loop"]
    assert all(a < b - 1.0 for a, b in zip(after, before, strict=True)), (before, after)
