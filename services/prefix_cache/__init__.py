"""Prefix-cache service: the global index of which producer caches which block hashes
(``core.py``), fed by the ordered event stream (``stream.py``), and its NATS shell.

May import ``messages``, ``services.common`` and ``services.runtime``; never another service.
"""

from services.prefix_cache.core import ApplyOutcome, PrefixIndex

__all__ = ["ApplyOutcome", "PrefixIndex"]
