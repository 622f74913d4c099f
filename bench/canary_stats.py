"""Pure: which statistics should judge a canary? A simulation (issue 23 #1; docs/canary.md).

Synthetic windows of a canary (one worker's share of the traffic) and its baseline
(seven workers on the old config, the same minutes), filled into SGLang's real
histogram buckets, judged by three methods, many times over with different seeds:

- `ratio`: the farm's verdict (`sglang_farm.canary.verdict.judge`, default policy):
  quantile ratios with a confidence margin, TTFT weighed less, error floors;
- `mwu`: Kayenta's way, a Mann-Whitney U test per metric (ITL tokens, TTFT requests,
  errors as 0/1 per request) on the bucketed observations, one-sided at confidence
  0.98; the canary fails when any metric is significantly worse;
- `mwu_effect`: the same, but a metric fails only when its median is also at least
  1.2x the baseline's (Kayenta's `effectSize` allowance).

The world the samples come from (the assumptions, stated in docs/canary.md): ITL
20 ms, each request its own factor (batch size, context length: lognormal sd 0.2), each
token its own (sd 0.1) and 3 % of tokens stalled 3-8x behind a prefill; every worker its
own systematic factor (sd 0.05: its GPU, its request mix); TTFT 0.3 s, sd 0.5 per request,
and a harmless canary's TTFT 1.8x (its prefix cache is cold and cache-aware routing
sends it another mix); 0.1 % errors everywhere unless the scenario adds some.

`run(quick)` returns, for each canary request count and scenario, how often each
method rolled the canary back (a harmless change: the false-positive rate; a bad one:
the detection rate, 1 - false negatives) and how often the farm's verdict was
inconclusive. `python -m bench canary` prints the table.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

from sglang_farm.canary.figures import Figures, Histogram, quantile
from sglang_farm.canary.verdict import CanaryPolicy, Outcome, judge
from sglang_farm.sim.engine import ITL_BUCKETS, TTFT_BUCKETS

BASE_ITL_S = 0.020
BASE_TTFT_S = 0.3
BASE_ERRORS = 0.001
BASELINE_WORKERS = 7
TOKENS = (16, 256)  # output tokens per request, uniform
DRAWS_PER_REQUEST = 4  # a request's tokens are placed by this many draws (speed)
CONFIDENCE = 0.98
EFFECT = 1.2
STARVED_BASE = 200  # each baseline worker's requests beside a starved canary


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    itl: float = 1.0  # the canary's ITL factor
    errors: float = BASE_ERRORS  # the canary's error probability
    ttft: float = 1.8  # the canary's TTFT factor (cold cache, other mix)
    bad: bool = True


SCENARIOS = (
    Scenario("harmless", bad=False),
    Scenario("harmless, warm cache", ttft=1.0, bad=False),
    Scenario("ITL 1.5x", itl=1.5),
    Scenario("ITL 2x", itl=2.0),
    Scenario("ITL 5x", itl=5.0),
    Scenario("errors 2 %", errors=0.02),
    Scenario("errors 10 %", errors=0.10),
)


@dataclass(slots=True)
class Side:
    """One side's raw bucket counts (per bucket, +Inf last) and request outcomes."""

    itl: list[float]
    itl_sum: float
    ttft: list[float]
    ttft_sum: float
    requests: int
    errors: int

    def figures(self, seconds: float) -> Figures:
        return Figures(
            seconds,
            float(self.requests),
            float(self.errors),
            Histogram.from_counts(ITL_BUCKETS, self.itl, self.itl_sum),
            Histogram.from_counts(TTFT_BUCKETS, self.ttft, self.ttft_sum),
        )


def _side() -> Side:
    return Side([0.0] * (len(ITL_BUCKETS) + 1), 0.0, [0.0] * (len(TTFT_BUCKETS) + 1), 0.0, 0, 0)


def _fill(
    s: Side, rng: random.Random, n: int, worker: float, itl: float, ttft: float, errors: float
) -> None:
    for _ in range(n):
        s.requests += 1
        if rng.random() < errors:
            s.errors += 1
            continue
        req = BASE_ITL_S * worker * itl * rng.lognormvariate(0, 0.2)
        tokens = rng.randint(*TOKENS)
        per_draw = (tokens - 1) / DRAWS_PER_REQUEST
        for _ in range(DRAWS_PER_REQUEST):
            gap = req * rng.lognormvariate(0, 0.1)
            if rng.random() < 0.03:
                gap *= rng.uniform(3, 8)
            s.itl[bisect.bisect_left(ITL_BUCKETS, gap)] += per_draw
            s.itl_sum += gap * per_draw
        first = BASE_TTFT_S * ttft * rng.lognormvariate(0, 0.5)
        s.ttft[bisect.bisect_left(TTFT_BUCKETS, first)] += 1
        s.ttft_sum += first


def trial(
    scenario: Scenario, n: int, rng: random.Random, per_worker: int | None = None
) -> tuple[Side, Side]:
    """One window: the canary's `n` requests and the baseline's 7n (7 x `per_worker`:
    a canary starved of traffic, as smg starves a slow one)."""
    canary = _side()
    _fill(
        canary,
        rng,
        n,
        rng.lognormvariate(0, 0.05),
        scenario.itl,
        scenario.ttft,
        scenario.errors,
    )
    base = _side()
    for _ in range(BASELINE_WORKERS):
        _fill(base, rng, per_worker or n, rng.lognormvariate(0, 0.05), 1.0, 1.0, BASE_ERRORS)
    return canary, base


