"""Pure: which GPUs the farm must set aside, from two NVML fleet snapshots.

A GPU is quarantined when a new XID of a class that needs a GPU reset or a reboot
arrived (NVIDIA's XID catalog, `xid.py`), when NVML reports it lost or unhealthy, or
(at a worker's restart) when it has row remaps pending. Application-class XIDs (13,
31, 43, 45…) are the worker's own fault and keep the normal restart policy. NVML down
as a whole is the agent's trouble, not any GPU's: nothing is quarantined then.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from sglang_farm.gpus import xid
from sglang_farm.gpus.snapshot import FleetSnapshot
from sglang_farm.workers.events import GpuFailing, RemapsPending
from sglang_farm.workers.phase import Phase
from sglang_farm.workers.records import WorkerState


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


def xid_detail(code: int) -> str:
    """What a quarantine's reason says about XID `code`: NVIDIA's meaning and action."""
    info = xid.classify(code)
    return f"{info.meaning}; NVIDIA's action: {info.action_text}"


def fleet_events(
    previous: FleetSnapshot | None,
    current: FleetSnapshot,
    worker_gpus: Mapping[int, Collection[int]],
    *,
    quarantines: Callable[[int], bool] = xid.quarantines,
    describe: Callable[[int], str] = xid_detail,
) -> list[tuple[int, GpuFailing | RemapsPending]]:
    """What a new NVML snapshot reports to each worker (id -> its GPUs): the first fault on
    one of its GPUs, else the first of its GPUs with row remaps pending. Only the workers
    on a failing GPU hear of it; whether it matters now is the supervisor's to decide."""
    faults = gpu_faults(previous, current, quarantines=quarantines, describe=describe)
    remaps = pending_remaps(current)
    events: list[tuple[int, GpuFailing | RemapsPending]] = []
    for wid, gpus in worker_gpus.items():
        fault = next((f for f in faults if f.gpu in gpus), None)
        if fault is not None:
            events.append((wid, GpuFailing(fault.gpu, fault.reason, fault.detail)))
            continue
        remapped = next((g for g in gpus if g in remaps), None)
        if remapped is not None:
            events.append((wid, RemapsPending(remapped)))
    return events


def busiest_utilization(fleet: FleetSnapshot | None, gpus: Collection[int]) -> float | None:
    """The busiest of `gpus` per the snapshot (None: unknown: no NVML, or simulated)."""
    if fleet is None or not fleet.nvml_up or fleet.simulated:
        return None
    utils = [
        g.utilization_gpu_ratio
        for i in gpus
        if (g := fleet.gpu(i)) is not None and g.utilization_gpu_ratio is not None
    ]
    return max(utils) if utils else None


def quarantined_on(
    gpu: int, workers: Mapping[int, WorkerState], worker_gpus: Mapping[int, Collection[int]]
) -> tuple[list[int], list[str]]:
    """Which workers `release-gpu G` starts again: those whose quarantine names `gpu`.
    With none, why nothing is released: a worker a reload moved onto `gpu` keeps a
    quarantine naming its old GPU, and the line says how to release that one."""
    held = [
        w
        for w, s in workers.items()
        if s.phase is Phase.QUARANTINED and s.quarantine is not None and s.quarantine.gpu == gpu
    ]
    if held:
        return held, []
    moved = [
        w
        for w, s in workers.items()
        if s.phase is Phase.QUARANTINED and gpu in worker_gpus.get(w, ())
    ]
    return [], [f"no worker is quarantined on GPU {gpu}"] + [
        f"worker {w} uses GPU {gpu} and is quarantined for another GPU: release it "
        f"with farmctl release-gpu --worker {w}"
        for w in moved
    ]


def not_quarantined(worker: int, s: WorkerState) -> list[str]:
    """Why `release-gpu --worker W` releases nothing: W is not quarantined (empty: it is)."""
    if s.phase is Phase.QUARANTINED:
        return []
    return [f"worker {worker} is not quarantined (it is {s.phase}): nothing to release"]


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
