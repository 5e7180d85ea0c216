"""The training corpus: text every Python install has, split deterministically from a seed.

Three kinds of document, all derived from the running interpreter's standard library:
- Python sources (code, comments and docstrings), the bulk;
- JSON values built from the sources' own words and names (objects, arrays, strings,
  numbers), so the model learns to open and close JSON, which structured outputs need;
- chat turns in the checkpoint's ChatML form (a question about a function, its docstring or
  source as the answer), so a chat prompt gets an answer in the served format.

Files are assigned to the held-out split by a hash of (seed, path), so the split is the same
on every machine with the same Python version, and training never reads a held-out file:
JSON and chat documents are derived only from the training files.
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import re
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# folders of the standard library left out: test suites (huge and repetitive), GUI demos,
# vendored installers and the deprecated 2to3 package
_SKIPPED_DIRS = frozenset(
    {
        "test",
        "tests",
        "site-packages",
        "idlelib",
        "turtledemo",
        "lib2to3",
        "ensurepip",
        "__pycache__",
        "tkinter",
    }
)
HELD_OUT_SHARE = 0.04  # of the files: ~230k tokens that training never reads
_MAX_FILE_CHARS = 200_000  # a few generated tables are larger and teach nothing
_WORD = re.compile(r"[A-Za-z][a-z]{2,14}")


@dataclass(frozen=True)
class Document:
    kind: str  # "python" | "json" | "chat"
    source: str  # the stdlib file it comes from, relative to the stdlib root
    text: str


@dataclass(frozen=True)
class CorpusSplit:
    train: list[Document]
    held_out: list[Document]

    def summary(self) -> dict[str, object]:
        def count(docs: list[Document]) -> dict[str, int]:
            out: dict[str, int] = {}
            for d in docs:
                out[d.kind] = out.get(d.kind, 0) + len(d.text)
            return out

        return {
            "train_chars": count(self.train),
            "held_out_chars": count(self.held_out),
            "held_out_files": sorted({d.source for d in self.held_out}),
        }


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources(root: Path | None = None) -> list[tuple[str, str]]:
    """(relative path, text) of the standard library's Python files, in path order."""
    root = root or stdlib_root()
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if set(rel.parts[:-1]) & _SKIPPED_DIRS:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if 0 < len(text) <= _MAX_FILE_CHARS:
            out.append((rel.as_posix(), text))
    return out


def is_held_out(path: str, seed: int, share: float) -> bool:
    digest = hashlib.sha256(f"{seed}:{path}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < share


def build_corpus(
    seed: int = 0,
    held_out_share: float = HELD_OUT_SHARE,
    json_docs_per_file: int = 12,
    sources: list[tuple[str, str]] | None = None,
) -> CorpusSplit:
    """The corpus split into train and held-out documents, deterministic from ``seed``."""
    train: list[Document] = []
    held: list[Document] = []
    for path, text in sources if sources is not None else stdlib_sources():
        target = held if is_held_out(path, seed, held_out_share) else train
        target.append(Document("python", path, text))
        rng = random.Random(f"{seed}:{path}")
        words = _WORD.findall(text)
        names = _identifiers(text)
        if words and names:
            for _ in range(json_docs_per_file):
                target.append(Document("json", path, json_document(rng, words, names)))
        target.extend(Document("chat", path, turn) for turn in chat_turns(text, rng))
    return CorpusSplit(train, held)


def _identifiers(text: str) -> list[str]:
    return re.findall(r"\b[a-z_][a-z0-9_]{2,20}\b", text)[:2000]


def json_document(rng: random.Random, words: list[str], names: list[str]) -> str:
    """One JSON value from a file's words; compact mostly (rlt's default JSON is compact)."""
    value = _json_value(rng, words, names, depth=0, force_container=True)
    if rng.random() < 0.7:
        return json.dumps(value, separators=(",", ":"))
    return json.dumps(value, indent=rng.choice((2, 4)))


def _json_value(
    rng: random.Random, words: list[str], names: list[str], depth: int, force_container: bool
) -> object:
    roll = rng.random()
    if force_container or (depth < 3 and roll < 0.35):
        if rng.random() < 0.7:
            keys = list(dict.fromkeys(rng.choice(names) for _ in range(rng.randint(1, 6))))
            return {k: _json_value(rng, words, names, depth + 1, False) for k in keys}
        return [_json_value(rng, words, names, depth + 1, False) for _ in range(rng.randint(0, 5))]
    roll = rng.random()
    if roll < 0.5:
        return " ".join(rng.choice(words) for _ in range(rng.randint(1, 6)))
    if roll < 0.7:
        return rng.randint(-1000, 100000)
    if roll < 0.8:
        return round(rng.uniform(-100, 100), rng.randint(1, 4))
    if roll < 0.92:
        return rng.random() < 0.5
    return None


def chat_turns(text: str, rng: random.Random, limit: int = 4) -> Iterator[str]:
    """Chat documents from a module's documented functions: what it does, or its code."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return
    funcs = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef) and ast.get_docstring(n) and not n.name.startswith("_")
    ]
    rng.shuffle(funcs)
    for fn in funcs[:limit]:
        doc = (ast.get_docstring(fn) or "").strip().split("\n\n")[0]
        if rng.random() < 0.5:
            question = f"What does the function {fn.name} do?"
            answer = " ".join(doc.split())
        else:
            question = f"Write a Python function {fn.name}: {' '.join(doc.split())}"
            answer = ast.get_source_segment(text, fn) or ""
        if answer:
            yield (
                f"<|im_start|>user\n{question}<|im_end|>\n"
                f"<|im_start|>assistant\n{answer}<|im_end|>\n"
            )
