"""The comparisons that run engine shards as OS processes: KV-aware routing against
round-robin and least-loaded (``routing.py``), and scaling with the number of shards
(``scaling.py``). Only when named with ``--only``."""
