"""workers.gpu_health's report of a new NVML snapshot to the workers (issue 24 §1): which worker
hears of which fault, and a GPU's busiest utilization. Whether a report sets a worker
aside is the supervisor's (tests/test_supervisor.py)."""

from __future__ import annotations

from types import MappingProxyType

from sglang_farm.gpus.snapshot import FleetSnapshot, GpuSnapshot
from sglang_farm.workers.gpu_health import (
    busiest_utilization,
    fleet_events,
    not_quarantined,
    quarantined_on,
    xid_detail,
)
from sglang_farm.workers.phase import Phase
from sglang_farm.workers.supervisor import GpuFailing, GpuQuarantine, RemapsPending, WorkerState

FOUR_GPUS = tuple(GpuSnapshot(i) for i in range(4))


def snap(
    xids: dict[tuple[int, int], int] | None = None,
    *,
    gpus: tuple[GpuSnapshot, ...] = FOUR_GPUS,
    nvml_up: bool = True,
    simulated: bool = False,
) -> FleetSnapshot:
    return FleetSnapshot(
        taken_at=0.0,
        duration_s=0.0,
        nvml_up=nvml_up,
        gpus=gpus,
        xid_events_total=MappingProxyType(dict(xids or {})),
        simulated=simulated,
    )


WORKERS = {0: (0,), 1: (1,), 2: (2, 3)}


def test_a_new_reset_class_xid_is_reported_to_the_workers_on_that_gpu_only() -> None:
    events = fleet_events(snap(), snap({(3, 79): 1}), WORKERS)
    assert events == [(2, GpuFailing(3, "xid 79", xid_detail(79)))]
    assert "NVIDIA's action" in xid_detail(79)


def test_an_application_class_xid_is_reported_to_no_one() -> None:
    assert fleet_events(snap(), snap({(1, 13): 4}), WORKERS) == []


def test_pending_remaps_are_reported_whatever_the_worker_does() -> None:
    """The rule (only at a (re)start) is the supervisor's: the report goes out every time."""
    remaps = tuple(GpuSnapshot(i, remapped_rows_pending=i == 1) for i in range(4))
    assert fleet_events(None, snap(gpus=remaps), WORKERS) == [(1, RemapsPending(1))]


def test_a_fault_wins_over_pending_remaps_on_the_same_worker() -> None:
    gpus = (
        GpuSnapshot(0),
        GpuSnapshot(1),
        GpuSnapshot(2, remapped_rows_pending=True),
        GpuSnapshot(3, healthy=False, error="GPU is lost"),
    )
    events = fleet_events(None, snap(gpus=gpus), WORKERS)
    assert events == [(2, GpuFailing(3, "gpu lost", "GPU is lost"))]


def test_nvml_down_reports_nothing() -> None:
    assert fleet_events(None, snap({(0, 79): 1}, nvml_up=False), WORKERS) == []


def test_the_busiest_gpu_of_a_worker_counts_and_unknown_is_none() -> None:
    gpus = (
        GpuSnapshot(0, utilization_gpu_ratio=0.02),
        GpuSnapshot(1, utilization_gpu_ratio=0.7),
        GpuSnapshot(2),
    )
    fleet = snap(gpus=gpus)
    assert busiest_utilization(fleet, (0, 1)) == 0.7
    assert busiest_utilization(fleet, (0,)) == 0.02
    assert busiest_utilization(fleet, (2, 9)) is None  # no figure, and not visible
    assert busiest_utilization(None, (1,)) is None
    assert busiest_utilization(snap(gpus=gpus, nvml_up=False), (1,)) is None
    assert busiest_utilization(snap(gpus=gpus, simulated=True), (1,)) is None


def quarantined(gpu: int) -> WorkerState:
    return WorkerState(0, phase=Phase.QUARANTINED, quarantine=GpuQuarantine(gpu, "xid 79", "x"))


def test_release_gpu_names_the_workers_quarantined_on_it() -> None:
    workers = {0: quarantined(5), 1: WorkerState(1, phase=Phase.READY), 2: quarantined(5)}
    gpus = {0: (5,), 1: (5,), 2: (6,)}  # worker 2 was moved by a reload: its record names 5
    assert quarantined_on(5, workers, gpus) == ([0, 2], [])


def test_release_gpu_with_none_on_it_says_so_and_how_to_release_a_moved_worker() -> None:
    workers = {0: quarantined(5), 1: WorkerState(1, phase=Phase.READY)}
    gpus = {0: (6,), 1: (6,)}  # a reload moved worker 0 from GPU 5 to 6
    assert quarantined_on(6, workers, gpus) == (
        [],
        [
            "no worker is quarantined on GPU 6",
            "worker 0 uses GPU 6 and is quarantined for another GPU: release it with "
            "farmctl release-gpu --worker 0",
        ],
    )
    assert quarantined_on(7, workers, gpus) == ([], ["no worker is quarantined on GPU 7"])


def test_release_of_a_worker_that_is_not_quarantined_says_what_it_is() -> None:
    assert not_quarantined(4, quarantined(5)) == []
    assert not_quarantined(4, WorkerState(4, phase=Phase.READY)) == [
        "worker 4 is not quarantined (it is ready): nothing to release"
    ]


def test_every_worker_on_a_failing_gpu_hears_of_it_not_only_the_first() -> None:
    remaps = (*FOUR_GPUS[:1], GpuSnapshot(1, remapped_rows_pending=True), *FOUR_GPUS[2:])
    events = fleet_events(None, snap({(0, 79): 1, (3, 48): 1}, gpus=remaps), WORKERS)
    assert events == [
        (0, GpuFailing(0, "xid 79", xid_detail(79))),
        (1, RemapsPending(1)),
        (2, GpuFailing(3, "xid 48", xid_detail(48))),
    ]
