"""NvmlPoller against a fake pynvml-like object (the constructor seam), the pure helpers,
the simulated GPUs, and (marked `gpu`) the real NVML where there is one."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from structlog.testing import capture_logs

from sglang_farm.gpus.nvml import NvmlPoller, read_ppid_map
from sglang_farm.gpus.simulated import H200_MEMORY_TOTAL_BYTES, FakeGpuPoller
from sglang_farm.gpus.snapshot import (
    FleetSnapshot,
    GpuProcess,
    GpuSnapshot,
    attribute_memory,
    process_tree,
    process_trees,
)

GiB = 1024**3


class FakeNVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


@dataclass
class FakeDevice:
    uuid: str
    name: bytes = b"NVIDIA H200"
    total: int = 140 * GiB
    used: int = 6 * GiB
    reserved: int = 645 * 1024 * 1024
    procs: list[tuple[int, int]] = field(default_factory=list)
    unsupported: set[str] = field(default_factory=set)
    lost: bool = False
    events_supported: bool = True


class FakeNvml:
    """The slice of pynvml's names NvmlPoller uses, with failures on demand."""

    NVMLError = FakeNVMLError
    NVML_ERROR_UNINITIALIZED = 1
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_NO_PERMISSION = 4
    NVML_ERROR_DRIVER_NOT_LOADED = 9
    NVML_ERROR_TIMEOUT = 10
    NVML_ERROR_FUNCTION_NOT_FOUND = 13
    NVML_ERROR_GPU_IS_LOST = 15
    NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
    NVML_ERROR_UNKNOWN = 999
    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1
    NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    nvmlMemory_v2 = 0x02000028
    nvmlEventTypeXidCriticalError = 0x8

    def __init__(self, devices: list[FakeDevice], *, init_error: int | None = None) -> None:
        self.devices = devices
        self.init_error = init_error
        self.init_calls = 0
        self.initialised = False
        self.events: list[tuple[int, int]] = []  # (gpu index, xid) waiting in the event set
        self.registered: list[int] = []
        self.count_error: int | None = None
        self.energy_reads = 0

    # lifecycle
    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.init_error is not None:
            raise FakeNVMLError(self.init_error)
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.initialised = False

    def nvmlSystemGetDriverVersion(self) -> str:
        return "580.159.04"

    def nvmlDeviceGetCount(self) -> int:
        if self.count_error is not None:
            raise FakeNVMLError(self.count_error)
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> FakeDevice:
        d = self.devices[i]
        if d.lost:
            raise FakeNVMLError(self.NVML_ERROR_GPU_IS_LOST)
        return d

    # events
    def nvmlEventSetCreate(self) -> str:
        return "event-set"

    def nvmlDeviceRegisterEvents(self, h: FakeDevice, types: int, es: str) -> None:
        if not h.events_supported:
            raise FakeNVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        self.registered.append(self.devices.index(h))

    def nvmlEventSetWait_v2(self, es: str, timeout_ms: int) -> Any:
        assert timeout_ms == 0, "the poller must never block on the event set"
        if not self.events:
            raise FakeNVMLError(self.NVML_ERROR_TIMEOUT)
        index, code = self.events.pop(0)
        return SimpleNamespace(
            device=self.devices[index],
            eventType=self.nvmlEventTypeXidCriticalError,
            eventData=code,
        )

    def nvmlEventSetFree(self, es: str) -> None:
        pass

    def nvmlDeviceGetIndex(self, h: FakeDevice) -> int:
        return self.devices.index(h)

    # per-device readings; `_get` applies the device's failure settings
    def _get(self, h: FakeDevice, name: str, value: Any) -> Any:
        if h.lost:
            raise FakeNVMLError(self.NVML_ERROR_GPU_IS_LOST)
        if name in h.unsupported:
            raise FakeNVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        return value

    def nvmlDeviceGetUUID(self, h: FakeDevice) -> str:
        return str(self._get(h, "uuid", h.uuid))

    def nvmlDeviceGetName(self, h: FakeDevice) -> bytes:
        return bytes(self._get(h, "name", h.name))

    def nvmlDeviceGetPciInfo(self, h: FakeDevice) -> Any:
        return self._get(h, "pci", SimpleNamespace(busId=b"00000000:19:00.0"))

    def nvmlDeviceGetCudaComputeCapability(self, h: FakeDevice) -> tuple[int, int]:
        return tuple(self._get(h, "cc", (9, 0)))

    def nvmlDeviceGetMemoryInfo(self, h: FakeDevice, version: int | None = None) -> Any:
        if version is not None:
            if "memory_v2" in h.unsupported:
                raise FakeNVMLError(self.NVML_ERROR_FUNCTION_NOT_FOUND)
            free = h.total - h.used - h.reserved
            return self._get(
                h,
                "memory",
                SimpleNamespace(total=h.total, used=h.used, free=free, reserved=h.reserved),
            )
        return self._get(
            h, "memory", SimpleNamespace(total=h.total, used=h.used, free=h.total - h.used)
        )

    def nvmlDeviceGetUtilizationRates(self, h: FakeDevice) -> Any:
        return self._get(h, "util", SimpleNamespace(gpu=87, memory=40))

    def nvmlDeviceGetTemperature(self, h: FakeDevice, sensor: int) -> int:
        return int(self._get(h, "temp", 45))

    def nvmlDeviceGetPowerUsage(self, h: FakeDevice) -> int:
        return int(self._get(h, "power", 123_456))  # mW

    def nvmlDeviceGetTotalEnergyConsumption(self, h: FakeDevice) -> int:
        self.energy_reads += 1
        return int(self._get(h, "energy", 9_000_500 + 1000 * self.energy_reads))  # mJ

    def nvmlDeviceGetClockInfo(self, h: FakeDevice, kind: int) -> int:
        return int(self._get(h, "clock", 1980))  # MHz

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: FakeDevice) -> int:
        return int(self._get(h, "reasons", 0x4))

    def nvmlDeviceGetTotalEccErrors(self, h: FakeDevice, kind: int, counter: int) -> int:
        return int(self._get(h, "ecc", 2 if kind == self.NVML_MEMORY_ERROR_TYPE_CORRECTED else 0))

    def nvmlDeviceGetRemappedRows(self, h: FakeDevice) -> tuple[int, int, int, int]:
        return tuple(self._get(h, "rows", (1, 0, 0, 0)))

    def nvmlDeviceGetPersistenceMode(self, h: FakeDevice) -> int:
        return int(self._get(h, "persistence", 1))

    def nvmlDeviceGetComputeRunningProcesses(self, h: FakeDevice) -> list[Any]:
        procs = self._get(h, "procs", h.procs)
        return [SimpleNamespace(pid=p, usedGpuMemory=b) for p, b in procs]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _poller(nvml: FakeNvml, clock: Clock | None = None) -> NvmlPoller:
    c = clock or Clock()
    return NvmlPoller(nvml, retry_init_s=60.0, clock=lambda: 1.7e9 + c.t, monotonic=c)


