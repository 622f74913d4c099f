"""workers.gpu_health's rules, called directly (issue 27: nothing did, so a broken comparison
went unnoticed): which GPUs a pair of snapshots sets aside, and what blocks a release."""

from __future__ import annotations

from types import MappingProxyType

from sglang_farm.gpus.snapshot import FleetSnapshot, GpuProcess, GpuSnapshot
from sglang_farm.gpus.xid import quarantines
from sglang_farm.workers.gpu_health import GpuFault, gpu_faults, pending_remaps, release_problems

GiB = 2**30


def snap(
    xids: dict[tuple[int, int], int] | None = None,
    *,
    gpus: tuple[GpuSnapshot, ...] = (GpuSnapshot(0), GpuSnapshot(1)),
    nvml_up: bool = True,
    error: str | None = None,
) -> FleetSnapshot:
    return FleetSnapshot(
        taken_at=0.0,
        duration_s=0.0,
        nvml_up=nvml_up,
        gpus=gpus,
        xid_events_total=MappingProxyType(dict(xids or {})),
        error=error,
    )


def describe(code: int) -> str:
    return f"meaning of {code}"


def faults(previous: FleetSnapshot | None, current: FleetSnapshot) -> list[GpuFault]:
    return gpu_faults(previous, current, quarantines=quarantines, describe=describe)


# ---- finding 3: an XID count that has not grown is no new fault -------------------------


def test_after_a_release_an_unchanged_xid_count_does_not_quarantine_again() -> None:
    """The poll after `release-gpu` sees the same cumulative count: nothing new."""
    before = snap({(1, 79): 1})
    assert faults(before, snap({(1, 79): 1})) == []


def test_a_grown_xid_count_is_a_new_fault() -> None:
    assert faults(snap({(1, 79): 1}), snap({(1, 79): 2})) == [GpuFault(1, "xid 79", describe(79))]


def test_the_first_snapshot_counts_every_xid_so_far() -> None:
    assert faults(None, snap({(0, 48): 1, (1, 79): 3})) == [
        GpuFault(0, "xid 48", describe(48)),
        GpuFault(1, "xid 79", describe(79)),
    ]


def test_application_class_xids_set_nothing_aside() -> None:
    assert faults(None, snap({(0, 13): 5, (1, 43): 1})) == []


def test_a_lost_or_unhealthy_gpu_is_a_fault_every_time() -> None:
    gpus = (
        GpuSnapshot(0, healthy=False, error="nvmlDeviceGetMemoryInfo: GPU is LOST"),
        GpuSnapshot(1, healthy=False, error="Unknown Error"),
        GpuSnapshot(2, healthy=False),
        GpuSnapshot(3),
    )
    current = snap(gpus=gpus)
    expected = [
        GpuFault(0, "gpu lost", "nvmlDeviceGetMemoryInfo: GPU is LOST"),
        GpuFault(1, "gpu unhealthy", "Unknown Error"),
        GpuFault(2, "gpu unhealthy", ""),
    ]
    assert faults(None, current) == expected
    assert faults(current, current) == expected


def test_nvml_down_quarantines_nothing() -> None:
    down = snap({(0, 79): 1}, gpus=(GpuSnapshot(0, healthy=False, error="lost"),), nvml_up=False)
    assert faults(None, down) == []
    assert (
        pending_remaps(snap(gpus=(GpuSnapshot(0, remapped_rows_pending=True),), nvml_up=False))
        == set()
    )


def test_pending_remaps_names_only_those_gpus() -> None:
    gpus = (
        GpuSnapshot(0, remapped_rows_pending=True),
        GpuSnapshot(1, remapped_rows_pending=False),
        GpuSnapshot(2),
    )
    assert pending_remaps(snap(gpus=gpus)) == {0}


# ---- release_problems ------------------------------------------------------------------


def test_a_clear_gpu_has_no_release_problem() -> None:
    g = GpuSnapshot(1, memory_used_bytes=GiB, memory_reserved_bytes=GiB // 2)
    assert release_problems(snap(gpus=(g,)), 1, slack_bytes=GiB // 2) == []
    # No memory figures at all: nothing to hold it back.
    assert release_problems(snap(gpus=(GpuSnapshot(1),)), 1, slack_bytes=0) == []


def test_memory_in_use_beyond_the_slack_blocks_a_release() -> None:
    g = GpuSnapshot(1, memory_used_bytes=3 * GiB, memory_reserved_bytes=GiB)
    assert release_problems(snap(gpus=(g,)), 1, slack_bytes=2 * GiB) == []
    assert release_problems(snap(gpus=(g,)), 1, slack_bytes=2 * GiB - 1) == [
        "GPU 1 still has 2.0 GiB in use: free it first"
    ]
    unreserved = GpuSnapshot(1, memory_used_bytes=3 * GiB)  # reserve unknown: counts as 0
    assert release_problems(snap(gpus=(unreserved,)), 1, slack_bytes=2 * GiB) == [
        "GPU 1 still has 3.0 GiB in use: free it first"
    ]
    # ...not as one byte reserved: 3 GiB in use against a slack one byte short of it.
    assert release_problems(snap(gpus=(unreserved,)), 1, slack_bytes=3 * GiB - 1) != []


def test_every_release_problem_is_named_at_once() -> None:
    g = GpuSnapshot(
        2,
        healthy=False,
        error="Unknown Error",
        remapped_rows_pending=True,
        processes=(GpuProcess(101, GiB), GpuProcess(202, GiB)),
    )
    assert release_problems(snap(gpus=(g,)), 2, slack_bytes=0) == [
        "GPU 2 is still unhealthy: Unknown Error",
        "GPU 2 has row remaps pending: reset it (nvidia-smi -r -i 2)",
        "GPU 2 still has compute processes (101, 202): stop them first",
    ]
    plain = GpuSnapshot(2, healthy=False)
    assert release_problems(snap(gpus=(plain,)), 2, slack_bytes=0) == [
        "GPU 2 is still unhealthy: NVML reports an error"
    ]


def test_an_unseen_gpu_or_nvml_down_blocks_a_release() -> None:
    assert release_problems(snap(), 5, slack_bytes=0) == [
        "GPU 5 is not visible to NVML (reset it, or reboot)"
    ]
    assert release_problems(snap(nvml_up=False, error="driver gone"), 0, slack_bytes=0) == [
        "NVML does not answer (driver gone): cannot check GPU 0"
    ]
    assert release_problems(snap(nvml_up=False), 0, slack_bytes=0) == [
        "NVML does not answer (unknown error): cannot check GPU 0"
    ]
