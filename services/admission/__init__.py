"""The admission service: validation and tokenizing (``validation.py``), the request tables
(``tables.py``), admission and backpressure (``core.py``), shard choice (``router.py``,
``routing.py``, ``shards.py``, ``membership.py``), the relay of stream events (``relay.py``),
shard moves and aborts, and the NATS shell (``service.py``).

May import ``messages``, ``services.common`` and ``services.runtime``; never another service.
"""
