"""progress's reading of a worker's own counters (issue 24 §1): progress, or a stall with
requests running on an idle GPU. What either means in the worker's phase (busy, wedged)
is the supervisor's (tests/test_supervisor.py)."""

from __future__ import annotations

from sglang_farm.sglang.load import WorkerStats
from sglang_farm.workers.progress import IDLE_GPU_RATIO, assess_progress, progress_events
from sglang_farm.workers.supervisor import ProgressSeen, Wedged

STALL = 120.0


def stats(changed_at: float | None, running: float | None = 2.0, up: bool = True) -> WorkerStats:
    return WorkerStats(worker=1, taken_at=0.0, up=up, running=running, changed_at=changed_at)


def events(
    previous: float | None, st: WorkerStats, now: float, gpu_util: float | None = None
) -> list[ProgressSeen | Wedged]:
    return progress_events(previous, st, gpu_util=gpu_util, stall_window=STALL, now=now)


def test_counters_that_moved_since_the_last_look_are_progress() -> None:
    assert events(10.0, stats(20.0), now=21.0) == [ProgressSeen()]
    assert events(20.0, stats(20.0), now=21.0) == []  # unchanged
    assert events(None, stats(20.0), now=21.0) == []  # a first look compares with nothing


def test_requests_running_with_no_progress_for_the_stall_window_is_a_stall() -> None:
    [wedged] = events(20.0, stats(20.0), now=20.0 + STALL)
    assert wedged == Wedged("2 requests running and no token or request progress for 120 s")
    assert events(20.0, stats(20.0), now=20.0 + STALL - 1) == []  # not yet


def test_no_stall_without_requests_or_while_the_gpu_computes() -> None:
    assert events(20.0, stats(20.0, running=0.0), now=500.0) == []
    assert events(20.0, stats(20.0, running=None), now=500.0) == []
    assert events(20.0, stats(20.0), now=500.0, gpu_util=IDLE_GPU_RATIO) == []
    [idle] = events(20.0, stats(20.0), now=500.0, gpu_util=0.01)
    assert idle == Wedged(
        "2 requests running and no token or request progress for 480 s, GPU 1% busy"
    )


def test_a_worker_that_does_not_answer_reports_nothing() -> None:
    assert events(10.0, stats(20.0, up=False), now=500.0) == []
    assert events(10.0, stats(None), now=500.0) == []
    a = assess_progress(10.0, stats(None), gpu_util=None, stall_window=STALL, now=500.0)
    assert not a.progressed and a.wedged is None


def test_progress_and_a_stall_are_both_reported() -> None:
    """Counters moved at the last look, long ago: progress, and stalled since."""
    assert events(10.0, stats(20.0), now=20.0 + STALL) == [
        ProgressSeen(),
        Wedged("2 requests running and no token or request progress for 120 s"),
    ]
