#!/usr/bin/env python3
"""What NVML reports for the GPU-health rules, on a real GPU (CI never has one).

    python3 scripts/gpu_health_check.py > docs/gpu-runs/<date>-<gpu>-gpu-health.json

Records, per GPU: whether XID critical-error events can be registered (the quarantine's
trigger; they cannot be provoked here), the health fields `workers.gpu_health` reads (remapped
rows pending, the healthy flag), persistence mode, utilization, and what `release-gpu`'s
check (`workers.gpu_health.release_problems`) says about the idle GPU.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "agent"))

import pynvml as nvml

from sglang_farm.gpus.nvml import NvmlPoller
from sglang_farm.workers.gpu_health import gpu_faults, release_problems


def field(fn: object, *args: object) -> object:
    try:
        value = fn(*args)  # type: ignore[operator]  # pynvml is untyped
    except nvml.NVMLError as exc:
        return f"error: {exc}"
    return value if isinstance(value, int | float | str | bool) else repr(value)


def main() -> None:
    out: dict[str, object] = {"taken_at": time.time()}
    nvml.nvmlInit()
    out["driver"] = field(nvml.nvmlSystemGetDriverVersion)
    gpus = []
    for i in range(nvml.nvmlDeviceGetCount()):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        row: dict[str, object] = {"index": i, "name": field(nvml.nvmlDeviceGetName, h)}
        row["persistence_mode"] = field(nvml.nvmlDeviceGetPersistenceMode, h)
        row["remapped_rows"] = field(nvml.nvmlDeviceGetRemappedRows, h)
        supported = field(nvml.nvmlDeviceGetSupportedEventTypes, h)
        row["supported_event_types"] = supported
        if isinstance(supported, int):
            row["xid_events_supported"] = bool(supported & nvml.nvmlEventTypeXidCriticalError)
        event_set = nvml.nvmlEventSetCreate()
        try:
            nvml.nvmlDeviceRegisterEvents(h, nvml.nvmlEventTypeXidCriticalError, event_set)
            row["xid_register"] = "ok"
        except nvml.NVMLError as exc:
            row["xid_register"] = f"error: {exc}"
        finally:
            nvml.nvmlEventSetFree(event_set)
        gpus.append(row)
    nvml.nvmlShutdown()
    out["gpus"] = gpus
    poller = NvmlPoller()
    first = poller.snapshot()
    time.sleep(1.0)
    second = poller.snapshot()
    out["poller"] = {
        "nvml_up": second.nvml_up,
        "xid_events_total": {f"{g}:{c}": n for (g, c), n in second.xid_events_total.items()},
        "healthy": {g.index: g.healthy for g in second.gpus},
        "remapped_rows_pending": {g.index: g.remapped_rows_pending for g in second.gpus},
        "utilization_gpu_ratio": {g.index: g.utilization_gpu_ratio for g in second.gpus},
        "faults_between_two_snapshots": [
            f.__repr__()
            for f in gpu_faults(first, second, quarantines=lambda c: True, describe=str)
        ],
        "release_problems_idle": {
            g.index: release_problems(second, g.index, slack_bytes=1 << 30) for g in second.gpus
        },
    }
    poller.close()
    json.dump(out, sys.stdout, indent=1, default=str)
    print()


if __name__ == "__main__":
    main()
