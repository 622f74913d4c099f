"""Pure: a worker's load figures: what one poll gives (`WorkerSample`), what the farm
keeps and exports (`WorkerStats`), and the staleness verdict between them
(`WorkerStatsTracker`). The poll itself is `sglang.stats` (I/O, httpx).

Both endpoints keep answering while SGLang's scheduler hangs: `/metrics` is
file-backed (multiprocess mode) and `/v1/loads` is read from /dev/shm, so they
serve frozen values (docs/reference/sglang.md §8, §9). The tracker therefore compares
each sample's *progress fingerprint* (scheduler-side values and counters, or the
LoadSnapshot timestamps) with the previous one: unchanged for longer than
`window_s` while requests are running means stale. A worker that does not
answer is `up=False` and stale.

A worker whose SGLang counts its HTTP answers (`sglang:http_responses_total`, SGLang
>= 0.5.20, `sglang.responses`) also has its recent 5xx ratio: the tracker keeps its
cumulative answers and 5xx of the polls of the last `RECENT_WINDOW_S` (`answers`), and
`recent_answers` takes their increase (a reset, the worker restarted, counted as
Prometheus' `increase()` counts it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

# How far back `farmctl status`'s 5xx ratio looks: Prometheus' usual rate window.
RECENT_WINDOW_S = 300.0


@dataclass(frozen=True, slots=True)
class WorkerSample:
    """What one poll of a worker returned. Figures are summed over DP ranks (ratios: max/mean)."""

    worker: int
    taken_at: float  # wall clock
    ok: bool
    duration_s: float = 0.0
    source: str | None = None  # "metrics" or "loads"
    running: float | None = None
    queued: float | None = None
    token_usage: float | None = None  # KV-cache usage ratio 0..1 (fullest DP rank)
    gen_throughput: float | None = None  # tokens/s
    cache_hit_rate: float | None = None  # prefix-cache hit ratio 0..1 (mean over ranks)
    model_name: str | None = None
    sglang_version: str | None = None
    progress: tuple[tuple[str, float], ...] = ()
    error: str | None = None
    # SGLang's own answers on the serving routes since the worker started (2xx and 5xx),
    # and the 5xx of them; None: its SGLang has no such counter (before 0.5.20).
    answered: float | None = None
    server_errors: float | None = None


# (taken_at, answered, server errors) of one poll: cumulative, as SGLang counts them.
AnswerPoint = tuple[float, float, float]


@dataclass(frozen=True, slots=True)
class RecentAnswers:
    """A worker's answers and 5xx between its oldest and newest poll of the window."""

    seconds: float  # from the oldest poll to the newest
    answered: float  # 2xx and 5xx
    server_errors: float  # 5xx

    @property
    def ratio(self) -> float | None:
        """The 5xx share of the answers; None when there was none."""
        return self.server_errors / self.answered if self.answered > 0 else None


def _increase(later: float, earlier: float) -> float:
    """A counter's increase: the difference, or `later` when it went down (a reset)."""
    return later if later < earlier else later - earlier


def recent_answers(points: Sequence[AnswerPoint]) -> RecentAnswers | None:
    """What the polls `points` (oldest first) saw answered; None with fewer than two."""
    if len(points) < 2:
        return None
    answered = errors = 0.0
    for (_, a0, e0), (_, a1, e1) in pairwise(points):
        answered += _increase(a1, a0)
        errors += _increase(e1, e0)
    return RecentAnswers(points[-1][0] - points[0][0], answered, min(errors, answered))


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """A worker's latest figures, with the staleness verdict. What metrics export."""

    worker: int
    taken_at: float
    up: bool  # answered the last poll
    running: float | None = None
    queued: float | None = None
    token_usage: float | None = None
    gen_throughput: float | None = None
    cache_hit_rate: float | None = None
    model_name: str | None = None
    sglang_version: str | None = None
    source: str | None = None
    stale: bool = False
    stale_reason: str | None = None
    error: str | None = None
    poll_duration_s: float = 0.0
    progress: tuple[tuple[str, float], ...] = ()
    changed_at: float | None = None  # wall clock when `progress` last changed
    answered: float | None = None  # SGLang's answers on the serving routes (cumulative)
    server_errors: float | None = None  # ... and the 5xx of them; None: no such counter
    # The polls of the last `RECENT_WINDOW_S` that had the counter, oldest first.
    answers: tuple[AnswerPoint, ...] = ()

    @property
    def recent(self) -> RecentAnswers | None:
        """The answers and 5xx of the window; None: no counter, or one poll of it yet."""
        return recent_answers(self.answers)


@dataclass(frozen=True, slots=True)
class WorkerStatsTracker:
    """Pure: folds samples into `WorkerStats`, deciding staleness.

    `window_s`: SGLang publishes load snapshots at least every 15 decode steps and
    updates gen_throughput every 40 (`--decode-log-interval`), well under a second
    each on a healthy GPU; 30 s of no change while requests run is a hang, not a
    slow batch.
    """

    window_s: float = 30.0
    answers_window_s: float = RECENT_WINDOW_S

    def _answers(self, prev: WorkerStats | None, new: WorkerSample) -> tuple[AnswerPoint, ...]:
        """The window's polls with `new` added; none when `new` has no counter."""
        if new.answered is None or new.server_errors is None:
            return ()
        points = (*(prev.answers if prev else ()), (new.taken_at, new.answered, new.server_errors))
        since = new.taken_at - self.answers_window_s
        return tuple(p for p in points if p[0] >= since)

    def update(self, prev: WorkerStats | None, new: WorkerSample, now: float) -> WorkerStats:
        model = new.model_name or (prev.model_name if prev else None)
        version = new.sglang_version or (prev.sglang_version if prev else None)
        if not new.ok:
            return WorkerStats(
                worker=new.worker,
                taken_at=new.taken_at,
                up=False,
                model_name=model,
                sglang_version=version,
                stale=True,
                stale_reason=f"no answer: {new.error}",
                error=new.error,
                poll_duration_s=new.duration_s,
                # Keep the last fingerprint: values frozen across an outage still count as frozen.
                progress=prev.progress if prev else (),
                changed_at=prev.changed_at if prev else None,
                # Kept: the window's polls stay what they were (`recent` says when).
                answers=prev.answers if prev else (),
            )
        if prev is not None and prev.changed_at is not None and prev.progress == new.progress:
            changed_at = prev.changed_at
        else:
            changed_at = now
        frozen_for = now - changed_at
        stale = bool(new.running) and frozen_for > self.window_s
        reason = (
            f"values unchanged for {frozen_for:.0f}s while {new.running:g} requests run "
            "(SGLang's endpoints answer frozen values while its scheduler hangs)"
            if stale and new.running is not None
            else None
        )
        return WorkerStats(
            worker=new.worker,
            taken_at=new.taken_at,
            up=True,
            running=new.running,
            queued=new.queued,
            token_usage=new.token_usage,
            gen_throughput=new.gen_throughput,
            cache_hit_rate=new.cache_hit_rate,
            model_name=model,
            sglang_version=version,
            source=new.source,
            stale=stale,
            stale_reason=reason,
            poll_duration_s=new.duration_s,
            progress=new.progress,
            changed_at=changed_at,
            answered=new.answered,
            server_errors=new.server_errors,
            answers=self._answers(prev, new),
        )
