"""Pure: summaries of timing samples (median, p99, min-max) and ratios."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def percentile(xs: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), nearest-rank on the sorted samples."""
    s = sorted(xs)
    if not s:
        return float("nan")
    k = max(0, min(len(s) - 1, round(q / 100 * len(s) + 0.5) - 1))
    return s[k]


def summary(xs: Sequence[float], *, scale: float = 1.0) -> dict[str, float]:
    """{n, median, p99, min, max, mean} of xs, each multiplied by scale (e.g. 1000 for ms)."""
    if not xs:
        return {"n": 0}
    return {
        "n": len(xs),
        "median": statistics.median(xs) * scale,
        "p99": percentile(xs, 99) * scale,
        "min": min(xs) * scale,
        "max": max(xs) * scale,
        "mean": statistics.fmean(xs) * scale,
    }


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")
