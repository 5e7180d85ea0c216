"""Prefix-cache service: the global index of which producer caches which block hashes."""

from services.prefix_cache.core import ApplyOutcome, PrefixIndex

__all__ = ["ApplyOutcome", "PrefixIndex"]
