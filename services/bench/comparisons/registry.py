"""The comparisons ``rlt bench`` runs by name (``--only``), and the arms it keeps (``--arms``)."""

from __future__ import annotations

from services.bench.comparison import BenchSettings, Comparison
from services.bench.comparisons.admission_bypass import admission_bypass
from services.bench.comparisons.depth_batching import depth_batching
from services.bench.comparisons.kv_pressure import kv_pressure
from services.bench.comparisons.pipeline import pipeline
from services.bench.comparisons.prefix_cache import prefix_cache
from services.bench.comparisons.shards.routing import routing
from services.bench.comparisons.shards.scaling import scaling
from services.bench.comparisons.wcpb import wcpb

BUILDERS = {
    "depth_batching": depth_batching,
    "wcpb": wcpb,
    "pipeline": pipeline,
    "prefix_cache": prefix_cache,
    "kv_pressure": kv_pressure,
    "admission_bypass": admission_bypass,
    "routing": routing,
    "scaling": scaling,
}


class UnknownArmError(ValueError):
    """``--arms`` named an arm that none of the comparisons run has."""


def build_comparisons(
    names: list[str], settings: BenchSettings, arms: list[str] | None = None
) -> list[Comparison]:
    """The comparisons ``names``; with ``arms``, only those arms of each (a comparison left
    without arms is dropped). An arm no comparison has is an UnknownArmError: a typo must
    not quietly shrink a run."""
    comparisons = [BUILDERS[n](settings) for n in names]
    if arms is None:
        return comparisons
    known = {a.name for c in comparisons for a in c.arms}
    unknown = [a for a in arms if a not in known]
    if unknown:
        raise UnknownArmError(
            f"unknown arm(s) {', '.join(unknown)}; the comparisons run have: "
            f"{', '.join(sorted(known))}"
        )
    for c in comparisons:
        c.keep_arms(set(arms))
    return [c for c in comparisons if c.arms]
