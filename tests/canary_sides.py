"""One side of a canary comparison (the window's figures of a worker): the verdict's and
the rollout's tests build them alike.
"""

from __future__ import annotations

import random

from sglang_farm.canary import figures
from sglang_farm.canary.figures import Figures, Histogram
from sglang_farm.sim.engine import ITL_BUCKETS, TTFT_BUCKETS


def hist(bounds: tuple[float, ...], values: list[float]) -> Histogram:
    counts = [0.0] * (len(bounds) + 1)
    for v in values:
        i = next((i for i, b in enumerate(bounds) if v <= b), len(bounds))
        counts[i] += 1
    return Histogram.from_counts(bounds, counts, sum(values))


def side(
    requests: int,
    *,
    itl: float = 0.02,
    ttft: float = 0.3,
    errors: int = 0,
    seed: int = 1,
    tokens: int = 20,
) -> Figures:
    """`requests` requests of `tokens` tokens, each request's ITL drawn around `itl`."""
    rng = random.Random(seed)
    gaps: list[float] = []
    firsts: list[float] = []
    for _ in range(requests):
        r = itl * rng.lognormvariate(0, 0.15)
        gaps += [r * rng.lognormvariate(0, 0.1) for _ in range(tokens)]
        firsts.append(ttft * rng.lognormvariate(0, 0.3))
    return Figures(
        30.0, float(requests), float(errors), hist(ITL_BUCKETS, gaps), hist(TTFT_BUCKETS, firsts)
    )


def _worker(
    base: Figures,
    *,
    ok: float,
    failed: float = 0.0,
    aborted: float = 0.0,
    gateway: bool = True,
) -> tuple[figures.WorkerSample, figures.WorkerSample]:
    """A worker's two samples over a window: `ok` + `failed` answered through the gateway
    (or, without one, by SGLang alone), `aborted` streams hung up on by their client;
    the latency histograms are `base`'s."""
    start = figures.WorkerSample(
        None, None, 0.0, 0.0, 0.0 if gateway else None, 0.0 if gateway else None
    )
    end = figures.WorkerSample(
        base.itl,
        base.ttft,
        ok,
        aborted,
        ok if gateway else None,
        failed if gateway else None,
    )
    return start, end
