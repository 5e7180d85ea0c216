"""``rlt bench``'s comparisons, one module each: its workloads, its arms (engine
configurations) and the ratios it reports, as a ``Comparison`` (``services/bench/comparison.py``).
``overload``, ``sparse_prefill``, ``disaggregation`` and ``scheduler_step`` run their own
loops and write their own report sections.

May import the bench's harness (``services/bench/``), ``messages`` and the services' cores
and shells the bench drives; the harness (``runner.py``, ``report.py``) imports a comparison
by its name, and no comparison imports another.
"""
