"""I/O: NVML snapshots of every GPU; the only module that imports `pynvml`.

`NvmlPoller.snapshot()` reads every GPU once and returns an immutable
`FleetSnapshot`. It blocks (NVML is a C library; the agent runs it in a thread)
and it never raises:

- a field that raises NotSupported (or NoPermission, FunctionNotFound) is `None`;
- a GPU-level failure (GpuIsLost, Unknown, ...) gives an unhealthy `GpuSnapshot`
  carrying the error, and the other GPUs are still read;
- NVML that cannot be initialised at all gives `nvml_up=False`, one warning in
  the log (none with `quiet=True`: a one-shot caller such as the doctor reports the
  snapshot's error itself, and no retry follows), and a new `nvmlInit` attempt only
  every `retry_init_s` seconds.

XID critical errors arrive through an NVML event set registered at init; every
snapshot drains it with zero-timeout waits and adds the codes to running totals.

The snapshot's types and the pure sums over it (`attribute_memory`, `process_tree`) are
in `gpu_snapshot`; `read_ppid_map` (reads /proc) is here.

Measured on an H200 (driver 580.159.04): every field here costs about 35 µs per GPU
in all, except `nvmlDeviceGetTotalEnergyConsumption`, which alone takes 3.9 ms. So
energy is read at most every `energy_interval_s` (30 s) and the last value is
reused in between; a counter updated every 30 s still gives a correct rate().
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

import structlog

from sglang_farm.gpus.snapshot import FleetSnapshot, GpuPoller, GpuProcess, GpuSnapshot
from sglang_farm.host import procfs

log = structlog.get_logger(__name__)


def read_ppid_map(proc: str = "/proc") -> dict[int, int]:
    """pid -> parent pid for every process in `proc`; processes exiting mid-read are skipped."""
    return {st.pid: st.ppid for st in procfs.all_stats(proc)}


# --- the NVML poller ----------------------------------------------------------

# Field-level NVML errors: the GPU answers, it just does not have this reading.
_ABSENT = ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_NO_PERMISSION", "NVML_ERROR_FUNCTION_NOT_FOUND")
# Errors that mean NVML itself is gone (driver unloaded, library shut down): re-init later.
_NVML_GONE = (
    "NVML_ERROR_UNINITIALIZED",
    "NVML_ERROR_DRIVER_NOT_LOADED",
    "NVML_ERROR_LIB_RM_VERSION_MISMATCH",
)
# Bound on XID events drained per snapshot, so a storm cannot stall the poll.
_MAX_EVENTS_PER_POLL = 256


class _GpuFailed(Exception):
    """Internal: a GPU-level NVML error while reading one GPU."""


class _NvmlGone(Exception):
    """Internal: NVML as a whole stopped answering."""


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _default_nvml() -> Any:
    import pynvml  # the one import of pynvml in the project

    return pynvml


class NvmlPoller:
    """Reads every GPU through NVML. Blocking; never raises from `snapshot()`.

    `nvml` is the seam: a module-like object with pynvml's names (tests pass a
    fake; the default imports `pynvml`, the module of the nvidia-ml-py package).
    """

    def __init__(
        self,
        nvml: Any | None = None,
        *,
        retry_init_s: float = 60.0,
        energy_interval_s: float = 30.0,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        quiet: bool = False,
    ) -> None:
        self._nvml_given = nvml
        self._quiet = quiet  # no log lines about NVML coming and going
        self._nvml: Any = nvml  # None until the first init attempt imports pynvml
        self._retry_init_s = retry_init_s
        self._energy_interval_s = energy_interval_s
        # GPU index -> (monotonic time of the read, energy in mJ or None if unsupported)
        self._energy: dict[int, tuple[float, Any]] = {}
        self._clock = clock
        self._monotonic = monotonic
        self._up = False
        self._last_init_at: float | None = None
        self._init_error: str | None = None
        self._warned = False
        self._driver: str | None = None
        self._event_set: Any | None = None
        self._xids: dict[tuple[int, int], int] = {}
        # Static identity per index, kept so an unhealthy GPU still carries its uuid.
        self._identity: dict[int, tuple[str | None, str | None, str | None]] = {}

    # -- lifecycle --

    def _codes(self, names: tuple[str, ...]) -> set[int]:
        nvml = self._nvml
        return {getattr(nvml, n) for n in names if hasattr(nvml, n)}

    def _try_init(self) -> None:
        self._last_init_at = self._monotonic()
        try:
            if self._nvml is None:
                self._nvml = _default_nvml()
            nvml = self._nvml
            nvml.nvmlInit()
        except Exception as exc:  # ImportError, OSError or NVMLError: all mean "no NVML"
            self._init_error = f"NVML unavailable: {type(exc).__name__}: {exc}"
            if not self._warned:
                self._warned = True
                if self._quiet:
                    return
                log.warning(
                    "nvml_unavailable",
                    error=self._init_error,
                    retry_in_s=self._retry_init_s,
                    advice="GPU metrics are absent (sglang_farm_nvml_up 0); check the NVIDIA "
                    'driver (nvidia-smi), or set [metrics] gpu_source = "fake" or "none"',
                )
            return
        self._up = True
        self._init_error = None
        if self._warned and not self._quiet:
            log.info("nvml_available")
        self._warned = False
        try:
            self._driver = _text(nvml.nvmlSystemGetDriverVersion())
        except Exception:  # optional reading
            self._driver = None
        self._register_events()

    def _register_events(self) -> None:
        nvml = self._nvml
        assert nvml is not None
        try:
            self._event_set = nvml.nvmlEventSetCreate()
            count = int(nvml.nvmlDeviceGetCount())
        except Exception as exc:  # XID counting is best effort
            self._event_set = None
            log.warning("nvml_xid_events_unavailable", error=str(exc))
            return
        for index in range(count):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                nvml.nvmlDeviceRegisterEvents(
                    handle, nvml.nvmlEventTypeXidCriticalError, self._event_set
                )
            except Exception as exc:  # e.g. NotSupported on some boards
                log.warning("nvml_xid_events_unavailable", gpu=index, error=str(exc))

    def close(self) -> None:
        """Free the event set and shut NVML down. Safe to call twice."""
        nvml = self._nvml
        if nvml is None or not self._up:
            return
        self._up = False
        if self._event_set is not None:
            with contextlib.suppress(Exception):  # teardown; nothing to do about it
                nvml.nvmlEventSetFree(self._event_set)
            self._event_set = None
        with contextlib.suppress(Exception):  # teardown
            nvml.nvmlShutdown()

    # -- reading --

    def snapshot(self) -> FleetSnapshot:
        """Read every GPU now. Never raises; see the module docstring for failure shapes."""
        taken_at = self._clock()
        t0 = self._monotonic()
        if not self._up and (
            self._last_init_at is None or t0 - self._last_init_at >= self._retry_init_s
        ):
            self._try_init()
        if not self._up:
            return self._down(taken_at, t0, self._init_error or "NVML not initialised")
        nvml = self._nvml
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except Exception as exc:  # NVML as a whole failed
            self._lost_nvml(exc)
            return self._down(taken_at, t0, f"NVML stopped answering: {exc}")
        try:
            self._drain_xids()
            gpus = tuple(self._read_gpu(i) for i in range(count))
        except _NvmlGone as exc:
            self._lost_nvml(exc.__cause__ or exc)
            return self._down(taken_at, t0, f"NVML stopped answering: {exc}")
        return FleetSnapshot(
            taken_at=taken_at,
            duration_s=self._monotonic() - t0,
            nvml_up=True,
            gpus=gpus,
            xid_events_total=MappingProxyType(dict(self._xids)),
            driver_version=self._driver,
        )

    def _down(self, taken_at: float, t0: float, error: str) -> FleetSnapshot:
        return FleetSnapshot(
            taken_at=taken_at,
            duration_s=self._monotonic() - t0,
            nvml_up=False,
            xid_events_total=MappingProxyType(dict(self._xids)),
            error=error,
        )

    def _lost_nvml(self, exc: BaseException) -> None:
        if not self._quiet:
            log.warning("nvml_lost", error=str(exc), retry_in_s=self._retry_init_s)
        self.close()
        self._up = False
        self._warned = True  # already said it; the next failing init stays quiet
        self._last_init_at = self._monotonic()

    def _classify(self, exc: Exception) -> str:
        """'absent', 'gone' or 'gpu' for an exception raised by an NVML call."""
        nvml = self._nvml
        err_cls = getattr(nvml, "NVMLError", None)
        if err_cls is None or not isinstance(exc, err_cls):
            return "gpu"
        value = getattr(exc, "value", None)
        if value in self._codes(_ABSENT):
            return "absent"
        if value in self._codes(_NVML_GONE):
            return "gone"
        return "gpu"

    def _field(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call one NVML getter: its value, None if unsupported; GPU or NVML failures raise."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            kind = self._classify(exc)
            if kind == "absent":
                return None
            if kind == "gone":
                raise _NvmlGone(str(exc)) from exc
            raise _GpuFailed(f"{fn.__name__}: {exc}") from exc

    def _drain_xids(self) -> None:
        nvml = self._nvml
        if self._event_set is None:
            return
        timeout_code = getattr(nvml, "NVML_ERROR_TIMEOUT", 10)
        for _ in range(_MAX_EVENTS_PER_POLL):
            try:
                # Timeout 0: return at once; NVML raises Timeout when nothing is pending.
                event = nvml.nvmlEventSetWait_v2(self._event_set, 0)
            except Exception as exc:  # Timeout is the normal "no event"
                if getattr(exc, "value", None) != timeout_code:
                    log.warning("nvml_xid_wait_failed", error=str(exc))
                return
            if int(event.eventType) & int(nvml.nvmlEventTypeXidCriticalError) == 0:
                continue
            try:
                index = int(nvml.nvmlDeviceGetIndex(event.device))
            except Exception:  # a GPU that lost itself may not say its index
                index = -1
            key = (index, int(event.eventData))
            self._xids[key] = self._xids.get(key, 0) + 1
            log.warning("gpu_xid_error", gpu=index, xid=key[1])

    def _read_gpu(self, index: int) -> GpuSnapshot:
        nvml = self._nvml
        uuid, name, bus = self._identity.get(index, (None, None, None))
        try:
            h = self._field(nvml.nvmlDeviceGetHandleByIndex, index)
            if h is None:
                raise _GpuFailed("nvmlDeviceGetHandleByIndex: not supported")
            raw_uuid = self._field(nvml.nvmlDeviceGetUUID, h)
            raw_name = self._field(nvml.nvmlDeviceGetName, h)
            pci = self._field(nvml.nvmlDeviceGetPciInfo, h)
            uuid = _text(raw_uuid) if raw_uuid is not None else None
            name = _text(raw_name) if raw_name is not None else None
            bus = _text(pci.busId) if pci is not None else None
            self._identity[index] = (uuid, name, bus)
            cc = self._field(nvml.nvmlDeviceGetCudaComputeCapability, h)
            mem = self._memory(h)
            util = self._field(nvml.nvmlDeviceGetUtilizationRates, h)
            temp = self._field(nvml.nvmlDeviceGetTemperature, h, nvml.NVML_TEMPERATURE_GPU)
            power_mw = self._field(nvml.nvmlDeviceGetPowerUsage, h)
            energy_mj = self._energy_mj(index, h)
            sm_mhz = self._field(nvml.nvmlDeviceGetClockInfo, h, nvml.NVML_CLOCK_SM)
            # Renamed in newer bindings ("throttle" -> "clocks event"); take what exists.
            reasons_fn = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
            if reasons_fn is None:
                reasons_fn = nvml.nvmlDeviceGetCurrentClocksThrottleReasons
            reasons = self._field(reasons_fn, h)
            ecc_c = self._field(
                nvml.nvmlDeviceGetTotalEccErrors,
                h,
                nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                nvml.NVML_VOLATILE_ECC,
            )
            ecc_u = self._field(
                nvml.nvmlDeviceGetTotalEccErrors,
                h,
                nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                nvml.NVML_VOLATILE_ECC,
            )
            rows = self._field(nvml.nvmlDeviceGetRemappedRows, h)
            persistence = self._field(nvml.nvmlDeviceGetPersistenceMode, h)
            procs = self._field(nvml.nvmlDeviceGetComputeRunningProcesses, h)
        except _GpuFailed as exc:
            log.warning("gpu_unhealthy", gpu=index, uuid=uuid, error=str(exc))
            return GpuSnapshot(
                index=index, uuid=uuid, name=name, pci_bus_id=bus, healthy=False, error=str(exc)
            )
        total, used, free, reserved = mem
        return GpuSnapshot(
            index=index,
            uuid=uuid,
            name=name,
            pci_bus_id=bus,
            compute_capability=(int(cc[0]), int(cc[1])) if cc is not None else None,
            memory_total_bytes=total,
            memory_used_bytes=used,
            memory_free_bytes=free,
            memory_reserved_bytes=reserved,
            utilization_gpu_ratio=util.gpu / 100.0 if util is not None else None,
            utilization_memory_ratio=util.memory / 100.0 if util is not None else None,
            temperature_c=float(temp) if temp is not None else None,
            power_w=power_mw / 1000.0 if power_mw is not None else None,
            energy_j=energy_mj / 1000.0 if energy_mj is not None else None,
            sm_clock_hz=sm_mhz * 1e6 if sm_mhz is not None else None,
            throttle_reasons=int(reasons) if reasons is not None else None,
            ecc_corrected_volatile_total=int(ecc_c) if ecc_c is not None else None,
            ecc_uncorrected_volatile_total=int(ecc_u) if ecc_u is not None else None,
            remapped_rows_correctable=int(rows[0]) if rows is not None else None,
            remapped_rows_uncorrectable=int(rows[1]) if rows is not None else None,
            remapped_rows_pending=bool(rows[2]) if rows is not None else None,
            persistence_mode=bool(persistence) if persistence is not None else None,
            remapped_rows_failure=bool(rows[3]) if rows is not None else None,
            # usedGpuMemory is None only under Windows WDDM; count it as 0 there.
            processes=tuple(
                GpuProcess(int(p.pid), int(p.usedGpuMemory or 0)) for p in (procs or ())
            ),
        )

    def _energy_mj(self, index: int, h: Any) -> Any:
        now = self._monotonic()
        cached = self._energy.get(index)
        if cached is not None and now - cached[0] < self._energy_interval_s:
            return cached[1]
        value = self._field(self._nvml.nvmlDeviceGetTotalEnergyConsumption, h)
        self._energy[index] = (now, value)
        return value

    def _memory(self, h: Any) -> tuple[int | None, int | None, int | None, int | None]:
        nvml = self._nvml
        v2 = getattr(nvml, "nvmlMemory_v2", None)
        mem = None
        if v2 is not None:
            # v2 adds `reserved` (645 MB on an H200); older drivers lack it: fall back to v1.
            mem = self._field(nvml.nvmlDeviceGetMemoryInfo, h, version=v2)
        if mem is None:
            mem = self._field(nvml.nvmlDeviceGetMemoryInfo, h)
            if mem is None:
                return None, None, None, None
            return int(mem.total), int(mem.used), int(mem.free), None
        return int(mem.total), int(mem.used), int(mem.free), int(mem.reserved)


def count_gpus(nvml: Any | None = None) -> int | None:
    """How many GPUs NVML sees, or None when NVML is unavailable (no driver, no GPU)."""
    try:
        lib = nvml if nvml is not None else _default_nvml()
        lib.nvmlInit()
    except Exception:  # NVML missing or broken: the caller reports "cannot count GPUs"
        return None
    try:
        return int(lib.nvmlDeviceGetCount())
    except Exception:  # same: any NVML error means the count is unknown
        return None
    finally:
        with contextlib.suppress(Exception):
            lib.nvmlShutdown()


def gpu_count_for_config(config_path: str) -> int | None:
    """NVML's GPU count when the config says gpus = "all"; None when not needed or unknown.

    Cheap for every other config: NVML is initialised only when the text asks for it.
    """
    try:
        with open(config_path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError):
        return None  # load_spec_file reports it
    if '"all"' not in text and "'all'" not in text:
        return None
    return count_gpus()


def choose_gpu_poller(source: str, count: int) -> GpuPoller | None:
    """The one choice of GPU source ([metrics] gpu_source): NVML, the demo's simulated GPUs
    (`count` of them), or none."""
    if source == "none":
        return None
    if source == "fake":
        from sglang_farm.gpus.simulated import FakeGpuPoller

        return FakeGpuPoller(count=max(count, 1))
    return NvmlPoller()
