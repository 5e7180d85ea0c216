"""Shared fixtures: one toy checkpoint, its model and its oracle per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.oracle import SerialOracle
from services.worker.model.ouro import OuroModel
from services.worker.model.toy import write_toy_checkpoint


@pytest.fixture(scope="session")
def toy_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_toy_checkpoint(tmp_path_factory.mktemp("toy-ckpt"), seed=0, size="toy")


@pytest.fixture(scope="session")
def toy_model(toy_checkpoint: Path) -> OuroModel:
    return OuroModel.from_checkpoint(toy_checkpoint)


@pytest.fixture(scope="session")
def oracle(toy_checkpoint: Path) -> SerialOracle:
    return SerialOracle(toy_checkpoint)