def test_snapshot_reads_every_field_in_base_units() -> None:
    nvml = FakeNvml([FakeDevice("GPU-a", procs=[(4242, 5 * GiB)])])
    snap = _poller(nvml).snapshot()
    assert snap.nvml_up and snap.error is None and not snap.simulated
    assert snap.driver_version == "580.159.04"
    (g,) = snap.gpus
    assert g == GpuSnapshot(
        index=0,
        uuid="GPU-a",
        name="NVIDIA H200",
        pci_bus_id="00000000:19:00.0",
        compute_capability=(9, 0),
        memory_total_bytes=140 * GiB,
        memory_used_bytes=6 * GiB,
        memory_free_bytes=140 * GiB - 6 * GiB - 645 * 1024 * 1024,
        memory_reserved_bytes=645 * 1024 * 1024,
        utilization_gpu_ratio=0.87,
        utilization_memory_ratio=0.40,
        temperature_c=45.0,
        power_w=123.456,
        energy_j=9001.5,
        sm_clock_hz=1980e6,
        throttle_reasons=0x4,
        ecc_corrected_volatile_total=2,
        ecc_uncorrected_volatile_total=0,
        remapped_rows_correctable=1,
        remapped_rows_uncorrectable=0,
        remapped_rows_pending=False,
        remapped_rows_failure=False,
        persistence_mode=True,
        processes=(GpuProcess(4242, 5 * GiB),),
    )


