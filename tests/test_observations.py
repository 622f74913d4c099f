"""observations: the pollers' snapshots as supervisor events, with what the next look
compares with (issue 24 §1: the pollers report, the supervisor decides)."""

from __future__ import annotations

from types import MappingProxyType

from sglang_farm.gpus.snapshot import FleetSnapshot, GpuSnapshot
from sglang_farm.sglang.load import WorkerStats
from sglang_farm.workers.gpu_health import xid_detail
from sglang_farm.workers.observations import Observations
from sglang_farm.workers.supervisor import GpuFailing, ProgressSeen, Wedged

GPUS = {0: (0,), 1: (1,)}


def fleet(xids: dict[tuple[int, int], int], util: float | None = None) -> FleetSnapshot:
    return FleetSnapshot(
        taken_at=0.0,
        duration_s=0.0,
        nvml_up=True,
        gpus=(GpuSnapshot(0), GpuSnapshot(1, utilization_gpu_ratio=util)),
        xid_events_total=MappingProxyType(xids),
    )


def stats(worker: int, changed_at: float) -> WorkerStats:
    return WorkerStats(worker=worker, taken_at=0.0, up=True, running=3.0, changed_at=changed_at)


def test_an_xid_is_reported_once_then_compared_with_the_last_snapshot() -> None:
    obs = Observations()
    assert obs.of_fleet(fleet({}), GPUS) == []
    assert obs.of_fleet(fleet({(1, 79): 1}), GPUS) == [(1, GpuFailing(1, "xid 79", xid_detail(79)))]
    assert obs.of_fleet(fleet({(1, 79): 1}), GPUS) == []  # the same count: nothing new


def test_progress_is_read_against_each_workers_previous_look() -> None:
    obs = Observations()
    assert obs.of_stats({0: stats(0, 10.0)}, GPUS, stall_window=120.0, now=11.0) == []
    assert obs.of_stats({0: stats(0, 20.0)}, GPUS, stall_window=120.0, now=21.0) == [
        (0, ProgressSeen())
    ]
    assert obs.of_stats({0: stats(0, 20.0)}, GPUS, stall_window=120.0, now=22.0) == []


def test_a_stall_is_judged_with_the_latest_fleets_utilization() -> None:
    obs = Observations()
    obs.of_fleet(fleet({}, util=0.9), GPUS)
    assert obs.of_stats({1: stats(1, 0.0)}, GPUS, stall_window=120.0, now=500.0) == []
    obs.of_fleet(fleet({}, util=0.0), GPUS)
    [(wid, event)] = obs.of_stats({1: stats(1, 0.0)}, GPUS, stall_window=120.0, now=500.0)
    assert wid == 1 and isinstance(event, Wedged) and "GPU 0% busy" in event.detail


def test_figures_of_a_worker_the_farm_no_longer_has_are_dropped() -> None:
    obs = Observations()
    assert obs.of_stats({7: stats(7, 0.0)}, GPUS, stall_window=120.0, now=500.0) == []
