"""The services as real OS processes (``rlt service NAME``, ``rlt up``) and the NATS clients
that watch them, for the reliability tests. They live in ``services/launcher`` (processes.py,
probes.py), which the soak and fuzz scripts share; tests import them from here.
"""

from __future__ import annotations

from services.launcher.probes import Event, StreamCollector, client, health
from services.launcher.processes import (
    SERVICES,
    Proc,
    ServiceProcs,
    alive,
    service_procs,
    start_rlt_up,
    wait_for,
)

__all__ = [
    "SERVICES",
    "Event",
    "Proc",
    "ServiceProcs",
    "StreamCollector",
    "alive",
    "client",
    "health",
    "service_procs",
    "start_rlt_up",
    "wait_for",
]