def test_energy_is_read_at_most_every_interval_because_it_costs_ms_on_h200() -> None:
    nvml = FakeNvml([FakeDevice("GPU-a")])
    clock = Clock()
    poller = _poller(nvml, clock)
    first = poller.snapshot().gpus[0].energy_j
    clock.t += 5
    assert poller.snapshot().gpus[0].energy_j == first  # cached: no second read
    assert nvml.energy_reads == 1
    clock.t += 30
    assert poller.snapshot().gpus[0].energy_j == 9002.5
    assert nvml.energy_reads == 2


def test_not_supported_fields_are_none_and_the_gpu_stays_healthy() -> None:
    dev = FakeDevice("GPU-a", unsupported={"ecc", "rows", "energy", "reasons"})
    g = _poller(FakeNvml([dev])).snapshot().gpus[0]
    assert g.healthy and g.error is None
    assert g.ecc_corrected_volatile_total is None
    assert g.ecc_uncorrected_volatile_total is None
    assert g.remapped_rows_correctable is None and g.remapped_rows_failure is None
    assert g.energy_j is None and g.throttle_reasons is None
    assert g.memory_used_bytes == 6 * GiB  # the supported fields are still read


def test_memory_info_v1_is_used_when_v2_is_missing() -> None:
    dev = FakeDevice("GPU-a", unsupported={"memory_v2"})
    g = _poller(FakeNvml([dev])).snapshot().gpus[0]
    assert (g.memory_total_bytes, g.memory_used_bytes) == (140 * GiB, 6 * GiB)
    assert g.memory_reserved_bytes is None


def test_lost_gpu_is_an_unhealthy_snapshot_and_the_others_are_still_read() -> None:
    devs = [FakeDevice("GPU-a"), FakeDevice("GPU-b")]
    poller = _poller(FakeNvml(devs))
    assert all(g.healthy for g in poller.snapshot().gpus)
    devs[0].lost = True
    with capture_logs() as logs:
        snap = poller.snapshot()
    lost, other = snap.gpus
    assert snap.nvml_up
    assert not lost.healthy
    assert lost.error is not None and "nvmlDeviceGetHandleByIndex" in lost.error
    assert lost.uuid == "GPU-a"  # identity remembered from the healthy read
    assert lost.memory_used_bytes is None
    assert other.healthy and other.memory_used_bytes == 6 * GiB
    assert [e["event"] for e in logs] == ["gpu_unhealthy"]
    assert logs[0]["gpu"] == 0


def test_unknown_error_on_one_field_marks_the_gpu_unhealthy() -> None:
    class Flaky(FakeNvml):
        def nvmlDeviceGetTemperature(self, h: FakeDevice, sensor: int) -> int:
            raise FakeNVMLError(self.NVML_ERROR_UNKNOWN)

    g = _poller(Flaky([FakeDevice("GPU-a")])).snapshot().gpus[0]
    assert not g.healthy
    assert g.error is not None and "nvmlDeviceGetTemperature" in g.error


