"""I/O: simulated GPUs for machines without one (demo, CI); every snapshot says `simulated=True`.

`FakeGpuPoller` satisfies `gpu.GpuPoller`. It is deterministic: a GPU's memory in
use is the sum of what its assigned processes hold, utilisation follows from
whether any process is assigned, and energy integrates power over the injected
clock. Names and UUIDs say "simulated" so no dashboard mistakes it for hardware.

Hooks for the agent and tests: `assign(gpu, pids)` (the agent calls it with a
worker's process tree so per-worker VRAM shows in the demo), `set_process_memory`,
`inject_xid(gpu, code)` and `lose(gpu)` / `recover(gpu)`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType

from sglang_farm.gpus.snapshot import FleetSnapshot, GpuProcess, GpuSnapshot

# Figures of a real H200 (nvidia-smi: 143771 MiB; NVML v2 reserved: docs/reference/nvml.md §3).
H200_MEMORY_TOTAL_BYTES = 143_771 * 1024 * 1024
H200_MEMORY_RESERVED_BYTES = 644_939_776
# What one SGLang worker holds with --mem-fraction-static 0.88 plus CUDA context and graphs.
DEFAULT_PROCESS_BYTES = 126 * 1024**3
DEFAULT_MEM_FRACTION_STATIC = 0.88
# The part of it outside the static pool (CUDA context, graphs, activations).
_OUTSIDE_POOL_BYTES = DEFAULT_PROCESS_BYTES - int(
    DEFAULT_MEM_FRACTION_STATIC * H200_MEMORY_TOTAL_BYTES
)


def process_bytes_for(argv: Sequence[str], total_bytes: int = H200_MEMORY_TOTAL_BYTES) -> int:
    """What a simulated worker holds on its GPU, following its `--mem-fraction-static`
    (SGLang's static pool is that fraction of the GPU's total memory): the OOM ladder's
    lower fraction shows in the VRAM column (issue 31). The simulator's figure, not
    SGLang's: without the flag, 0.88 of an H200."""
    fraction = DEFAULT_MEM_FRACTION_STATIC
    for i, arg in enumerate(argv):
        value = None
        if arg == "--mem-fraction-static" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--mem-fraction-static="):
            value = arg.split("=", 1)[1]
        if value is not None:
            with contextlib.suppress(ValueError):  # SGLang would refuse it: default stands
                fraction = float(value)
    fraction = min(max(fraction, 0.0), 1.0)
    return min(total_bytes, int(fraction * total_bytes) + _OUTSIDE_POOL_BYTES)


_IDLE_POWER_W = 75.0
_BUSY_POWER_W = 520.0
_IDLE_TEMP_C = 32.0
_BUSY_TEMP_C = 61.0
_BUSY_UTILIZATION = 0.85
_SM_CLOCK_HZ = 1_980e6


