"""Serial single-request oracle used by tests to check the serving engine: the reference
(``serial.py``) and its results (``results.py``), its own checkpoint reader and exit tracker,
and the near-tie rule that tells a real difference from float reordering (``near_tie.py``).

May import torch, ``messages`` and ``services.common.sampling`` (the draw a sampled token must
share); nothing of the engine, so a shared bug cannot hide in both.
"""

from services.oracle.exit_tracker import ExitTracker
from services.oracle.results import OracleResult, OracleStep, SparseSetting
from services.oracle.serial import KV_LAYOUTS, SerialOracle

__all__ = [
    "KV_LAYOUTS",
    "ExitTracker",
    "OracleResult",
    "OracleStep",
    "SerialOracle",
    "SparseSetting",
]
