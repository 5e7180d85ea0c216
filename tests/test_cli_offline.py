"""The CLI as a user runs it: a fresh toy checkpoint, offline generation, schedule traces."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.oracle import SerialOracle

pytestmark = pytest.mark.services


def rlt(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_generate_offline_json_equals_oracle(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    out = rlt("toy-checkpoint", str(ckpt), "--seed", "3")
    assert out.returncode == 0, out.stderr
    out = rlt(
        "generate",
        "--offline",
        "--checkpoint",
        str(ckpt),
        "--json",
        "--prompt-ids",
        "5,6,7,8",
        "--prompt",
        "The quick brown fox",
        "--max-tokens",
        "6",
        "--min-loops",
        "1",
        "--exit-threshold",
        "0.7",
        "--ignore-eos",
    )
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [e["type"] for e in lines] == ["finished", "finished"]
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    prompts = [tok.encode("The quick brown fox", add_special_tokens=False).ids, [5, 6, 7, 8]]
    oracle = SerialOracle(ckpt)
    for event, prompt in zip(lines, prompts, strict=True):
        expected = oracle.generate(
            prompt, max_tokens=6, min_loops=1, exit_threshold=0.7, ignore_eos=True
        )
        assert event["token_ids"] == expected.token_ids
        assert event["exit_depths"] == expected.exit_depths
        assert event["num_prompt_tokens"] == len(prompt)
        assert event["finish_reason"] == "length"


def test_generate_offline_reports_bad_input(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    rlt("toy-checkpoint", str(ckpt))
    out = rlt("generate", "--offline", "--checkpoint", str(ckpt), "--prompt-ids", "1,99999")
    assert out.returncode != 0
    assert "outside the vocabulary" in out.stderr


def test_schedule_trace_prints_the_seed_batches(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    rlt("toy-checkpoint", str(ckpt))
    out = rlt(
        "schedule-trace",
        "--checkpoint",
        str(ckpt),
        "--json",
        "--diagram",
        "--prompt-ids",
        ",".join(map(str, range(1, 11))),
        "--prompt-ids",
        ",".join(map(str, range(11, 21))),
        "--prefill-chunk-size",
        "2",
        "--max-num-batched-tokens",
        "5",
        "--max-num-seqs",
        "2",
        "--wavefront-chunked-prefill",
        "--max-tokens",
        "1",
    )
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert records[0]["kind"] == "prefilling_prelude"
    assert [tuple(r[:3]) for r in records[0]["rows"]] == [("a", 0, 2), ("a", 2, 1), ("b", 0, 2)]
    assert "request a: 10 tokens" in out.stdout and "depth 3" in out.stdout


def test_diagram_numbers_chunks_from_the_prefill_origin(tmp_path: Path) -> None:
    """b reuses a's first 16 tokens (4 blocks of 4); with chunk 3 its prefill is cut into
    [16, 19) and [19, 20), drawn as c0 and c1 (counted from the origin, not from token 0)."""
    ckpt = tmp_path / "ckpt"
    rlt("toy-checkpoint", str(ckpt))
    prompt = ",".join(map(str, range(1, 21)))
    out = rlt(
        "schedule-trace",
        "--checkpoint",
        str(ckpt),
        "--diagram",
        "--prompt-ids",
        prompt,
        "--prompt-ids",
        prompt,
        "--enable-prefix-caching",
        "--block-size",
        "4",
        "--prefill-chunk-size",
        "3",
        "--max-num-seqs",
        "1",
        "--wavefront-chunked-prefill",
        "--max-tokens",
        "1",
    )
    assert out.returncode == 0, out.stderr
    diagram = out.stdout.split("request b:", 1)[1].split("\n\n", 1)[0]
    lines = diagram.splitlines()
    assert "16 cached" in lines[0]
    assert lines[1].split() == ["c0", "c1"]
    for row in lines[2:]:  # prelude and every depth: both chunks ran, nothing else
        cells = row.split()[-2:]
        assert all(c != "." for c in cells), row
