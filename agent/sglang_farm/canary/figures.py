"""Pure: the figures a canary verdict compares, built from counters and histograms.

A worker's figures over a window are the *difference* of two scrapes, as Prometheus'
`increase()` takes them: counters and histogram buckets are cumulative since the
process started, so the window's requests, errors and latency distribution are the
later snapshot minus the earlier one. A counter that went *down* was reset (the worker
restarted inside the window): the later value is then the whole increase, Prometheus'
reset rule.

Where each figure comes from (docs/canary.md, "the figures"):

- latency: SGLang's `sglang:inter_token_latency_seconds` (ITL, one observation per
  output token) and `sglang:time_to_first_token_seconds` (TTFT, one per request)
  histograms, summed over their label sets (`is_streaming`, ...);
- requests and errors, both from **one** source (`ErrorSource`), never mixed in one
  ratio: the worker's own `sglang:http_responses_total{endpoint,status_code,method}`
  (SGLang >= 0.5.20) on the serving routes, its 2xx and 5xx answers the requests and
  the 5xx the errors; else the gateway's per-worker outcomes
  (`smg_worker_cb_outcomes_total{worker=URL, outcome="success"|"failure"}`); else no
  error source at all: SGLang's finished requests (`sglang:num_requests_total`), errors
  not judged. A side's source is the best one all its workers have (`Figures.plus`); the
  canary and the baseline are compared on the best source both have (`common`).
- An abort (`sglang:num_aborted_requests_total`: a client that hung up) is never an
  error, and a 4xx answer is neither a request nor an error: both are the client's doing,
  and any local user can send them straight to a worker's port.

Quantiles are estimated from buckets exactly as PromQL's `histogram_quantile` does
(linear interpolation inside the bucket holding the rank; 0 as the lower edge of the
first bucket; the highest finite bound for a rank in the +Inf bucket), so a figure the
farm shows can be checked against a Prometheus query over the same window.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from sglang_farm.canary.promtext import Labels, Scrape
from sglang_farm.sglang.responses import http_responses as http_responses  # shared

ITL = "sglang:inter_token_latency_seconds"
TTFT = "sglang:time_to_first_token_seconds"
REQUESTS = "sglang:num_requests_total"
ABORTED = "sglang:num_aborted_requests_total"
GATEWAY_OUTCOMES = "smg_worker_cb_outcomes_total"


class ErrorSource(StrEnum):
    """Where a side's requests and errors were counted, best first."""

    WORKERS = "workers"  # each worker's own sglang:http_responses_total
    GATEWAY = "gateway"  # the gateway's per-worker outcomes
    NONE = "none"  # no error source: SGLang's finished requests, errors not judged


_RANK = {ErrorSource.WORKERS: 0, ErrorSource.GATEWAY: 1, ErrorSource.NONE: 2}


@dataclass(frozen=True, slots=True)
class Histogram:
    """A Prometheus histogram: finite upper bounds (ascending), cumulative counts for each
    bound and then +Inf (one more than `bounds`), and the sum of the observations."""

    bounds: tuple[float, ...]
    cumulative: tuple[float, ...]
    total: float = 0.0

    def __post_init__(self) -> None:
        if len(self.cumulative) != len(self.bounds) + 1:
            raise ValueError(
                f"a histogram needs one cumulative count per bound and one for +Inf: "
                f"{len(self.bounds)} bounds, {len(self.cumulative)} counts"
            )
        if any(b >= a for a, b in zip(self.bounds[1:], self.bounds, strict=False)):
            raise ValueError(f"histogram bounds must ascend: {self.bounds}")

    @classmethod
    def from_counts(
        cls, bounds: Sequence[float], counts: Sequence[float], total: float = 0.0
    ) -> Histogram:
        """From per-bucket (not cumulative) counts, the last one the +Inf bucket's."""
        run: list[float] = []
        acc = 0.0
        for c in counts:
            acc += c
            run.append(acc)
        return cls(tuple(bounds), tuple(run), total)

    @classmethod
    def empty(cls, bounds: Sequence[float]) -> Histogram:
        return cls(tuple(bounds), (0.0,) * (len(bounds) + 1))

    @property
    def count(self) -> float:
        return self.cumulative[-1]

    def counts(self) -> tuple[float, ...]:
        """Per-bucket counts, the last one the +Inf bucket's."""
        prev = (0.0, *self.cumulative[:-1])
        return tuple(c - p for c, p in zip(self.cumulative, prev, strict=True))

    def plus(self, other: Histogram) -> Histogram:
        """The two added (several workers as one). Raises ValueError on different bounds."""
        self._same_bounds(other)
        cum = tuple(a + b for a, b in zip(self.cumulative, other.cumulative, strict=True))
        return Histogram(self.bounds, cum, self.total + other.total)

    def since(self, earlier: Histogram) -> Histogram:
        """What was observed after `earlier` (this is later): the delta, or all of this when
        a count went down (a reset). Raises ValueError on different bounds."""
        self._same_bounds(earlier)
        delta = [a - b for a, b in zip(self.cumulative, earlier.cumulative, strict=True)]
        if any(d < 0 for d in delta) or self.total < earlier.total:
            return self
        # A bucket's count never falls below the one before it; rounding may say otherwise.
        for i in range(1, len(delta)):
            delta[i] = max(delta[i], delta[i - 1])
        return Histogram(self.bounds, tuple(delta), self.total - earlier.total)

    def _same_bounds(self, other: Histogram) -> None:
        if self.bounds != other.bounds:
            raise ValueError(
                f"histograms with different buckets cannot be combined: {self.bounds} "
                f"vs {other.bounds} (set the same --bucket-* flags on every worker)"
            )