def test_init_failure_is_nvml_down_with_one_warning_and_a_rare_retry() -> None:
    nvml = FakeNvml([FakeDevice("GPU-a")], init_error=FakeNvml.NVML_ERROR_DRIVER_NOT_LOADED)
    clock = Clock()
    poller = _poller(nvml, clock)
    with capture_logs() as logs:
        first = poller.snapshot()
        clock.t += 30
        second = poller.snapshot()
    assert not first.nvml_up and first.gpus == ()
    assert first.error is not None and "NVML unavailable" in first.error
    assert not second.nvml_up
    assert nvml.init_calls == 1  # no retry within retry_init_s
    assert [e["event"] for e in logs] == ["nvml_unavailable"]
    assert logs[0]["log_level"] == "warning"

    clock.t += 31  # 61 s after the first attempt
    with capture_logs() as logs:
        still_down = poller.snapshot()
    assert nvml.init_calls == 2 and not still_down.nvml_up
    assert logs == []  # the warning is said once

    nvml.init_error = None
    clock.t += 61
    up = poller.snapshot()
    assert up.nvml_up and [g.uuid for g in up.gpus] == ["GPU-a"]


def test_missing_pynvml_library_is_nvml_down_not_an_exception() -> None:
    class NoLib(FakeNvml):
        def nvmlInit(self) -> None:
            raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    snap = _poller(NoLib([])).snapshot()
    assert not snap.nvml_up and snap.error is not None and "libnvidia-ml" in snap.error


def test_nvml_gone_midway_goes_down_then_reinitialises() -> None:
    nvml = FakeNvml([FakeDevice("GPU-a")])
    clock = Clock()
    poller = _poller(nvml, clock)
    assert poller.snapshot().nvml_up
    nvml.count_error = FakeNvml.NVML_ERROR_UNINITIALIZED
    down = poller.snapshot()
    assert not down.nvml_up and down.error is not None
    nvml.count_error = None
    clock.t += 61
    assert poller.snapshot().nvml_up
    assert nvml.init_calls == 2


def test_xid_events_are_counted_by_gpu_and_code_without_blocking() -> None:
    nvml = FakeNvml([FakeDevice("GPU-a"), FakeDevice("GPU-b", events_supported=False)])
    poller = _poller(nvml)
    assert poller.snapshot().xid_events_total == {}
    assert nvml.registered == [0]  # GPU 1 refused registration; polling goes on
    nvml.events = [(0, 79), (0, 79), (1, 48)]
    snap = poller.snapshot()
    assert dict(snap.xid_events_total) == {(0, 79): 2, (1, 48): 1}
    nvml.events = [(0, 79)]
    assert dict(poller.snapshot().xid_events_total) == {(0, 79): 3, (1, 48): 1}


def test_close_shuts_nvml_down_and_is_idempotent() -> None:
    nvml = FakeNvml([FakeDevice("GPU-a")])
    poller = _poller(nvml)
    poller.snapshot()
    poller.close()
    poller.close()
    assert not nvml.initialised


# --- pure helpers ---------------------------------------------------------------


def test_process_tree_collects_all_descendants_only() -> None:
    ppid = {100: 1, 101: 100, 102: 101, 103: 100, 200: 1, 201: 200}
    assert process_tree(100, ppid) == {100, 101, 102, 103}
    assert process_tree(999, ppid) == {999}


def test_process_trees_of_every_worker_from_one_map_are_each_ones_tree() -> None:
    """Issue 32, 4.8: one index of the host's processes for all workers."""
    ppid = {100: 1, 101: 100, 102: 101, 103: 100, 200: 1, 201: 200, 300: 300}
    roots = {0: 100, 1: 200, 2: 999, 3: 300, 4: 101}
    assert process_trees(roots, ppid) == {w: process_tree(p, ppid) for w, p in roots.items()}
    assert process_trees(roots, ppid)[0] == {100, 101, 102, 103}
    assert process_trees({}, ppid) == {}


def test_attribute_memory_sums_the_process_tree_across_gpus() -> None:
    snap = FleetSnapshot(
        taken_at=0,
        duration_s=0,
        nvml_up=True,
        gpus=(
            GpuSnapshot(0, processes=(GpuProcess(101, 70 * GiB), GpuProcess(300, 1 * GiB))),
            GpuSnapshot(1, processes=(GpuProcess(102, 60 * GiB),)),
            GpuSnapshot(2),
        ),
    )
    got = attribute_memory(snap, {0: {100, 101, 102}, 1: {200}})
    assert got == {0: 130 * GiB, 1: 0}


