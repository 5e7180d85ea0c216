"""``rlt train``: a small looped model trained on the corpus, bounded by minutes, resumable.

The work directory holds the tokenized corpus (``data.pt``), the resumable state
(``state.pt``, written every few minutes and at the end) and the log (``train_log.jsonl``:
per-loop train and held-out loss). The checkpoint is exported in Ouro's HF format when the
time is spent (``export.py``).
"""

from __future__ import annotations

import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .corpus import HELD_OUT_SHARE, CorpusSplit, build_corpus
from .model import LoopedLM
from .objective import per_loop_token_loss, stage1_loss, stage2_loss
from .settings import TrainSettings
from .tokenizer import train_tokenizer


@dataclass
class TokenizedCorpus:
    train: torch.Tensor  # one int64 stream, documents separated by <|endoftext|> (id 0)
    held_out: torch.Tensor
    tokenizer_json: str
    summary: dict


def tokenize_corpus(split: CorpusSplit, vocab_size: int) -> TokenizedCorpus:
    tok = train_tokenizer((d.text for d in split.train), vocab_size)

    def stream(docs: list) -> torch.Tensor:
        ids: list[int] = []
        for enc in tok.encode_batch([d.text for d in docs]):
            ids.extend(enc.ids)
            ids.append(0)
        return torch.tensor(ids, dtype=torch.int64)

    return TokenizedCorpus(
        stream(split.train), stream(split.held_out), tok.to_str(), split.summary()
    )


def load_or_build_data(work: Path, settings: TrainSettings) -> TokenizedCorpus:
    path = work / "data.pt"
    if path.exists():
        return TokenizedCorpus(**torch.load(path, weights_only=False))
    data = tokenize_corpus(build_corpus(settings.seed), settings.vocab_size)
    torch.save(asdict(data), path)
    return data


