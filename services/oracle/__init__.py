"""Serial single-request oracle used by tests to check the serving engine."""

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