def test_read_ppid_map_parses_names_with_spaces_and_parens(tmp_path: Path) -> None:
    for pid, stat in {
        "1": "1 (systemd) S 0 1 1",
        "42": "42 (sglang::scheduler (TP0)) S 41 42 42",
        "43": "43 (a b) R 42 43",
    }.items():
        (tmp_path / pid).mkdir()
        # As the kernel writes it: 52 fields, the start time the 22nd (procfs reads them).
        fields = stat.split(") ", 1)[1].split()
        (tmp_path / pid / "stat").write_text(stat + " 0" * (50 - len(fields)))
    (tmp_path / "self").mkdir()
    (tmp_path / "44").mkdir()  # exited between listdir and open: no stat file
    assert read_ppid_map(str(tmp_path)) == {1: 0, 42: 41, 43: 42}


def test_read_ppid_map_sees_this_process_under_its_parent() -> None:
    ppids = read_ppid_map()
    assert ppids[os.getpid()] == os.getppid()


# --- simulated GPUs -----------------------------------------------------------


def test_fake_gpu_memory_follows_assigned_pids_and_is_labelled_simulated() -> None:
    clock = Clock()
    fake = FakeGpuPoller(2, process_bytes=40 * GiB, clock=clock)
    idle = fake.snapshot()
    assert idle.simulated and idle.nvml_up
    assert all("simulated" in (g.name or "") for g in idle.gpus)
    assert [g.memory_used_bytes for g in idle.gpus] == [0, 0]
    fake.assign(1, [500, 501])
    fake.set_process_memory(1, 501, 2 * GiB)
    clock.t += 10
    snap = fake.snapshot()
    g1 = snap.gpus[1]
    assert g1.memory_used_bytes == 42 * GiB
    assert g1.memory_total_bytes == H200_MEMORY_TOTAL_BYTES
    assert g1.processes == (GpuProcess(500, 40 * GiB), GpuProcess(501, 2 * GiB))
    assert g1.utilization_gpu_ratio and g1.utilization_gpu_ratio > 0
    assert snap.gpus[0].utilization_gpu_ratio == 0
    assert g1.energy_j is not None and snap.gpus[0].energy_j is not None
    assert g1.energy_j > snap.gpus[0].energy_j > 0  # busy draws more over the same 10 s
    assert attribute_memory(snap, {1: {500, 501}}) == {1: 42 * GiB}
    fake.assign(1, [])
    assert fake.snapshot().gpus[1].memory_used_bytes == 0


def test_fake_gpu_loss_and_xid_injection() -> None:
    fake = FakeGpuPoller(2)
    fake.lose(0)
    fake.inject_xid(1, 79)
    snap = fake.snapshot()
    assert not snap.gpus[0].healthy and snap.gpus[0].error
    assert snap.gpus[0].uuid is not None
    assert dict(snap.xid_events_total) == {(1, 79): 1}
    fake.recover(0)
    assert fake.snapshot().gpus[0].healthy
    with pytest.raises(ValueError, match="GPUs are 0-1"):
        fake.assign(5, [1])


# --- real NVML ------------------------------------------------------------------


@pytest.mark.gpu
def test_real_nvml_snapshot_on_this_machine() -> None:
    poller = NvmlPoller()
    try:
        snap = poller.snapshot()
        if not snap.nvml_up:
            pytest.skip(f"no NVML on this machine: {snap.error}")
        assert snap.gpus, "NVML is up but lists no GPU"
        for g in snap.gpus:
            assert g.healthy, g.error
            assert g.uuid and g.uuid.startswith("GPU-")
            assert g.memory_total_bytes and g.memory_total_bytes > 0
            assert g.memory_used_bytes is not None
            assert g.compute_capability is not None
    finally:
        poller.close()