def quantile(q: float, h: Histogram) -> float | None:
    """PromQL's `histogram_quantile(q, h)`; None when `h` holds no observation."""
    if h.count <= 0 or math.isnan(q):
        return None
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    rank = q * h.count
    i = next(i for i, cum in enumerate(h.cumulative) if cum >= rank)
    cum = h.cumulative[i]
    if i == len(h.bounds):  # the +Inf bucket: its lower edge is the best estimate
        return h.bounds[-1] if h.bounds else None
    upper = h.bounds[i]
    lower = 0.0 if i == 0 else h.bounds[i - 1]
    prev = 0.0 if i == 0 else h.cumulative[i - 1]
    if i == 0 and upper <= 0:
        return upper
    in_bucket = cum - prev
    if in_bucket <= 0:
        return lower
    return lower + (upper - lower) * (rank - prev) / in_bucket


def counter_since(later: float, earlier: float) -> float:
    """A counter's increase: the difference, or `later` when it went down (a reset)."""
    return later if later < earlier else later - earlier


def histogram_of(scrape: Scrape, name: str, **match: str) -> Histogram | None:
    """The histogram `name` from a scrape, its label sets (other than `le`) summed;
    only series whose labels include `match`. None when there is none."""
    buckets: dict[float, float] = {}
    for labels, value in scrape.series(name + "_bucket"):
        le = dict(labels).get("le")
        if le is None or not _matches(labels, match):
            continue
        bound = math.inf if le == "+Inf" else float(le)
        buckets[bound] = buckets.get(bound, 0.0) + value
    if math.inf not in buckets:
        return None
    bounds = tuple(sorted(b for b in buckets if b != math.inf))
    cumulative = tuple(buckets[b] for b in (*bounds, math.inf))
    total = scrape.total(name + "_sum", **match) or 0.0
    return Histogram(bounds, cumulative, total)


def _matches(labels: Labels, match: dict[str, str]) -> bool:
    have = dict(labels)
    return all(have.get(k) == v for k, v in match.items())


@dataclass(frozen=True, slots=True)
class WorkerSample:
    """One worker's cumulative figures at one scrape (SGLang's /metrics and, when there
    is one, the gateway's outcomes for the worker's URL)."""

    itl: Histogram | None
    ttft: Histogram | None
    requests: float  # SGLang's finished requests
    aborted: float  # kept for the record; never counted as an error
    gateway_ok: float | None  # None: no gateway figures for this worker
    gateway_failed: float | None
    # The worker's own HTTP responses on the serving routes (`http_responses`); None: the
    # worker has no such counter (SGLang before 0.5.20).
    answered: float | None = None  # 2xx and 5xx
    server_errors: float | None = None  # 5xx


