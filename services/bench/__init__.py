"""``rlt bench``: workloads, metrics and side-by-side comparisons.

The harness is here (``runner.py``, ``report.py``, ``analysis.py``, ``workloads.py``,
``metrics.py``, the backends and their processes) with ``comparison.py`` (what a comparison
is); ``comparisons/`` holds one module per comparison.

May import anything below the CLI: ``messages``, ``services.common``, ``services.runtime``,
the launcher, the engine and the services it starts; nothing imports the bench but the CLI
and scripts.
"""
