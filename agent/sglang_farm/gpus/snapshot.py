"""Pure: what one read of the GPUs gives, and a worker's GPU memory from it.

The value types the NVML poller (`gpus.nvml`, I/O) returns and the pure cores take
(`workers.gpu_health`, `doctor`, `metrics`): an immutable `FleetSnapshot` of `GpuSnapshot`s,
the `GpuPoller` seam (`gpus.nvml.NvmlPoller`, `gpus.simulated.FakeGpuPoller`), and the sums over a
snapshot: `attribute_memory` (a worker's GPU memory = the NVML per-process memory of its
process tree) and `process_tree`. Nothing here imports pynvml or reads /proc.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple, Protocol


class GpuProcess(NamedTuple):
    """One compute process on a GPU, as NVML lists it (host pid namespace)."""

    pid: int
    used_bytes: int


@dataclass(frozen=True, slots=True)
class GpuSnapshot:
    """One GPU at one instant. Any field is None when the GPU does not support it."""

    index: int
    uuid: str | None = None
    name: str | None = None
    pci_bus_id: str | None = None
    compute_capability: tuple[int, int] | None = None
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    memory_free_bytes: int | None = None
    memory_reserved_bytes: int | None = None  # driver/firmware reserve (memory info v2)
    utilization_gpu_ratio: float | None = None  # 0..1, time a kernel ran in the last sample period
    utilization_memory_ratio: float | None = None  # 0..1, time memory was read or written
    temperature_c: float | None = None
    power_w: float | None = None
    energy_j: float | None = None  # since the driver loaded
    sm_clock_hz: float | None = None
    throttle_reasons: int | None = None  # NVML clocks-event-reasons bitmask
    ecc_corrected_volatile_total: int | None = None
    ecc_uncorrected_volatile_total: int | None = None
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failure: bool | None = None
    # Persistence mode: off, every NVML open re-initialises the driver (tens of ms) and its
    # state is torn down between processes.
    persistence_mode: bool | None = None
    processes: tuple[GpuProcess, ...] = ()
    healthy: bool = True
    error: str | None = None


def _empty_xids() -> Mapping[tuple[int, int], int]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    """Every GPU of the host at one instant, plus the XID totals since the agent started."""

    taken_at: float  # wall clock (time.time) when the read began
    duration_s: float  # how long the read took
    nvml_up: bool
    gpus: tuple[GpuSnapshot, ...] = ()
    # (gpu index, XID code) -> events counted since the poller started
    xid_events_total: Mapping[tuple[int, int], int] = field(default_factory=_empty_xids)
    error: str | None = None
    simulated: bool = False
    driver_version: str | None = None

    def gpu(self, index: int) -> GpuSnapshot | None:
        """The snapshot of GPU `index`, or None when it was not read."""
        for g in self.gpus:
            if g.index == index:
                return g
        return None


class GpuPoller(Protocol):
    """What the agent needs from a GPU source: a blocking snapshot, and a close."""

    def snapshot(self) -> FleetSnapshot: ...

    def close(self) -> None: ...


# --- pure helpers -------------------------------------------------------------


def process_tree(root_pid: int, ppid_map: Mapping[int, int]) -> frozenset[int]:
    """`root_pid` and all its descendants, from a pid -> parent-pid map.

    SGLang's scheduler (a spawned child) holds the GPU memory, not the main
    process, so a worker's memory is the memory of its whole tree.
    """
    return _descendants(root_pid, _children(ppid_map))


def process_trees(
    roots: Mapping[int, int], ppid_map: Mapping[int, int]
) -> dict[int, frozenset[int]]:
    """Each key's `process_tree` of its root pid, from one index of the map: one pass
    over every process of the host for all workers, not one per worker (issue 32, 4.8)."""
    children = _children(ppid_map)
    return {key: _descendants(pid, children) for key, pid in roots.items()}


def _children(ppid_map: Mapping[int, int]) -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for pid, ppid in ppid_map.items():
        children.setdefault(ppid, []).append(pid)
    return children


def _descendants(root_pid: int, children: Mapping[int, list[int]]) -> frozenset[int]:
    seen = {root_pid}
    todo = [root_pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return frozenset(seen)


def attribute_memory(
    snapshot: FleetSnapshot, pids_by_worker: Mapping[int, Iterable[int]]
) -> dict[int, int]:
    """Worker id -> bytes of GPU memory held by the worker's processes, on all GPUs.

    A worker with no process on any GPU maps to 0. NVML reports host pids: an
    agent in its own pid namespace must pass host pids.
    """
    by_pid: dict[int, int] = {}
    for gpu in snapshot.gpus:
        for proc in gpu.processes:
            by_pid[proc.pid] = by_pid.get(proc.pid, 0) + proc.used_bytes
    return {
        worker: sum(by_pid.get(pid, 0) for pid in set(pids))
        for worker, pids in pids_by_worker.items()
    }
