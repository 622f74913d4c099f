"""Pure: what the simulated scheduler publishes: its gauges (`SchedulerStats`), the
tokenizer's counters (`TokenizerStats`) and their histograms (`HistogramSnapshot`).

`sim.engine` refreshes them; `sim.exposition` writes them as `/metrics` and `/v1/loads`.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """Upper bounds (without +Inf), per-bucket counts (last one is +Inf), sum and count."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    total: float

    @property
    def count(self) -> int:
        return sum(self.counts)

    @classmethod
    def empty(cls, bounds: Sequence[float]) -> HistogramSnapshot:
        return cls(tuple(bounds), (0,) * (len(bounds) + 1), 0.0)

    def observe(self, value: float) -> HistogramSnapshot:
        i = bisect.bisect_left(self.bounds, value)
        counts = list(self.counts)
        counts[i] += 1
        return HistogramSnapshot(self.bounds, tuple(counts), self.total + value)


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """What the scheduler last published: the LoadSnapshot core and the scheduler gauges."""

    timestamp: float
    num_running_reqs: int
    num_waiting_reqs: int
    num_waiting_uncached_tokens: int
    num_used_tokens: int
    max_total_num_tokens: int
    max_running_requests: int
    token_usage: float
    gen_throughput: float
    cache_hit_rate: float
    utilization: float
    queue_time: HistogramSnapshot


@dataclass(frozen=True, slots=True)
class TokenizerStats:
    """Tokenizer-side counters and histograms (updated as requests finish)."""

    prompt_tokens: int
    generation_tokens: int
    num_requests: int
    num_aborted: int
    e2e: HistogramSnapshot
    ttft: HistogramSnapshot
    # One observation per token after a request's first, as SGLang counts its
    # `sglang:inter_token_latency_seconds` (each output's interval spread over its tokens).
    itl: HistogramSnapshot
