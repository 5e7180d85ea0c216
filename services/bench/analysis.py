"""From per-run metrics to what the report states: per-arm spreads and per-repeat ratios.

Everything here is recomputable from the ``runs`` list stored in the JSON: a ratio's value
for repeat r is ``metric(numerator, r) / metric(denominator, r)`` on one workload, and its
min / median / max are taken over the repeats that produced both numbers.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from services.bench.comparison import Comparison, RatioSpec

Run = dict[str, Any]  # {"workload", "arm", "repeat", "metrics": {...}}


def _spread(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"min": None, "median": None, "max": None}
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def metric_value(runs: Sequence[Run], workload: str, arm: str, repeat: int, metric: str) -> Any:
    for run in runs:
        if (run["workload"], run["arm"], run["repeat"]) == (workload, arm, repeat):
            return run["metrics"].get(metric)
    return None


def ratio_result(spec: RatioSpec, runs: Sequence[Run], repeats: int) -> dict[str, Any]:
    per_repeat: list[float | None] = []
    for r in range(repeats):
        num = metric_value(runs, spec.workload, spec.numerator, r, spec.metric)
        den_workload = spec.denominator_workload or spec.workload
        den = metric_value(runs, den_workload, spec.denominator, r, spec.metric)
        if spec.value:
            per_repeat.append(num)
        elif num is None or den is None:
            per_repeat.append(None)
        elif spec.difference:
            per_repeat.append(num - den)
        else:
            per_repeat.append(num / den if den else None)
    spread = _spread([v for v in per_repeat if v is not None])
    out: dict[str, Any] = {
        "workload": spec.workload,
        "metric": spec.metric,
        "numerator": spec.numerator,
        "denominator": spec.denominator,
        "denominator_workload": spec.denominator_workload or spec.workload,
        "kind": "value" if spec.value else "difference" if spec.difference else "ratio",
        "label": spec.label,
        "per_repeat": per_repeat,
        **spread,
        "target": None,
        "reached": None,
    }
    if spec.target is not None:
        out["target"] = {"text": spec.target.text, "low": spec.target.low, "high": spec.target.high}
        out["reached"] = spec.target.reached(spread["median"])
    return out


def per_repeat_result(
    workload: str,
    metric: str,
    label: str,
    kind: str,
    values: list[Any],
    target: tuple[str, float | None, float | None] | None,
) -> dict[str, Any]:
    """One reported figure of a comparison run by its own module: its per-repeat values, their
    spread, and whether the median reaches ``target`` (text, low bound, high bound)."""
    known = [v for v in values if v is not None]
    spread = _spread(known)
    out: dict[str, Any] = {
        "workload": workload,
        "metric": metric,
        "label": label,
        "kind": kind,
        "per_repeat": values,
        **spread,
        "target": None,
        "reached": None,
    }
    if target is not None:
        text, low, high = target
        median = spread["median"]
        out["target"] = {"text": text, "low": low, "high": high}
        out["reached"] = (
            median is not None
            and (low is None or median >= low)
            and (high is None or median <= high)
        )
    return out


def arm_summary(
    comparison: Comparison, runs: Sequence[Run], metrics: Sequence[str]
) -> list[dict[str, Any]]:
    """Per (workload, arm): min / median / max of each metric over the repeats."""
    rows = []
    for workload, arm in comparison.cases():
        mine = [r for r in runs if r["workload"] == workload.name and r["arm"] == arm.name]
        stats = {}
        for m in metrics:
            values = [r["metrics"][m] for r in mine if r["metrics"].get(m) is not None]
            stats[m] = _spread(values)
        rows.append({"workload": workload.name, "arm": arm.name, "stats": stats})
    return rows
