"""Pure: the canary verdict: promote, roll back, or inconclusive, with its evidence in
one line and every figure it compared.

The canary (the worker(s) already on the new config) is compared with the baseline:
the workers still on the old config, behind the same gateway, over the same window.
Why each rule is what it is, and the measurements behind the defaults, are in
docs/canary.md; in short:

1. **Liveness first.** Any crash, hang, OOM or failed health check of the canary inside
   the window rolls it back at once, whatever the figures: the change caused it.
2. **Errors.** The canary's error ratio fails it when it reaches an absolute floor
   (`error_floor`), exceeds the baseline's by a factor (`error_max_ratio`), rests on at
   least `min_errors` errors, and is more than chance: were the canary as good as the
   baseline, each of the window's errors would fall on it with its share of the
   requests, so the chance of it holding at least its count (a binomial tail,
   `error_p_value`) must be below 1 - `confidence`. The baseline's stray errors thus
   count against the canary's. Judged even below `min_requests`: a canary that fails
   most of its few requests is not kept. Above the floor and the baseline's ratio but
   not yet beyond chance, the errors are undecided: never a pass, the verdict at the
   window's end is "too little traffic" (the window may be extended), not a promotion.
   Both sides are counted by one source they share (`figures.common`: the workers' own
   HTTP responses, else the gateway's outcomes); an abort is never an error. With no
   error source the errors are not judged, and the verdict is never a promotion
   (inconclusive, saying so: a longer window would see no more).
3. **Latency.** Inter-token latency quantiles (p50 and p99 by default) as a ratio to the
   baseline's, with a noise margin: the check fails only when even the canary's *lower*
   confidence bound, divided by the baseline's *upper* one, exceeds the limit. The
   bounds are the quantiles at the ranks of the order statistics that bound the
   quantile (exact binomial ranks, `rank_bounds`), with n the side's *effective*
   sample size, its request count (the tokens of one request share its batch, context
   and stalls: they are not independent observations), so a quantile the data cannot
   pin down (the p99 of a baseline of 60 requests) is not judged. A metric is judged
   once each side's histogram holds `min_observations` observations (Kayenta's 50 data
   points per metric; an ITL histogram counts tokens), whatever `min_requests` says:
   a check whose bounds already show a regression rolls the canary back. TTFT is
   weighed less: only its median, against a looser limit, because cache-aware routing
   gives a freshly restarted canary a cold prefix cache and a different request mix.
4. **Enough data to promote.** Below `min_requests` on either side (and with nothing
   failed) the verdict is inconclusive; what to do then is the caller's policy
   (`[rollout] on_inconclusive`).

How the agent is to use this (the API, also in docs/canary.md):

    from sglang_farm.canary import figures, promtext, verdict
    s0 = figures.worker_sample(promtext.parse(body0), gw0, url)   # at window start
    s1 = figures.worker_sample(promtext.parse(body1), gw1, url)   # at window end
    canary = figures.window(s0, s1, seconds)
    baseline = figures.combined([figures.window(a, b, seconds) for ...])
    v = verdict.judge(canary, baseline, liveness_events, verdict.CanaryPolicy())
    v.outcome, v.evidence, v.checks

`judge` may be called before the window ends (`complete=False`): it then returns a
ROLLBACK as soon as one is certain (liveness, errors, a latency check failed with the
margin) and INCONCLUSIVE otherwise, never PROMOTE.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from sglang_farm.canary.figures import (
    ErrorSource,
    Figures,
    Histogram,
    ProbeFigures,
    common,
    quantile,
)
from sglang_farm.sglang.failures import Failure, FailureKind


class Outcome(StrEnum):
    PROMOTE = "promote"
    ROLLBACK = "rollback"
    INCONCLUSIVE = "inconclusive"


class LivenessKind(StrEnum):
    """What happened to the canary (the agent maps its failures onto these)."""

    CRASHED = "crashed"
    OOM = "oom"
    HUNG = "hung"
    WEDGED = "wedged"


@dataclass(frozen=True, slots=True)
class LivenessEvent:
    """A canary's liveness failure `after_s` seconds into the window; `detail` is one line
    (the failure's summary, e.g. "CUDA out of memory while serving")."""

    kind: LivenessKind
    after_s: float
    detail: str = ""


def liveness_event(failure: Failure, after_s: float) -> LivenessEvent:
    """The event for a classified failure of the canary `after_s` into the window: an
    out-of-memory failure is OOM, a failed liveness probe HUNG, anything else CRASHED
    (the worker exited); its summary is the detail."""
    if failure.oom_kind is not None:
        kind = LivenessKind.OOM
    elif failure.kind is FailureKind.HANG:
        kind = LivenessKind.HUNG
    else:
        kind = LivenessKind.CRASHED
    return LivenessEvent(kind, after_s, failure.summary)


@dataclass(frozen=True, slots=True)
class CanaryPolicy:
    """The thresholds of a verdict; defaults justified in docs/canary.md."""

    min_requests: int = 50  # per side, to promote
    min_observations: int = 50  # per side and metric, to judge it (Kayenta's 50 data points)
    itl_quantiles: tuple[float, ...] = (0.5, 0.99)
    itl_max_ratio: float = 1.4  # canary's lower bound / baseline's upper bound
    ttft_quantile: float = 0.5
    ttft_max_ratio: float = 3.0  # looser: a cold prefix cache and a different request mix
    confidence: float = 0.98  # one-sided, per bound (Kayenta's default confidence)
    error_floor: float = 0.01  # an error ratio below 1 % never fails a canary
    error_max_ratio: float = 2.0  # ... nor one below twice the baseline's
    min_errors: int = 2  # ... nor fewer than 2 errors (and the binomial test, above)

    def __post_init__(self) -> None:
        problems = []
        if self.min_requests < 1:
            problems.append(f"min_requests must be >= 1, got {self.min_requests}")
        if not all(0 < q < 1 for q in (*self.itl_quantiles, self.ttft_quantile)):
            problems.append("quantiles must lie strictly between 0 and 1")
        if self.itl_max_ratio <= 1 or self.ttft_max_ratio <= 1 or self.error_max_ratio < 1:
            problems.append("ratio limits must be above 1")
        if not 0.5 <= self.confidence < 1:
            problems.append(f"confidence must be in [0.5, 1), got {self.confidence}")
        if not 0 <= self.error_floor < 1:
            problems.append(f"error_floor must be in [0, 1), got {self.error_floor}")
        if self.min_observations < 1:
            problems.append(f"min_observations must be >= 1, got {self.min_observations}")
        if self.min_errors < 1:
            problems.append(f"min_errors must be >= 1, got {self.min_errors}")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass(frozen=True, slots=True)
class Check:
    """One comparison. `passed` None: not judged (no data, or too little to pin it down)."""

    name: str  # "liveness", "errors", "itl_p50", "itl_p99", "ttft_p50", "traffic"
    passed: bool | None
    canary: float | None
    baseline: float | None
    ratio: float | None  # canary / baseline (point estimates)
    margin_ratio: float | None  # the conservative ratio judged against `limit`
    limit: float | None
    text: str  # one phrase: "canary ITL p99 0.052 s = 5.2x the baseline's 0.010 s"


@dataclass(frozen=True, slots=True)
class Verdict:
    outcome: Outcome
    evidence: str  # one line, for status, why, logs and the alert
    checks: tuple[Check, ...]
    canary_requests: float
    baseline_requests: float
    seconds: float

    @property
    def failed(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if c.passed is False)


def _seconds(s: float) -> str:
    return f"{s:.3g} s" if s < 100 else f"{s:,.0f} s"


def _count(n: float) -> str:
    return f"{round(n):,}"


def _pct(r: float) -> str:
    return f"{100 * r:.1f} %"


def _qname(q: float) -> str:
    return f"p{round(100 * q, 1):g}"


def _upper_quantile(q: float, h: Histogram) -> float | None:
    """`quantile`, but a rank inside the +Inf bucket is unbounded (inf), not the last bound."""
    if h.count <= 0:
        return None
    if q >= 1 or q * h.count > h.cumulative[-2 if h.bounds else -1]:
        return math.inf
    return quantile(q, h)


def _lower_quantile(rank: float, h: Histogram) -> float | None:
    """`quantile`, but rank 0 (the smallest observation) is the lower edge of the first
    bucket that holds an observation, not 0."""
    if rank > 0:
        return quantile(rank, h)
    first = next(i for i, cum in enumerate(h.cumulative) if cum > 0)
    return h.bounds[first - 1] if first > 0 else 0.0


def rank_bounds(q: float, n: int, confidence: float) -> tuple[float | None, float | None]:
    """The ranks (fractions of a side's observations) of the confidence bounds of its
    q-quantile with `n` independent observations, distribution-free: the k-th smallest
    of n lies at or below the q-quantile with probability P(Binomial(n, q) >= k). The
    lower bound is the largest k for which that chance is at least `confidence`, taken at
    the bottom of its step, rank (k-1)/n; the upper one the smallest m with
    P(Binomial(n, q) < m) >= `confidence`, at the top of its step, m/n. None where no
    such order statistic exists (too few observations: no lower bound but 0, no upper
    bound at all). Exact where the normal approximation of the rank is not (a p99 of a
    few dozen requests: docs/canary.md)."""
    alpha = 1 - confidence
    log_q, log_p = math.log(q), math.log1p(-q)
    head = math.lgamma(n + 1)
    below = 0.0  # P(Binomial(n, q) < i)
    lower: int | None = None
    for i in range(n + 1):
        if below >= confidence:
            return ((lower - 1) / n if lower else None), i / n
        if below <= alpha:
            lower = i
        below += math.exp(
            head - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_q + (n - i) * log_p
        )
    return ((lower - 1) / n if lower else None), None


def quantile_bounds(
    q: float, h: Histogram, n: float, confidence: float
) -> tuple[float | None, float | None, float | None]:
    """(lower bound, estimate, upper bound) of the q-quantile of `h` with `n` independent
    observations (the effective sample: a side's requests): the quantiles at the ranks
    of `rank_bounds`. The upper bound is inf where it falls past the last finite bucket
    or where no order statistic bounds it; the lower one 0 where none does, and the
    lower edge of the smallest observation's bucket where that one does."""
    est = quantile(q, h)
    if est is None or n < 1:
        return None, est, None
    lo_rank, hi_rank = rank_bounds(q, int(n), confidence)
    lo = _lower_quantile(lo_rank, h) if lo_rank is not None else 0.0
    hi = _upper_quantile(hi_rank, h) if hi_rank is not None else math.inf
    return lo, est, hi


def _latency_check(
    label: str,
    q: float,
    canary: Histogram | None,
    canary_n: float,
    baseline: Histogram | None,
    baseline_n: float,
    limit: float,
    confidence: float,
    min_observations: int,
    on: str = "",
) -> Check:
    name = f"{label.lower()}_{_qname(q)}"
    what = f"{label} {_qname(q)}{on}"
    if canary is None or baseline is None or canary.count <= 0 or baseline.count <= 0:
        return Check(name, None, None, None, None, None, limit, f"no {label} data")
    c_lo, c, _ = quantile_bounds(q, canary, min(canary_n, canary.count), confidence)
    _, b, b_hi = quantile_bounds(q, baseline, min(baseline_n, baseline.count), confidence)
    assert c is not None and b is not None  # both hold observations
    ratio = c / b if b > 0 else None
    text = f"canary {what} {_seconds(c)} = " + (
        f"{ratio:.1f}x the baseline's {_seconds(b)}" if ratio is not None else "(baseline 0)"
    )
    fewest = min(canary.count, baseline.count)
    if fewest < min_observations:
        few = f" (too few to judge: {_count(fewest)} observations, {min_observations:,} needed)"
        return Check(name, None, c, b, ratio, None, limit, text + few)
    if c_lo is None or b_hi is None or math.isinf(b_hi) or b_hi <= 0:
        return Check(name, None, c, b, ratio, None, limit, text + " (too few to judge)")
    margin = c_lo / b_hi
    return Check(name, margin <= limit, c, b, ratio, margin, limit, text)


def error_p_value(
    errors: float, requests: float, base_errors: float, base_requests: float
) -> float:
    """The chance that the canary holds at least `errors` of the window's errors if it were
    as good as the baseline: each error then falls on the canary with its share of the
    requests, so the count is binomial (the exact conditional test of two Poisson rates).
    1.0 where there is nothing to compare (no errors, no baseline requests)."""
    k, t = round(errors), round(errors + base_errors)
    if k <= 0 or requests <= 0 or base_requests <= 0:
        return 1.0
    f = requests / (requests + base_requests)
    log_f, log_g = math.log(f), math.log1p(-f)
    head = math.lgamma(t + 1)
    tail = sum(
        math.exp(head - math.lgamma(i + 1) - math.lgamma(t - i + 1) + i * log_f + (t - i) * log_g)
        for i in range(k, t + 1)
    )
    return tail


NO_ERROR_SOURCE = (
    "the canary's errors are not judged: no error source (the workers count no HTTP "
    "responses, sglang:http_responses_total, which needs SGLang 0.5.20 or later, and no "
    "gateway reports outcomes for them)"
)


def _error_check(canary: Figures, baseline: Figures | None, p: CanaryPolicy) -> Check:
    if canary.source is ErrorSource.NONE:
        return Check("errors", None, None, None, None, None, None, NO_ERROR_SOURCE)
    c = canary.error_ratio
    b = baseline.error_ratio if baseline is not None else 0.0
    allowed = max(p.error_floor, p.error_max_ratio * b)
    text = (
        f"canary errors {_pct(c)} ({_count(canary.errors)} of {_count(canary.requests)}) "
        f"vs the baseline's {_pct(b)}"
    )
    # Above the floor and the baseline's ratio: a regression if the evidence says so
    # (min_errors, the binomial test); else undecided, never a pass: more traffic decides.
    suspect = c >= p.error_floor and c > p.error_max_ratio * b  # so c > 0: an error seen
    failed = suspect and canary.errors >= p.min_errors
    if failed and baseline is not None and baseline.requests > 0:
        chance = error_p_value(canary.errors, canary.requests, baseline.errors, baseline.requests)
        failed = chance < 1 - p.confidence
    ratio = c / b if b > 0 else None
    if canary.requests <= 0:
        return Check("errors", None, None, b, None, None, allowed, "no canary requests")
    if suspect and not failed:
        return Check("errors", None, c, b, ratio, c, allowed, text + " (too few to judge)")
    return Check("errors", not failed, c, b, ratio, c, allowed, text)


def judge(
    canary: Figures,
    baseline: Figures | None,
    liveness: Sequence[LivenessEvent],
    policy: CanaryPolicy,
    *,
    complete: bool = True,
    probes: ProbeFigures | None = None,
) -> Verdict:
    """The verdict on `canary` against `baseline` (None: no worker left on the old config,
    so latency cannot be compared). `complete`: the window is over; before that, only a
    ROLLBACK is final and anything else comes back INCONCLUSIVE. `probes`: the window's
    paired probes (the same prompts to the canary and to baseline workers at the same
    moments): with any pair answered, TTFT is judged on them alone, like with like,
    instead of on the gateway's traffic, whose mix and prefix-cache hits differ between
    a freshly restarted canary and warm baseline workers (docs/canary.md)."""
    seconds = canary.seconds
    if baseline is not None:
        canary, baseline = common(canary, baseline)  # one source for both sides' errors
    base_n = baseline.requests if baseline is not None else 0.0
    tail = f"over {_seconds(seconds)}, {_count(canary.requests)} vs {_count(base_n)} requests"

    def verdict(outcome: Outcome, evidence: str, checks: Sequence[Check]) -> Verdict:
        return Verdict(outcome, evidence, tuple(checks), canary.requests, base_n, seconds)

    if liveness:
        first = min(liveness, key=lambda e: e.after_s)
        detail = f": {first.detail}" if first.detail else ""
        text = f"canary {first.kind.value} {_seconds(first.after_s)} into the window{detail}"
        check = Check("liveness", False, None, None, None, None, None, text)
        return verdict(Outcome.ROLLBACK, text, [check])

    checks = [_error_check(canary, baseline, policy)]
    enough = canary.requests >= policy.min_requests and (
        baseline is None or base_n >= policy.min_requests
    )
    if baseline is not None:
        for q in policy.itl_quantiles:
            checks.append(
                _latency_check(
                    "ITL", q, canary.itl, canary.requests, baseline.itl, base_n,
                    policy.itl_max_ratio, policy.confidence, policy.min_observations,
                )
            )  # fmt: skip
        if probes is not None and probes.pairs > 0:
            n = float(probes.pairs)
            checks.append(
                _latency_check(
                    "TTFT", policy.ttft_quantile, probes.canary_ttft, n, probes.baseline_ttft,
                    n, policy.ttft_max_ratio, policy.confidence, policy.min_observations,
                    on=f" on {_count(n)} paired probes",
                )
            )  # fmt: skip
        else:
            checks.append(
                _latency_check(
                    "TTFT", policy.ttft_quantile, canary.ttft, canary.requests, baseline.ttft,
                    base_n, policy.ttft_max_ratio, policy.confidence, policy.min_observations,
                )
            )  # fmt: skip
    # A failed check stands on its own evidence (its bounds, its binomial test, its
    # observations per metric); `min_requests` is what promoting needs.
    failed = [c for c in checks if c.passed is False]
    if failed:
        return verdict(Outcome.ROLLBACK, f"{failed[0].text} {tail}", checks)
    if not enough:
        need = policy.min_requests
        short = (
            f"too little traffic to judge: {_count(canary.requests)} canary requests"
            if canary.requests < need
            else f"too little baseline traffic to judge: {_count(base_n)} requests"
        )
        text = f"{short} in {_seconds(seconds)}, {need:,} needed"
        return verdict(Outcome.INCONCLUSIVE, text, [*checks, _traffic(False, canary, need)])
    if not complete:
        return verdict(Outcome.INCONCLUSIVE, f"analysis under way: nothing failed {tail}", checks)
    errors = checks[0]
    if canary.source is ErrorSource.NONE:
        # No error source: a change is never promoted on errors nobody counted (held, by
        # `on_inconclusive`'s default); not "too little traffic": more would not help.
        text = f"not promoted: {NO_ERROR_SOURCE} {tail}"
        return verdict(Outcome.INCONCLUSIVE, text, checks)
    if errors.passed is None:
        # Errors above the floor that the canary's traffic cannot yet tell from chance:
        # not promoted on them; too little traffic (so the window may be extended).
        text = f"too little traffic to judge the canary's errors: {errors.text} {tail}"
        more = Check("traffic", False, canary.requests, None, None, None, None, text)
        return verdict(Outcome.INCONCLUSIVE, text, [*checks, more])
    judged = [c for c in checks if c.passed]
    summary = "; ".join(c.text for c in judged[:2]) or "nothing to compare"
    return verdict(Outcome.PROMOTE, f"canary within limits ({summary}) {tail}", checks)


def _traffic(passed: bool, canary: Figures, need: int) -> Check:
    return Check(
        "traffic",
        passed,
        canary.requests,
        None,
        None,
        None,
        float(need),
        f"{_count(canary.requests)} canary requests, {need:,} needed",
    )
