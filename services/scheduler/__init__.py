"""The scheduler shard: one scheduler per engine shard, driving one bound worker.

Three rooms, each importing only the ones below it:

- ``service.py`` with its P/D handlers (``kv_handover.py``) and what it sends with
  (``output_publisher.py``, ``prefix_publisher.py``, ``fencing.py``, ``options.py``): the NATS
  actor, the only files here that import ``nats`` or ``asyncio``;
- ``driver/``: the actor's state without I/O (``SchedulerDriver``, streams, submits and
  aborts, the bound worker, P/D handover, telemetry), over ``engine_core.py``, the one step
  loop every way rlt runs shares (with ``output.py``, the stream's text);
- ``core/``: the pure scheduling policy (``Scheduler``), which imports no NATS, no asyncio and
  no ``services.runtime`` (an import contract in pyproject.toml).

May import ``messages``, ``services.common`` and ``services.runtime``; never another service.
"""
