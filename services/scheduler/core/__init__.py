"""The scheduling policy, pure: ``Scheduler`` (``scheduler.py``) and its parts, one concept each.

Requests (``request.py``, ``intake.py``), the waiting queue (``waiting.py``), selection
(``selection.py``) under the depth budget (``depth_budget.py``), batch building
(``batch.py``, ``batch_builder.py``), progress (``progress.py``, ``running.py``,
``logprobs.py``), the shared state (``state.py``), P/D handoffs and pulls
(``disaggregation.py``); KV accounting is ``kv/``.

May import ``messages``, ``services.common`` and itself; never NATS, asyncio or
``services.runtime`` (pyproject's "the scheduler core is pure" contract), nor the rest of
the scheduler.
"""
