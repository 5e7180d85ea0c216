"""The scheduler core's KV accounting: logical paged blocks and the prefix cache
(``kv_manager.py``), the admission policies' arithmetic (``kv_admission.py``), backfill
reservations (``reservation.py``), prefixes still being prefilled (``inflight_prefix.py``) and
the seq of published prefix events (``prefix_events.py``).

May import ``messages``, ``services.common`` and ``core/request.py``; the same contract as the
core holds it pure.
"""
