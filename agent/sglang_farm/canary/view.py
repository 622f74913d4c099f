"""Pure: the canary analysis as readers see it (status, why, metrics, alerts).

The agent builds a `RolloutVerdictView` from its analysis state (canary/rollout.py) and
carries it in `FarmView.canary`; readers only format it. It names the change by its
short hash (record.short), the canary worker, the window, the one-line evidence and the
figures compared (verdict.Check, reduced to what a reader shows).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from sglang_farm.canary.verdict import Check

__all__ = ["CanaryState", "CheckView", "RolloutVerdictView", "check_view"]


class CanaryState(StrEnum):
    ANALYSING = "analysing"  # the window runs: the next wave waits for the verdict
    PROMOTED = "promoted"  # the verdict passed: the next waves proceed (or have)
    ROLLED_BACK = "rolled_back"  # final for that change: the canary is back on the old config
    # Inconclusive with on_inconclusive = "hold", or a change rejected before and not
    # retried: the farm stays on the accepted config and says so.
    HELD = "held"


@dataclass(frozen=True, slots=True)
class CheckView:
    """One compared figure. `passed` None: not judged (too little data to pin it down)."""

    name: str  # "liveness", "errors", "itl_p50", "itl_p99", "ttft_p50", "traffic", "eval"
    canary: float | None
    baseline: float | None
    ratio: float | None  # canary / baseline (point estimates)
    limit: float | None
    passed: bool | None


def check_view(c: Check) -> CheckView:
    return CheckView(c.name, c.canary, c.baseline, c.ratio, c.limit, c.passed)


@dataclass(frozen=True, slots=True)
class RolloutVerdictView:
    state: CanaryState
    change: str  # record.short() of the hash of what the workers would run
    canary: int  # the worker id
    started_at: float  # wall clock of the window's start (or of the decision when held)
    window_s: float  # the analysis window with its extensions so far, seconds
    ends_at: float | None  # wall clock when the window ends; None once decided
    # One line: "rolled back: canary ITL p99 0.052 s = 5.2x the baseline's over 30 s,
    # 412 vs 2,830 requests"; while analysing, what is known so far.
    evidence: str
    checks: tuple[CheckView, ...] = ()
    rollbacks_total: int = 0  # canary rollbacks since the agent started (a counter)
    # The window ended short of traffic this many times and was extended (of at most
    # `[rollout] max_extensions`); `window_s` counts the extensions too.
    extensions: int = 0
    max_extensions: int = 0
