"""Serial single-request oracle used by tests to check the serving engine."""

from services.oracle.serial import (
    KV_LAYOUTS,
    ExitTracker,
    OracleResult,
    OracleStep,
    SerialOracle,
)

__all__ = ["KV_LAYOUTS", "ExitTracker", "OracleResult", "OracleStep", "SerialOracle"]
