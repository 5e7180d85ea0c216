"""Shared fixtures: one toy checkpoint, its model and its oracle per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from services.common.tokenizer import TextCodec
from services.oracle import SerialOracle
from services.worker.model.ouro import OuroModel
from services.worker.model.toy import write_toy_checkpoint

# Small matmuls on a 2-core box: extra threads only contend (10x slower when oversubscribed).
if "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"  # for subprocesses the tests start
    torch.set_num_threads(1)


TIERS = ("unit", "oracle", "services", "slow", "gpu")


@pytest.hookimpl(tryfirst=True)  # before -m deselects anything
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test belongs to exactly one tier (pyproject's markers), so ``pytest -m unit``
    and friends partition the suite."""
    wrong = []
    for item in items:
        tiers = {m.name for m in item.iter_markers() if m.name in TIERS}
        if len(tiers) != 1:
            wrong.append(f"{item.nodeid}: {sorted(tiers) or 'no tier'}")
    if wrong:
        raise pytest.UsageError(
            "each test needs exactly one tier marker of "
            + ", ".join(TIERS)
            + ":\n  "
            + "\n  ".join(wrong)
        )


@pytest.fixture(scope="session")
def toy_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_toy_checkpoint(tmp_path_factory.mktemp("toy-ckpt"), seed=0, size="toy")


@pytest.fixture(scope="session")
def toy_model(toy_checkpoint: Path) -> OuroModel:
    return OuroModel.from_checkpoint(toy_checkpoint)


@pytest.fixture(scope="session")
def codec(toy_checkpoint: Path) -> TextCodec:
    """The toy checkpoint's tokenizer."""
    found = TextCodec.from_checkpoint(toy_checkpoint)
    assert found is not None
    return found


@pytest.fixture(scope="session")
def oracle(toy_checkpoint: Path) -> SerialOracle:
    return SerialOracle(toy_checkpoint)
