"""The scheduler actor's state, without I/O: ``SchedulerDriver`` (``driver.py``) runs the step
loop (``engine_core.py``) with the NATS executor (``nats_executor.py``) and keeps what only a
service has: streams (``streams.py``), submits and aborts (``submissions.py``,
``tombstones.py``), the bound worker (``worker_binding.py``, ``liveness.py``), P/D handover
(``handover.py``), the load report and telemetry; each call returns one ``StepOutput``
(``step_output.py``) for the shell to send.

May import ``messages``, ``services.common``, ``services.runtime`` (subjects, logging,
tracing: no bus), ``engine_core.py`` and ``core/``; never ``nats`` or ``asyncio``.
"""
