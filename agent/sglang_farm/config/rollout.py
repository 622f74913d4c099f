"""Pure: `[rollout]`, the canary analysis of a reload's change (docs/canary.md).

The thresholds are `canary.verdict.CanaryPolicy`'s fields under the same names; each is
checked here against the same bounds the policy enforces, so a bad value is a config
problem with its file and line, never an error at the first reload.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from sglang_farm.config.problems import _ConversionError, _show
from sglang_farm.config.reader import _Reader, _Table
from sglang_farm.config.values import _abs_path, _choice, _duration, _int
from sglang_farm.spec import RolloutSpec

ON_INCONCLUSIVE = ("hold", "rollback", "promote")

_KEYS = (
    "analysis_window",
    "on_inconclusive",
    "max_extensions",
    "probe_concurrency",
    "eval",
    "eval_tolerance",
    "min_requests",
    "itl_max_ratio",
    "ttft_max_ratio",
    "error_floor",
    "error_max_ratio",
    "min_errors",
    "confidence",
)


def _number(
    lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False
) -> Callable[[object], float]:
    """A finite number in [lo, hi] (an open end excludes it)."""
    left, right = "(" if lo_open else "[", ")" if hi_open else "]"
    span = f"{left}{lo:g}, {hi:g}{right}" if math.isfinite(hi) else f"{left}{lo:g}, ∞)"

    def conv(v: object) -> float:
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise _ConversionError(f"expected a number in {span}, got {_show(v)}")
        x = float(v)
        bad = (
            not math.isfinite(x)
            or (x < lo or (lo_open and x == lo))
            or (x > hi or (hi_open and x == hi))
        )
        if bad:
            raise _ConversionError(f"expected a number in {span}, got {_show(v)}")
        return x

    return conv


def _rollout(reader: _Reader, doc: _Table) -> RolloutSpec:
    path = ("rollout",)
    d = RolloutSpec()
    tbl = reader.table(path, doc.get("rollout", {}), _KEYS)
    above_one = _number(1.0, math.inf, lo_open=True, hi_open=True)
    return RolloutSpec(
        analysis_window=reader.get(
            tbl, path, "analysis_window", _duration(allow_zero=True), d.analysis_window
        ),
        on_inconclusive=reader.get(
            tbl, path, "on_inconclusive", _choice(*ON_INCONCLUSIVE), d.on_inconclusive
        ),
        max_extensions=reader.get(tbl, path, "max_extensions", _int(0), d.max_extensions),
        probe_concurrency=reader.get(
            tbl, path, "probe_concurrency", _int(0, 64), d.probe_concurrency
        ),
        eval=reader.get(tbl, path, "eval", _abs_path, d.eval),
        eval_tolerance=reader.get(tbl, path, "eval_tolerance", _number(0.0, 1.0), d.eval_tolerance),
        min_requests=reader.get(tbl, path, "min_requests", _int(1), d.min_requests),
        itl_max_ratio=reader.get(tbl, path, "itl_max_ratio", above_one, d.itl_max_ratio),
        ttft_max_ratio=reader.get(tbl, path, "ttft_max_ratio", above_one, d.ttft_max_ratio),
        error_floor=reader.get(
            tbl, path, "error_floor", _number(0.0, 1.0, hi_open=True), d.error_floor
        ),
        error_max_ratio=reader.get(
            tbl, path, "error_max_ratio", _number(1.0, math.inf, hi_open=True), d.error_max_ratio
        ),
        min_errors=reader.get(tbl, path, "min_errors", _int(1), d.min_errors),
        confidence=reader.get(
            tbl, path, "confidence", _number(0.5, 1.0, hi_open=True), d.confidence
        ),
    )