def batch_at(stream: torch.Tensor, step: int, seed: int, batch: int, seq: int) -> torch.Tensor:
    """Random windows of ``seq + 1`` tokens; deterministic in (seed, step), so a resumed
    run reads what the uninterrupted one would have."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, stream.numel() - seq - 1, (batch,), generator=g)
    return torch.stack([stream[s : s + seq + 1] for s in starts.tolist()])


def held_out_batches(stream: torch.Tensor, seq: int, count: int) -> list[torch.Tensor]:
    stride = max(seq + 1, (stream.numel() - seq - 1) // count)
    return [
        stream[i : i + seq + 1][None]
        for i in range(0, stride * count, stride)
        if i + seq + 1 <= stream.numel()
    ]


@torch.no_grad()
def held_out_loss(model: LoopedLM, batches: list[torch.Tensor]) -> list[float]:
    totals = torch.zeros(model.cfg.total_ut_steps, dtype=torch.float64)
    count = 0
    for b in batches:
        out = model.loops(b[:, :-1])
        loss = per_loop_token_loss([model.logits(h) for h in out.hidden], b[:, 1:])
        totals += loss.sum(dim=(1, 2)).double()
        count += loss[0].numel()
    return [round(float(x) / count, 4) for x in totals]


class Trainer:
    def __init__(
        self, work: Path, settings: TrainSettings, data: TokenizedCorpus | None = None
    ) -> None:
        self.work = work
        self.settings = settings
        work.mkdir(parents=True, exist_ok=True)
        torch.set_num_threads(settings.threads)
        self.data = data or load_or_build_data(work, settings)
        self.model = LoopedLM(settings.model_config())
        self.model.init_weights(settings.seed)
        self.opt = torch.optim.AdamW(
            self.model.parameters(),
            lr=settings.lr,
            betas=(0.9, 0.95),
            weight_decay=settings.weight_decay,
        )
        gate = list(self.model.model.early_exit_gate.parameters())
        self.gate_opt = torch.optim.AdamW(gate, lr=1e-3, weight_decay=0.0)
        self.step = 0
        self.elapsed = 0.0
        self.held = held_out_batches(self.data.held_out, settings.seq_len, 16)
        self._resume()

    def _resume(self) -> None:
        path = self.work / "state.pt"
        if not path.exists():
            return
        state = torch.load(path, weights_only=False)
        if not _same_settings(state["settings"], self.settings):
            raise SystemExit(
                f"{path} was written with other settings; use another --work-dir or the same flags"
            )
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        self.gate_opt.load_state_dict(state["gate_opt"])
        self.step, self.elapsed = state["step"], state["elapsed"]

    def save(self) -> None:
        tmp = self.work / "state.pt.tmp"
        torch.save(
            {
                "settings": asdict(self.settings),
                "model": self.model.state_dict(),
                "opt": self.opt.state_dict(),
                "gate_opt": self.gate_opt.state_dict(),
                "step": self.step,
                "elapsed": self.elapsed,
            },
            tmp,
        )
        tmp.replace(self.work / "state.pt")

    def record(self) -> dict:
        """What a checkpoint says of its training: settings, corpus, machine and log."""
        log_path = self.work / "train_log.jsonl"
        log = (
            [json.loads(line) for line in log_path.read_text().splitlines()]
            if log_path.exists()
            else []
        )
        return {
            "settings": asdict(self.settings),
            "steps": self.step,
            "minutes": round(self.elapsed / 60, 2),
            "tokens_seen": self.step * self.settings.batch_size * self.settings.seq_len,
            "corpus": {
                "source": "the Python standard library of the training interpreter "
                f"(Python {platform.python_version()}), JSON values and ChatML turns built from it",
                "held_out_share": HELD_OUT_SHARE,
                "train_tokens": int(self.data.train.numel()),
                "held_out_tokens": int(self.data.held_out.numel()),
                **self.data.summary,
            },
            "machine": {
                "cpu_threads": self.settings.threads,
                "processor": platform.processor() or platform.machine(),
                "torch": torch.__version__,
            },
            "log": log,
        }

    def log(self, record: dict) -> None:
        with (self.work / "train_log.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")

    def lr_at(self, fraction: float) -> float:
        s = self.settings
        warm = min(1.0, (self.step + 1) / s.warmup_steps)
        stage1 = min(1.0, fraction / (1 - s.stage2_share))
        return s.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * stage1)))

    def train_step(self, fraction: float) -> tuple[str, list[float]]:
        s = self.settings
        batch = batch_at(self.data.train, self.step, s.seed, s.batch_size, s.seq_len)
        stage2 = fraction >= 1 - s.stage2_share
        if stage2:
            with torch.no_grad():
                out = self.model.loops(batch[:, :-1])
                loss = per_loop_token_loss([self.model.logits(h) for h in out.hidden], batch[:, 1:])
            gates = torch.stack(
                [self.model.model.early_exit_gate(h).squeeze(-1) for h in out.hidden]
            )
            objective = stage2_loss(loss, gates)
            self.gate_opt.zero_grad(set_to_none=True)
            objective.backward()
            self.gate_opt.step()
        else:
            # bf16 matmuls (fp32 weights and optimizer): 2.4x the fp32 rate on AVX512-BF16
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=s.bf16):
                out = self.model.loops(batch[:, :-1])
                logits = [self.model.logits(h) for h in out.hidden]
            loss = per_loop_token_loss(logits, batch[:, 1:])
            stage1 = min(1.0, fraction / (1 - s.stage2_share))
            beta = s.beta_start + (s.beta - s.beta_start) * stage1
            objective = stage1_loss(loss, out.gate_logits, beta)
            for group in self.opt.param_groups:
                group["lr"] = self.lr_at(fraction)
            self.opt.zero_grad(set_to_none=True)
            objective.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
        self.step += 1
        return ("gate" if stage2 else "joint"), [
            round(float(x), 4) for x in loss.detach().mean(dim=(1, 2))
        ]

    def fraction(self, budget: float) -> float:
        """How far the schedule is: by steps when they bound the run (reproducible), else by
        time."""
        s = self.settings
        return self.step / s.max_steps if s.max_steps else self.elapsed / budget

    def run(self, until_step: int | None = None) -> LoopedLM:
        """Trains until the budget is spent (or ``until_step``, then saves: a later run with
        the same settings resumes where this one stopped)."""
        s = self.settings
        budget = s.minutes * 60
        start, last_save, last_eval = time.monotonic() - self.elapsed, time.monotonic(), 0.0
        if self.step:
            self.log(
                {
                    "event": "resumed",
                    "step": self.step,
                    "minutes": round(self.elapsed / 60, 2),
                    "budget_minutes": s.minutes,
                }
            )
        bar = _progress(budget, self.elapsed)
        while self.elapsed < budget and not (s.max_steps and self.step >= s.max_steps):
            if until_step is not None and self.step >= until_step:
                break
            stage, losses = self.train_step(self.fraction(budget))
            now = time.monotonic()
            bar.advance(now - start - self.elapsed, f"step {self.step} {stage} loss/loop {losses}")
            self.elapsed = now - start
            done = self.elapsed >= budget or self.step in (s.max_steps, until_step)
            if now - last_eval >= s.eval_every_s or done:
                last_eval = now
                self.log(
                    {
                        "step": self.step,
                        "minutes": round(self.elapsed / 60, 2),
                        "stage": stage,
                        "tokens": self.step * s.batch_size * s.seq_len,
                        "train_loss_per_loop": losses,
                        "held_out_loss_per_loop": held_out_loss(self.model, self.held),
                    }
                )
            if now - last_save >= s.save_every_s:
                self.save()
                last_save = now
        bar.close()
        self.save()
        return self.model


# a resumed run may be given more time: its schedule (learning rate, entropy weight, the
# gate-only stage) stretches over the new budget from where it stands
_EXTENDABLE = frozenset({"minutes"})


def _same_settings(saved: dict, settings: TrainSettings) -> bool:
    """The saved fields equal, and fields newer than the state at their defaults."""
    ours, default = asdict(settings), asdict(TrainSettings())
    return all(saved.get(k, default[k]) == v for k, v in ours.items() if k not in _EXTENDABLE)


class _progress:
    """A tqdm bar over minutes when tqdm is installed, else a line every 30 s."""

    def __init__(self, total_s: float, done_s: float) -> None:
        try:
            from tqdm import tqdm

            self._bar = tqdm(total=round(total_s), initial=round(done_s), unit="s", file=sys.stderr)
        except ImportError:
            self._bar = None
        self._last = 0.0

    def advance(self, seconds: float, text: str) -> None:
        if self._bar is not None:
            self._bar.update(seconds)
            self._bar.set_postfix_str(text, refresh=False)
        elif time.monotonic() - self._last > 30:
            self._last = time.monotonic()
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
