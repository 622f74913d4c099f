"""Pure: the GPUs' families from the latest NVML fleet snapshot."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from sglang_farm.gpus.snapshot import FleetSnapshot, GpuSnapshot
from sglang_farm.metrics.families import (
    new_counter,
    new_gauge,
)


def gpus(fleet: FleetSnapshot) -> Iterator[Metric]:
    up = new_gauge("sglang_farm_nvml_up", "1 if NVML answered the latest GPU snapshot.")
    up.add_metric([], 1 if fleet.nvml_up else 0)
    yield up
    sim = new_gauge(
        "sglang_farm_gpu_simulated", "1 if the GPUs are simulated (demo), 0 if read through NVML."
    )
    sim.add_metric([], 1 if fleet.simulated else 0)
    yield sim

    gl = ["gpu", "uuid"]
    info = new_gauge(
        "sglang_farm_gpu_info",
        "Identity of a GPU; always 1.",
        [*gl, "name", "pci_bus_id", "compute_capability", "driver_version"],
    )
    healthy = new_gauge(
        "sglang_farm_gpu_healthy", "0 if NVML failed on this GPU (lost, unknown error).", gl
    )
    g: list[tuple[GaugeMetricFamily, Callable[[GpuSnapshot], float | int | bool | None]]] = [
        (
            new_gauge("sglang_farm_gpu_memory_total_bytes", "GPU memory size.", gl),
            lambda s: s.memory_total_bytes,
        ),
        (
            new_gauge("sglang_farm_gpu_memory_used_bytes", "GPU memory in use.", gl),
            lambda s: s.memory_used_bytes,
        ),
        (
            new_gauge("sglang_farm_gpu_memory_free_bytes", "GPU memory free.", gl),
            lambda s: s.memory_free_bytes,
        ),
        (
            new_gauge(
                "sglang_farm_gpu_memory_reserved_bytes", "GPU memory reserved by the driver.", gl
            ),
            lambda s: s.memory_reserved_bytes,
        ),
        (
            new_gauge(
                "sglang_farm_gpu_utilization_ratio", "Fraction of time a kernel ran (0-1).", gl
            ),
            lambda s: s.utilization_gpu_ratio,
        ),
        (
            new_gauge(
                "sglang_farm_gpu_memory_utilization_ratio",
                "Fraction of time device memory was read or written (0-1).",
                gl,
            ),
            lambda s: s.utilization_memory_ratio,
        ),
        (
            new_gauge("sglang_farm_gpu_temperature_celsius", "GPU core temperature.", gl),
            lambda s: s.temperature_c,
        ),
        (new_gauge("sglang_farm_gpu_power_watts", "Power draw.", gl), lambda s: s.power_w),
        (new_gauge("sglang_farm_gpu_sm_clock_hertz", "SM clock.", gl), lambda s: s.sm_clock_hz),
        (
            new_gauge(
                "sglang_farm_gpu_clock_event_reasons",
                "NVML clocks-event (throttle) reasons bitmask; 0 = not throttled.",
                gl,
            ),
            lambda s: s.throttle_reasons,
        ),
        (
            new_gauge(
                "sglang_farm_gpu_remapped_rows_pending",
                "1 if row remapping is pending (needs a GPU reset).",
                gl,
            ),
            lambda s: s.remapped_rows_pending,
        ),
        (
            new_gauge(
                "sglang_farm_gpu_remapped_rows_failure",
                "1 if a row remapping failed (replace the GPU).",
                gl,
            ),
            lambda s: s.remapped_rows_failure,
        ),
        (
            new_gauge("sglang_farm_gpu_compute_processes", "Compute processes on the GPU.", gl),
            lambda s: len(s.processes) if s.healthy else None,
        ),
    ]
    energy = new_counter(
        "sglang_farm_gpu_energy_joules", "Energy used since the driver loaded.", gl
    )
    ecc = new_counter(
        "sglang_farm_gpu_ecc_errors",
        "Volatile ECC errors since the driver loaded, by type (corrected, uncorrected).",
        [*gl, "type"],
    )
    rows = new_gauge("sglang_farm_gpu_remapped_rows", "Rows remapped, by kind.", [*gl, "kind"])
    uuids: dict[int, str] = {}
    for s in fleet.gpus:
        lv = [str(s.index), s.uuid or ""]
        uuids[s.index] = s.uuid or ""
        cc = f"{s.compute_capability[0]}.{s.compute_capability[1]}" if s.compute_capability else ""
        info.add_metric([*lv, s.name or "", s.pci_bus_id or "", cc, fleet.driver_version or ""], 1)
        healthy.add_metric(lv, 1 if s.healthy else 0)
        for fam, get in g:
            v = get(s)
            if v is not None:
                fam.add_metric(lv, float(v))
        if s.energy_j is not None:
            energy.add_metric(lv, s.energy_j)
        if s.ecc_corrected_volatile_total is not None:
            ecc.add_metric([*lv, "corrected"], s.ecc_corrected_volatile_total)
        if s.ecc_uncorrected_volatile_total is not None:
            ecc.add_metric([*lv, "uncorrected"], s.ecc_uncorrected_volatile_total)
        if s.remapped_rows_correctable is not None:
            rows.add_metric([*lv, "correctable"], s.remapped_rows_correctable)
        if s.remapped_rows_uncorrectable is not None:
            rows.add_metric([*lv, "uncorrectable"], s.remapped_rows_uncorrectable)
    yield info
    yield healthy
    for fam, _ in g:
        yield fam
    yield energy
    yield ecc
    yield rows
    xid = new_counter(
        "sglang_farm_gpu_xid_errors",
        "XID critical errors seen through NVML events since the agent started, by code.",
        [*gl, "xid"],
    )
    for (index, code), n in sorted(fleet.xid_events_total.items()):
        gpu = str(index) if index >= 0 else "unknown"
        xid.add_metric([gpu, uuids.get(index, ""), str(code)], n)
    yield xid