class FakeGpuPoller:
    """N simulated H200-like GPUs. Thread-safe: `snapshot()` runs in a worker thread."""

    def __init__(
        self,
        count: int = 8,
        *,
        memory_total_bytes: int = H200_MEMORY_TOTAL_BYTES,
        process_bytes: int = DEFAULT_PROCESS_BYTES,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._count = count
        self._total = memory_total_bytes
        self._process_bytes = process_bytes
        self._clock = clock
        self._lock = threading.Lock()
        self._procs: dict[int, dict[int, int]] = {i: {} for i in range(count)}
        self._lost: set[int] = set()
        self._xids: dict[tuple[int, int], int] = {}
        self._energy_j: dict[int, float] = dict.fromkeys(range(count), 0.0)
        self._last_at: float | None = None

    # -- hooks --

    def assign(self, gpu: int, pids: Iterable[int], sizes: Mapping[int, int] | None = None) -> None:
        """Make exactly `pids` the compute processes of `gpu`, each holding the default size.

        Pids already on the GPU keep the size they have (see `set_process_memory`),
        unless `sizes` gives theirs. An empty iterable clears the GPU.
        """
        self._check(gpu)
        sizes = sizes or {}
        with self._lock:
            old = self._procs[gpu]
            self._procs[gpu] = {
                pid: sizes.get(pid) or old.get(pid, self._process_bytes) for pid in pids
            }

    def set_process_memory(self, gpu: int, pid: int, used_bytes: int) -> None:
        """Put `pid` on `gpu` holding `used_bytes` (0 removes it)."""
        self._check(gpu)
        with self._lock:
            if used_bytes <= 0:
                self._procs[gpu].pop(pid, None)
            else:
                self._procs[gpu][pid] = used_bytes

    def inject_xid(self, gpu: int, code: int) -> None:
        """Count one XID critical error `code` on `gpu`, as NVML's event set would."""
        self._check(gpu)
        with self._lock:
            self._xids[(gpu, code)] = self._xids.get((gpu, code), 0) + 1

    def lose(self, gpu: int) -> None:
        """Make `gpu` behave like a GPU that fell off the bus (NVML: GPU is lost)."""
        self._check(gpu)
        with self._lock:
            self._lost.add(gpu)

    def recover(self, gpu: int) -> None:
        with self._lock:
            self._lost.discard(gpu)

    def _check(self, gpu: int) -> None:
        if not 0 <= gpu < self._count:
            raise ValueError(f"simulated GPU {gpu} does not exist; GPUs are 0-{self._count - 1}")

    # -- GpuPoller --

    def snapshot(self) -> FleetSnapshot:
        now = self._clock()
        with self._lock:
            elapsed = 0.0 if self._last_at is None else max(0.0, now - self._last_at)
            self._last_at = now
            gpus = tuple(self._gpu(i, elapsed) for i in range(self._count))
            xids = MappingProxyType(dict(self._xids))
        return FleetSnapshot(
            taken_at=now,
            duration_s=0.0,
            nvml_up=True,
            gpus=gpus,
            xid_events_total=xids,
            simulated=True,
            driver_version="simulated",
        )

    def close(self) -> None:
        return None

    def _gpu(self, i: int, elapsed: float) -> GpuSnapshot:
        uuid = f"GPU-00000000-0000-4000-8000-5133{i:08d}"  # "5133" ~ "SIMU"; stable per index
        name = "NVIDIA H200 (simulated)"
        if i in self._lost:
            return GpuSnapshot(
                index=i,
                uuid=uuid,
                name=name,
                healthy=False,
                error="nvmlDeviceGetHandleByIndex: GPU is lost (simulated)",
            )
        procs = self._procs[i]
        busy = bool(procs)
        used = min(self._total - H200_MEMORY_RESERVED_BYTES, sum(procs.values()))
        power = _BUSY_POWER_W if busy else _IDLE_POWER_W
        self._energy_j[i] += power * elapsed
        return GpuSnapshot(
            index=i,
            uuid=uuid,
            name=name,
            pci_bus_id=f"00000000:{0x18 + i * 0x10:02X}:00.0",
            compute_capability=(9, 0),
            memory_total_bytes=self._total,
            memory_used_bytes=used,
            memory_free_bytes=self._total - H200_MEMORY_RESERVED_BYTES - used,
            memory_reserved_bytes=H200_MEMORY_RESERVED_BYTES,
            utilization_gpu_ratio=_BUSY_UTILIZATION if busy else 0.0,
            utilization_memory_ratio=_BUSY_UTILIZATION / 2 if busy else 0.0,
            temperature_c=_BUSY_TEMP_C if busy else _IDLE_TEMP_C,
            power_w=power,
            energy_j=self._energy_j[i],
            sm_clock_hz=_SM_CLOCK_HZ,
            throttle_reasons=0,
            ecc_corrected_volatile_total=0,
            ecc_uncorrected_volatile_total=0,
            remapped_rows_correctable=0,
            remapped_rows_uncorrectable=0,
            remapped_rows_pending=False,
            remapped_rows_failure=False,
            processes=tuple(GpuProcess(pid, b) for pid, b in sorted(procs.items())),
        )
