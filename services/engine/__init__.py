"""The in-process engine: ``LLMEngine`` over the one step loop (``EngineCore``) with the
in-process executor (``executor.py``: a ``ModelRunner`` or the simulated device), and the
offline tools built on it (``offline.py``, ``trace.py``, ``check.py``).

May import ``messages``, ``services.common``, the scheduler's core and ``engine_core.py``, and
the worker's runners and model; no NATS.
"""