def worker_sample(sglang: Scrape, gateway: Scrape | None, worker_url: str) -> WorkerSample:
    """A worker's sample from its own /metrics scrape and the gateway's (or None).

    With a gateway scrape, an outcome series the gateway does not show yet counts 0: smg
    creates a worker's `failure` series at its first failure, and a canary just added to
    the gateway has no series at all at the start of its window.
    """
    ok = failed = None
    if gateway is not None:
        ok = gateway.total(GATEWAY_OUTCOMES, worker=worker_url, outcome="success") or 0.0
        failed = gateway.total(GATEWAY_OUTCOMES, worker=worker_url, outcome="failure") or 0.0
    answered, server_errors = http_responses(sglang)
    return WorkerSample(
        itl=histogram_of(sglang, ITL),
        ttft=histogram_of(sglang, TTFT),
        requests=sglang.total(REQUESTS) or 0.0,
        aborted=sglang.total(ABORTED) or 0.0,
        gateway_ok=ok,
        gateway_failed=failed,
        answered=answered,
        server_errors=server_errors,
    )


@dataclass(frozen=True, slots=True)
class Counts:
    """A side's requests and errors over a window as one source counted them."""

    source: ErrorSource
    requests: float
    errors: float


@dataclass(frozen=True, slots=True)
class Figures:
    """What one side (the canary, or the baseline's workers together) did in a window.

    `requests` and `errors` are the best source's (`source`); `counts` holds every
    source the side's workers all had, best first (empty: only `source`'s), so that two
    sides can be compared on one they share (`common`)."""

    seconds: float
    requests: float  # answered, well or with a server error
    errors: float  # answered with a server error (never an abort, never a 4xx)
    itl: Histogram | None
    ttft: Histogram | None
    source: ErrorSource = ErrorSource.WORKERS
    counts: tuple[Counts, ...] = ()

    @property
    def error_ratio(self) -> float:
        return self.errors / self.requests if self.requests > 0 else 0.0

    def all_counts(self) -> tuple[Counts, ...]:
        """Every source's counts, best first (at least this side's own)."""
        return self.counts or (Counts(self.source, self.requests, self.errors),)

    def on(self, source: ErrorSource) -> Figures | None:
        """These figures with requests and errors as `source` counted them; None when this
        side has no such count."""
        for c in self.all_counts():
            if c.source is source:
                return Figures(
                    self.seconds, c.requests, c.errors, self.itl, self.ttft, source, self.counts
                )
        return None

    def plus(self, other: Figures) -> Figures:
        """Two workers' figures over the same window, as one side: counted by the sources
        both have (a worker without a counter takes it from the whole side)."""
        theirs = {c.source: c for c in other.all_counts()}
        counts = tuple(
            Counts(
                c.source, c.requests + theirs[c.source].requests, c.errors + theirs[c.source].errors
            )
            for c in self.all_counts()
            if c.source in theirs
        ) or (Counts(ErrorSource.NONE, self.requests + other.requests, 0.0),)
        best = min(counts, key=lambda c: _RANK[c.source])
        return Figures(
            seconds=max(self.seconds, other.seconds),
            requests=best.requests,
            errors=best.errors,
            itl=_plus(self.itl, other.itl),
            ttft=_plus(self.ttft, other.ttft),
            source=best.source,
            counts=counts,
        )


def common(canary: Figures, baseline: Figures) -> tuple[Figures, Figures]:
    """Both sides counted by the best source they share (never a ratio of one source
    against another's); ErrorSource.NONE (errors not judged) when they share none."""
    mine = {c.source for c in canary.all_counts()}
    shared = sorted(
        (c.source for c in baseline.all_counts() if c.source in mine), key=_RANK.__getitem__
    )
    if shared:
        a, b = canary.on(shared[0]), baseline.on(shared[0])
        assert a is not None and b is not None  # both have it
        return a, b
    return (
        Figures(canary.seconds, canary.requests, 0.0, canary.itl, canary.ttft, ErrorSource.NONE),
        Figures(
            baseline.seconds, baseline.requests, 0.0, baseline.itl, baseline.ttft, ErrorSource.NONE
        ),
    )


def _plus(a: Histogram | None, b: Histogram | None) -> Histogram | None:
    if a is None:
        return b
    if b is None:
        return a
    return a.plus(b)


def _since(later: Histogram | None, earlier: Histogram | None) -> Histogram | None:
    if later is None:
        return None
    if earlier is None or earlier.bounds != later.bounds:
        return later  # it appeared (or was re-bucketed) inside the window: all of it is new
    return later.since(earlier)