def mwu_p(canary: Sequence[float], base: Sequence[float]) -> float:
    """One-sided p-value that the canary's values are larger (Mann-Whitney U on bucketed
    observations: ties within a bucket, the normal approximation with tie correction)."""
    n1, n2 = sum(canary), sum(base)
    if n1 <= 0 or n2 <= 0:
        return 1.0
    below = 0.0
    u = 0.0
    ties = 0.0
    for c, b in zip(canary, base, strict=True):
        u += c * (below + 0.5 * b)
        below += b
        t = c + b
        ties += t**3 - t
    big_n = n1 + n2
    var = n1 * n2 / 12 * ((big_n + 1) - ties / (big_n * (big_n - 1)))
    if var <= 0:
        return 1.0
    z = (u - n1 * n2 / 2) / math.sqrt(var)
    return 1 - NormalDist().cdf(z)


def _median_ratio(c: Histogram, b: Histogram) -> float:
    qc, qb = quantile(0.5, c), quantile(0.5, b)
    return qc / qb if qc is not None and qb else math.inf


def mwu_fails(canary: Side, base: Side, *, effect: float | None, only: str | None = None) -> bool:
    """Kayenta's way: any metric significantly worse (and, given `effect`, by that ratio
    of medians) fails; `only` judges one metric ("itl", "ttft", "errors")."""
    alpha = 1 - CONFIDENCE
    cf, bf = canary.figures(1.0), base.figures(1.0)
    itl_ratio = _median_ratio(cf.itl, bf.itl) if cf.itl and bf.itl else 0.0
    ttft_ratio = _median_ratio(cf.ttft, bf.ttft) if cf.ttft and bf.ttft else 0.0
    error_ratio = (canary.errors / max(canary.requests, 1)) / max(
        base.errors / max(base.requests, 1), 1e-9
    )
    metrics: list[tuple[str, Sequence[float], Sequence[float], float]] = [
        ("itl", canary.itl, base.itl, itl_ratio),
        ("ttft", canary.ttft, base.ttft, ttft_ratio),
        (
            "errors",
            [canary.requests - canary.errors, canary.errors],
            [base.requests - base.errors, base.errors],
            error_ratio,
        ),
    ]
    for name, c, b, ratio in metrics:
        if only is not None and name != only:
            continue
        if mwu_p(c, b) < alpha and (effect is None or ratio >= effect):
            return True
    return False


def cell(
    scenario: Scenario, n: int, trials: int, seed: int, per_worker: int | None = None
) -> dict[str, float]:
    """Rollback rates of each method (and the verdict's inconclusive rate) over `trials`."""
    rng = random.Random(seed)
    policy = CanaryPolicy()
    counts = {"ratio": 0, "inconclusive": 0, "mwu": 0, "mwu_itl": 0, "mwu_effect": 0}
    for _ in range(trials):
        canary, base = trial(scenario, n, rng, per_worker)
        v = judge(canary.figures(300.0), base.figures(300.0), [], policy)
        counts["ratio"] += v.outcome is Outcome.ROLLBACK
        counts["inconclusive"] += v.outcome is Outcome.INCONCLUSIVE
        counts["mwu"] += mwu_fails(canary, base, effect=None)
        counts["mwu_itl"] += mwu_fails(canary, base, effect=None, only="itl")
        counts["mwu_effect"] += mwu_fails(canary, base, effect=EFFECT)
    return {k: v / trials for k, v in counts.items()}


def run(quick: bool, say: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    # (canary requests, each baseline worker's; None: the canary's): the starved canaries
    # (10 and 25 requests against 200 per baseline worker) are judged below min_requests.
    sizes: tuple[tuple[int, int | None], ...] = (
        ((25, STARVED_BASE), (50, None), (200, None))
        if quick
        else ((10, STARVED_BASE), (25, STARVED_BASE), (50, None), (200, None), (1000, None))
    )
    trials = 30 if quick else 200
    out: dict[str, Any] = {
        "config": {
            "trials": trials,
            "baseline_workers": BASELINE_WORKERS,
            "itl_s": BASE_ITL_S,
            "ttft_s": BASE_TTFT_S,
            "confidence": CONFIDENCE,
            "effect": EFFECT,
        },
        "cells": [],
    }
    for n, per_worker in sizes:
        for i, sc in enumerate(SCENARIOS):
            say(f"  canary of {n} requests, {sc.name}")
            rates = cell(sc, n, trials, seed=1000 * n + i, per_worker=per_worker)
            out["cells"].append(
                {
                    "requests": n,
                    "baseline_requests": BASELINE_WORKERS * (per_worker or n),
                    "scenario": sc.name,
                    "bad": sc.bad,
                    **rates,
                }
            )
    return out


def table(result: dict[str, Any]) -> str:
    """Markdown: for a harmless change the false-positive rate, for a bad one detection."""
    head = (
        "| canary / baseline requests | change | ratio + margin (farm) | inconclusive | MWU | "
        "MWU, ITL alone | MWU + effect 1.2x |\n| ---: | --- | ---: | ---: | ---: | ---: | ---: |"
    )
    rows = [head]
    for c in result["cells"]:
        kind = "detected" if c["bad"] else "false rollback"
        rows.append(
            f"| {c['requests']} / {c.get('baseline_requests', 7 * c['requests'])} | "
            f"{c['scenario']} ({kind}) | {100 * c['ratio']:.0f} % | "
            f"{100 * c['inconclusive']:.0f} % | {100 * c['mwu']:.0f} % | "
            f"{100 * c['mwu_itl']:.0f} % | {100 * c['mwu_effect']:.0f} % |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    import sys

    result = run("--quick" in sys.argv, lambda m: print(m, file=sys.stderr))
    print(table(result))
