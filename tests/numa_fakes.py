"""A two-socket, 8-GPU host for the NUMA tests (issue 34 §5): GPUs 0-3 on node 0, 4-7 on
node 1, in a faked sysfs; the spec, the fleet and the doctor's report over them."""

from __future__ import annotations

from pathlib import Path

from sglang_farm.config import load_spec
from sglang_farm.doctor.checks import DoctorReport, Observations
from sglang_farm.doctor.rules import evaluate
from sglang_farm.gpus.snapshot import FleetSnapshot, GpuSnapshot
from sglang_farm.host.numa_facts import (
    NumaFacts,
    UnitFilter,
    parse_systemctl_filter,
    sysfs_pci_name,
)
from sglang_farm.host.numa_probe import read_numa_facts
from sglang_farm.spec import FarmSpec

BUS = {g: f"00000000:{0x18 + g * 0x10:02X}:00.0" for g in range(8)}


def spec(env: str = "", numa_node: str = "") -> FarmSpec:
    text = "[workers]\ngpus = [0, 1, 2, 3, 4, 5, 6, 7]\n"
    if env:
        text += f"[farm.env]\n{env}\n"
    text += f"[sglang]\nmodel_path = '/m'\n{numa_node}\n"
    return load_spec(text, source="farm.toml", gpu_count=8)


def fleet(simulated: bool = False) -> FleetSnapshot:
    gpus = tuple(GpuSnapshot(index=g, pci_bus_id=BUS[g]) for g in range(8))
    return FleetSnapshot(taken_at=0.0, duration_s=0.0, nvml_up=True, gpus=gpus, simulated=simulated)


def fake_sysfs(root: Path, *, online: str = "0-1", nodes: dict[int, str] | None = None) -> Path:
    (root / "devices/system/node").mkdir(parents=True)
    (root / "devices/system/node/online").write_text(online + "\n")
    for g in range(8):
        dev = root / "bus/pci/devices" / sysfs_pci_name(BUS[g])
        dev.mkdir(parents=True)
        node = (nodes or {}).get(g, "0" if g < 4 else "1")
        (dev / "numa_node").write_text(node + "\n")
    return root


def facts(
    root: Path,
    *,
    filt: str | None = None,
    libnuma: bool = True,
    numactl: bool = True,
    **sysfs: object,
) -> NumaFacts:
    units = [(w, f"sglang@{w}.service") for w in range(8)] if filt is not None else []
    return read_numa_facts(
        BUS,
        units,
        sysfs=fake_sysfs(root, **sysfs),  # type: ignore[arg-type]
        unit_filter=lambda _unit: UnitFilter(filter=parse_systemctl_filter(filt or "")),
        libnuma=lambda: libnuma,
        which=lambda name: f"/usr/bin/{name}" if numactl else None,
    )


def report(spec: FarmSpec, numa: NumaFacts, simulated: bool = False) -> DoctorReport:
    """The doctor's report of `spec` on this host's `numa` facts (nothing else observed)."""
    obs = Observations(fleet=fleet(simulated), env={}, flags={}, ports={}, models={}, numa=numa)
    return evaluate(spec, obs)
