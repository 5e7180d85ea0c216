"""The README and docs/ stand on their own: nothing a user reads points outside the
repository (a clone has nothing beside it), every relative link resolves to a file in it,
and the design the code follows is in docs/, linked from the README and the architecture
notes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
TEXTS = [*DOCS, *sorted((ROOT / "docs").rglob("*.json"))]
# a workspace around the repository: absolute paths into it, or the files it shares
OUTSIDE = re.compile(r"(?<![\w.])/work/|\.\./shared\b|\bshared/(DESIGN|STYLE|seed|data)\b")
LINK = re.compile(r"\]\(([^)\s#]+)")
RELATIVE = re.compile(r"(?<![\w.])(?:\.\./)+[\w./-]*")


def _outside_the_repo(doc: Path, target: str) -> bool:
    return ROOT not in (doc.parent / target).resolve().parents


@pytest.mark.parametrize("doc", TEXTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_path_leads_outside_the_repository(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    found = [m.group(0) for m in OUTSIDE.finditer(text)]
    found += [m.group(0) for m in RELATIVE.finditer(text) if _outside_the_repo(doc, m.group(0))]
    assert not found, f"{doc.relative_to(ROOT)} points outside the repository: {found}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_to_a_file_in_the_repository(doc: Path) -> None:
    targets = [t for t in LINK.findall(doc.read_text(encoding="utf-8")) if ":" not in t]
    broken = [t for t in targets if _outside_the_repo(doc, t) or not (doc.parent / t).exists()]
    assert not broken, f"{doc.relative_to(ROOT)}: links to {broken}"


def test_the_design_is_in_the_repository_and_linked() -> None:
    design = ROOT / "docs" / "DESIGN.md"
    assert "## 6. Invariants every change keeps" in design.read_text(encoding="utf-8")
    assert "(docs/DESIGN.md)" in (ROOT / "README.md").read_text(encoding="utf-8")
    assert "(DESIGN.md)" in (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
