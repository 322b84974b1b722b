"""Numbers over repeated measurements: percentiles and medians (numpy, statistics), and the
agreement of two runs' outputs."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "percentile", "median", "least", "greatest", "summarize", "first_difference",
    "agreement_summary",
]  # fmt: skip


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between closest ranks; None for no values."""
    return float(np.percentile(values, q)) if len(values) else None


def median(values: Iterable[float | None]) -> float | None:
    data = [v for v in values if v is not None]
    return statistics.median(data) if data else None


def least(values: Iterable[float | None]) -> float | None:
    """The smallest value, None values left out (None when nothing is left)."""
    return min((v for v in values if v is not None), default=None)


def greatest(values: Iterable[float | None]) -> float | None:
    """The largest value, None values left out (None when nothing is left)."""
    return max((v for v in values if v is not None), default=None)


def summarize(values: Sequence[float], scale: float = 1.0) -> dict[str, float | int | None]:
    """count, mean, median, p95, max (each times `scale`, e.g. 1000 for seconds -> ms)."""
    if not values:
        return {"count": 0, "mean": None, "median": None, "p95": None, "max": None}
    return {
        "count": len(values),
        "mean": statistics.fmean(values) * scale,
        "median": percentile(values, 50) * scale,
        "p95": percentile(values, 95) * scale,
        "max": max(values) * scale,
    }


def first_difference(a: Sequence[Any], b: Sequence[Any], default: int | None) -> int | None:
    """The first position where two lists differ; `default` where one is a prefix of the
    other."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), default)


def agreement_summary(checks: list[dict[str, Any]], rtol: float) -> dict[str, Any]:
    """A report's "agreement": the checks (each with its relative_diff and ok), the largest
    relative difference, and whether every check passed."""
    return {
        "rtol": rtol,
        "checks": checks,
        "largest_relative_diff": max((c["relative_diff"] for c in checks), default=0.0),
        "ok": all(c["ok"] for c in checks),
    }
