"""KV moved between workers for prefill/decode disaggregation (docs/sharding.md): the NIXL
agent and the KV arenas it registers (``agent.py``, the one module that imports NIXL), the
transfer thread that reads pulls chunk by chunk (``pull_queue.py``) and the worker's part as
source and destination (``pulls.py``).

May import ``messages``, ``services.common`` and ``services.runtime`` (tracing); nothing
else of the worker.
"""