def window(earlier: WorkerSample, later: WorkerSample, seconds: float) -> Figures:
    """A worker's figures between two samples `seconds` apart (resets handled).

    Requests and errors are counted by every source both samples have, each on its own
    (`Figures.counts`, best first): the worker's HTTP responses, the gateway's outcomes,
    and always SGLang's finished requests (no errors). An abort counts for none."""
    counts: list[Counts] = []
    if (
        later.answered is not None
        and later.server_errors is not None
        and earlier.answered is not None
        and earlier.server_errors is not None
    ):
        answered = counter_since(later.answered, earlier.answered)
        failed = counter_since(later.server_errors, earlier.server_errors)
        counts.append(Counts(ErrorSource.WORKERS, answered, min(failed, answered)))
    if (
        later.gateway_ok is not None
        and later.gateway_failed is not None
        and earlier.gateway_ok is not None
        and earlier.gateway_failed is not None
    ):
        ok = counter_since(later.gateway_ok, earlier.gateway_ok)
        failed = counter_since(later.gateway_failed, earlier.gateway_failed)
        counts.append(Counts(ErrorSource.GATEWAY, ok + failed, failed))
    counts.append(Counts(ErrorSource.NONE, counter_since(later.requests, earlier.requests), 0.0))
    best = counts[0]
    return Figures(
        seconds=seconds,
        requests=best.requests,
        errors=best.errors,
        itl=_since(later.itl, earlier.itl),
        ttft=_since(later.ttft, earlier.ttft),
        source=best.source,
        counts=tuple(counts),
    )


def combined(sides: Sequence[Figures]) -> Figures | None:
    """Several workers' figures as one (the baseline); None for no worker."""
    if not sides:
        return None
    out = sides[0]
    for f in sides[1:]:
        out = out.plus(f)
    return out


# ---- paired probes (canary/probe.py sends them; docs/canary.md, "Like with like") --------

# The probes' TTFT is measured by the farm itself (not bucketed by SGLang): these bounds,
# 1 ms to about 60 s in steps of 10 %, keep a quantile within 10 % of the true one.
PROBE_BOUNDS = tuple(round(0.001 * 1.1**k, 9) for k in range(116))


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """One probe request to one worker: its time to first token (None: no token came),
    whether it was answered in full, the cached prompt tokens the answer reported."""

    ttft_s: float | None
    ok: bool
    cached_tokens: int | None = None
    error: str = ""


@dataclass(frozen=True, slots=True)
class ProbePair:
    """The same prompt sent at the same moment to the canary and to one baseline worker."""

    canary: ProbeResult
    baseline: ProbeResult
    baseline_worker: int = -1


@dataclass(frozen=True, slots=True)
class ProbeFigures:
    """The pairs both sides answered, as the TTFT of each side (one observation a pair)."""

    pairs: int  # pairs both answered with a first token
    canary_ttft: Histogram
    baseline_ttft: Histogram
    failed_canary: int  # pairs whose canary side failed (for the record; errors are the
    failed_baseline: int  # workers' own counters': a probe's 5xx is counted there)


def probe_histogram(values: Sequence[float]) -> Histogram:
    """`values` (seconds) in PROBE_BOUNDS' buckets."""
    counts = [0.0] * (len(PROBE_BOUNDS) + 1)
    for v in values:
        i = next((i for i, b in enumerate(PROBE_BOUNDS) if v <= b), len(PROBE_BOUNDS))
        counts[i] += 1
    return Histogram.from_counts(PROBE_BOUNDS, counts, float(sum(values)))


def probe_figures(pairs: Sequence[ProbePair]) -> ProbeFigures:
    """The paired probes' figures: only pairs where both sides gave a first token count,
    so each side is judged on exactly the same prompts, sent at the same moments."""
    both = [
        (p.canary.ttft_s, p.baseline.ttft_s)
        for p in pairs
        if p.canary.ttft_s is not None and p.baseline.ttft_s is not None
    ]
    return ProbeFigures(
        pairs=len(both),
        canary_ttft=probe_histogram([c for c, _ in both]),
        baseline_ttft=probe_histogram([b for _, b in both]),
        failed_canary=sum(1 for p in pairs if not p.canary.ok),
        failed_baseline=sum(1 for p in pairs if not p.baseline.ok),
    )
