"""I/O: reads the NUMA facts the doctor judges (`host/numa_facts.py`) off this host: the
online nodes and each GPU's node from sysfs, whether libnuma and `numactl` are installed,
and each worker unit's effective system-call filter from systemd.

`sysfs` is a parameter so tests give a fake tree of a two-socket host; `unit_filter` is a
seam for the same reason (the real one runs `systemctl show`).
"""

from __future__ import annotations

import ctypes.util
import shutil
import subprocess
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import MappingProxyType

from sglang_farm.host.numa_facts import (
    NumaFacts,
    UnitFilter,
    parse_cpulist,
    parse_numa_node,
    parse_systemctl_filter,
    sysfs_pci_name,
)

SYSTEMCTL_TIMEOUT_S = 10.0


def systemctl_filter(unit: str) -> UnitFilter:
    """`unit`'s effective SystemCallFilter= as the running systemd resolved it (template,
    the farm's drop-ins and any other drop-in together)."""
    try:
        done = subprocess.run(
            ["systemctl", "show", "-p", "SystemCallFilter", "--value", unit],
            capture_output=True,
            text=True,
            timeout=SYSTEMCTL_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return UnitFilter(error=f"systemctl show {unit}: {exc}")
    if done.returncode != 0:
        why = done.stderr.strip() or f"exit {done.returncode}"
        return UnitFilter(error=f"systemctl show {unit}: {why}")
    return UnitFilter(filter=parse_systemctl_filter(done.stdout))


def _libnuma_installed() -> bool:
    return ctypes.util.find_library("numa") is not None


def read_numa_facts(
    gpu_bus_ids: Mapping[int, str | None],
    worker_units: Iterable[tuple[int, str]] = (),
    *,
    sysfs: Path = Path("/sys"),
    unit_filter: Callable[[str], UnitFilter] = systemctl_filter,
    libnuma: Callable[[], bool] = _libnuma_installed,
    which: Callable[[str], str | None] = shutil.which,
) -> NumaFacts:
    """The facts, never raising for what it finds. `gpu_bus_ids`: GPU index -> NVML's PCI
    bus id (None when NVML has none); `worker_units`: (worker id, unit name) of the workers
    that run as systemd units (none under the process runtime)."""
    nodes: tuple[int, ...] = ()
    nodes_error: str | None = None
    online = sysfs / "devices/system/node/online"
    try:
        nodes = parse_cpulist(online.read_text())
    except (OSError, ValueError) as exc:
        nodes_error = f"{online}: {exc}"
    gpu_nodes: dict[int, int | None] = {}
    sources: dict[int, str] = {}
    for gpu, bus_id in sorted(gpu_bus_ids.items()):
        gpu_nodes[gpu] = None
        if not bus_id:
            continue
        try:
            path = sysfs / "bus/pci/devices" / sysfs_pci_name(bus_id) / "numa_node"
        except ValueError:
            continue
        sources[gpu] = str(path)
        try:
            gpu_nodes[gpu] = parse_numa_node(path.read_text())
        except (OSError, ValueError):
            gpu_nodes[gpu] = None
    filters = {worker: unit_filter(unit) for worker, unit in worker_units}
    return NumaFacts(
        nodes=nodes,
        nodes_error=nodes_error,
        gpu_nodes=MappingProxyType(gpu_nodes),
        gpu_sources=MappingProxyType(sources),
        libnuma=libnuma(),
        numactl=which("numactl") is not None,
        unit_filters=MappingProxyType(filters),
    )
