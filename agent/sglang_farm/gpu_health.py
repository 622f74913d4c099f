"""Pure: which GPUs the farm must set aside, from two NVML fleet snapshots.

A GPU is quarantined when a new XID of a class that needs a GPU reset or a reboot
arrived (NVIDIA's XID catalog, `xid.py`), when NVML reports it lost or unhealthy, or
(at a worker's restart) when it has row remaps pending. Application-class XIDs (13,
31, 43, 45…) are the worker's own fault and keep the normal restart policy. NVML down
as a whole is the agent's trouble, not any GPU's: nothing is quarantined then.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sglang_farm.gpu_snapshot import FleetSnapshot


@dataclass(frozen=True, slots=True)
class GpuFault:
    gpu: int
    reason: str  # "xid 79", "gpu lost", "pending row remaps"
    detail: str  # the catalog's meaning and action, or NVML's error


def gpu_faults(
    previous: FleetSnapshot | None,
    current: FleetSnapshot,
    *,
    quarantines: Callable[[int], bool],
    describe: Callable[[int], str],
) -> list[GpuFault]:
    """Faults that appeared since `previous` (every XID counted so far when it is None)."""
    if not current.nvml_up:
        return []
    faults: list[GpuFault] = []
    before = previous.xid_events_total if previous is not None else {}
    for (gpu, code), count in sorted(current.xid_events_total.items()):
        if count > before.get((gpu, code), 0) and quarantines(code):
            faults.append(GpuFault(gpu, f"xid {code}", describe(code)))
    for g in current.gpus:
        if not g.healthy:
            lost = g.error is not None and "lost" in g.error.lower()
            faults.append(GpuFault(g.index, "gpu lost" if lost else "gpu unhealthy", g.error or ""))
    return faults


def pending_remaps(current: FleetSnapshot) -> set[int]:
    """GPUs with row remaps pending: they need a GPU reset before they can be trusted."""
    if not current.nvml_up:
        return set()
    return {g.index for g in current.gpus if g.remapped_rows_pending}


def release_problems(current: FleetSnapshot, gpu: int, *, slack_bytes: int) -> list[str]:
    """What keeps `gpu` from being released now: each a complete line; empty when clear."""
    if not current.nvml_up:
        why = current.error or "unknown error"
        return [f"NVML does not answer ({why}): cannot check GPU {gpu}"]
    g = current.gpu(gpu)
    if g is None:
        return [f"GPU {gpu} is not visible to NVML (reset it, or reboot)"]
    problems = []
    if not g.healthy:
        problems.append(f"GPU {gpu} is still unhealthy: {g.error or 'NVML reports an error'}")
    if g.remapped_rows_pending:
        problems.append(f"GPU {gpu} has row remaps pending: reset it (nvidia-smi -r -i {gpu})")
    if g.processes:
        pids = ", ".join(str(p.pid) for p in g.processes)
        problems.append(f"GPU {gpu} still has compute processes ({pids}): stop them first")
    used, reserved = g.memory_used_bytes, g.memory_reserved_bytes or 0
    if used is not None and used - reserved > slack_bytes:
        gib = (used - reserved) / 2**30
        problems.append(f"GPU {gpu} still has {gib:.1f} GiB in use: free it first")
    return problems
