"""Pure: telling a busy worker from a wedged one, by its own counters.

SGLang's `/health` runs a one-token generation that queues behind the batch, so the
busiest worker answers it slowest; and an engine left broken by a CUDA error can keep
answering it. Counters tell them apart: a worker whose generated-token or finished-
request counters advance is working (`progressed`); one with requests running whose
counters have not moved for the stall window, on a GPU that is not computing, is
wedged. The figures are the metric pollers' (`worker_load.WorkerStats`, wall clock).
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_farm.sglang.load import WorkerStats
from sglang_farm.workers.events import ProgressSeen, Wedged

IDLE_GPU_RATIO = 0.05  # below this the GPU is not computing (NVML's utilization sample)


@dataclass(frozen=True, slots=True)
class ProgressAssessment:
    progressed: bool  # counters moved since the previous look
    wedged: str | None = None  # why it is stuck, or None


def assess_progress(
    previous_change: float | None,
    stats: WorkerStats,
    *,
    gpu_util: float | None,
    stall_window: float,
    now: float,
) -> ProgressAssessment:
    """`previous_change`: `stats.changed_at` at the previous look (None: first look)."""
    if not stats.up or stats.changed_at is None:
        return ProgressAssessment(False)
    progressed = previous_change is not None and stats.changed_at != previous_change
    running = stats.running or 0.0
    frozen_for = now - stats.changed_at
    if running <= 0 or frozen_for < stall_window:
        return ProgressAssessment(progressed)
    if gpu_util is not None and gpu_util >= IDLE_GPU_RATIO:
        return ProgressAssessment(progressed)  # the GPU computes: slow, not stuck
    gpu = "" if gpu_util is None else f", GPU {gpu_util:.0%} busy"
    return ProgressAssessment(
        progressed,
        f"{running:g} requests running and no token or request progress for "
        f"{frozen_for:.0f} s{gpu}",
    )


def progress_events(
    previous_change: float | None,
    stats: WorkerStats,
    *,
    gpu_util: float | None,
    stall_window: float,
    now: float,
) -> list[ProgressSeen | Wedged]:
    """What one look at a worker's counters reports to the supervisor, which decides what
    counts in the worker's phase (a wedged verdict only while it serves)."""
    a = assess_progress(
        previous_change, stats, gpu_util=gpu_util, stall_window=stall_window, now=now
    )
    events: list[ProgressSeen | Wedged] = [ProgressSeen()] if a.progressed else []
    if a.wedged is not None:
        events.append(Wedged(a.wedged))
    return events
