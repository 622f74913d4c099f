"""Pure: each worker's GPU memory, from the fleet snapshot and its process tree."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric

from sglang_farm.gpus.snapshot import attribute_memory
from sglang_farm.metrics.families import (
    WORKER_LABELS,
    MetricsState,
    gpu_label,
    new_gauge,
)


def worker_memory(st: MetricsState) -> Iterator[Metric]:
    """The GPU memory each worker's process tree holds, from the fleet snapshot."""
    if st.farm is None:
        return
    mem = new_gauge(
        "sglang_farm_worker_gpu_memory_bytes",
        "GPU memory held by the worker's process tree (NVML per-process memory).",
        WORKER_LABELS,
    )
    fleet = st.fleet
    memory: dict[int, int] = {}
    if fleet is not None and fleet.nvml_up:
        memory = attribute_memory(fleet, st.worker_pids)
    for w in st.farm.workers:
        if w.id in memory and w.id in st.worker_pids:
            mem.add_metric([str(w.id), gpu_label(w.gpus)], memory[w.id])
    yield mem
