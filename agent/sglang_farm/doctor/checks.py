"""Pure: the doctor's vocabulary: a verdict (`Check`: status, message, fix, workers), the
`DoctorReport` of them, and the `Observations` `gather` makes for the rules to judge.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any

from sglang_farm.gpus.snapshot import FleetSnapshot
from sglang_farm.host.numa_facts import NumaFacts

GIB = 1024**3
# How much of a warning the preflight's one line carries (the doctor prints it whole).
WARNING_CHARS = 30


class Status(StrEnum):
    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"  # not applicable here, or could not be checked and is not needed


class CheckId(StrEnum):
    NVML = "nvml"
    GPU = "gpu"
    ENVIRONMENT = "environment"
    TORCH = "torch"
    SGLANG = "sglang"
    SGL_KERNEL = "sgl_kernel"
    DEEP_GEMM = "deep_gemm"
    FLASHINFER = "flashinfer"
    ATTENTION_BACKEND = "attention_backend"
    FLAGS = "flags"
    PORT_HTTP = "port_http"
    PORT_NCCL = "port_nccl"
    MODEL_PATH = "model_path"
    SHM = "shm"
    MEMORY = "mem_fraction_static"
    NCCL = "nccl"
    EXPOSURE = "exposure"
    GATEWAY = "gateway"
    NUMA = "numa"
    # Issue 30 item 4: whether another local user may bind the farm's ports while free.
    PORT_PRIVILEGE = "port_privilege"


@dataclass(frozen=True, slots=True)
class Check:
    """One verdict: what was checked, on which workers (() = the whole farm), and the fix."""

    id: CheckId
    status: Status
    message: str
    fix: str = ""
    workers: tuple[int, ...] = ()

    def applies_to(self, worker: int) -> bool:
        return not self.workers or worker in self.workers

    def to_dict(self) -> dict[str, object]:
        return {
            "check": str(self.id),
            "status": str(self.status),
            "workers": list(self.workers),
            "message": self.message,
            "fix": self.fix,
        }


@dataclass(frozen=True, slots=True)
class DoctorReport:
    """Every check, in a stable order; identical verdicts of several workers are one row."""

    checks: tuple[Check, ...]
    # worker id -> the attention backend it will run with (configured, auto-picked, or
    # SGLang's own default); absent when the GPU's architecture is unknown.
    attention: Mapping[int, str] = field(default_factory=lambda: MappingProxyType({}))
    # The raw probe results, one per probed environment (for --json and bug reports).
    environments: tuple[Mapping[str, Any], ...] = ()
    # The host's NUMA facts the NUMA check judged (each GPU's node for `farmctl status`);
    # None when not looked at, or the GPUs are simulated (their PCI ids are made up).
    numa: NumaFacts | None = None

    @property
    def ok(self) -> bool:
        """True when no check failed (warnings do not block)."""
        return not any(c.status is Status.FAIL for c in self.checks)

    def blocking(self, worker: int) -> list[Check]:
        """The failed checks that stop `worker` from starting (its own and farm-wide)."""
        return [c for c in self.checks if c.status is Status.FAIL and c.applies_to(worker)]

    def counts(self) -> dict[str, int]:
        return {str(s): sum(1 for c in self.checks if c.status is s) for s in Status}

    def gpu_numa_nodes(self) -> dict[int, int]:
        """GPU index -> its NUMA node, where known, on a host of several nodes (issue 34
        §5: `farmctl status` and `why` show each worker's); else empty."""
        return self.numa.gpu_node_map() if self.numa is not None else {}

    def warnings(self) -> list[str]:
        """Each warning named for the line that counts them: "check: the start of its
        message…" (`sglang-farm doctor` gives the whole), so the line stays one screen wide."""
        out = []
        for c in self.checks:
            if c.status is Status.WARN:
                text = f"{c.id}: {c.message}"
                out.append(text if len(text) <= WARNING_CHARS else text[:WARNING_CHARS] + "…")
        return out

    def to_dict(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "counts": self.counts(),
            "checks": [c.to_dict() for c in self.checks],
            "attention_backend": {str(k): v for k, v in sorted(self.attention.items())},
            "environments": [dict(e) for e in self.environments],
        }


# --- observations (what gather() found) ----------------------------------------------


@dataclass(frozen=True, slots=True)
class ProbeOutcome:
    """One probe run: its JSON, or why there is none."""

    result: Mapping[str, Any] | None = None
    error: str | None = None
    missing: bool = False  # the interpreter itself does not exist


@dataclass(frozen=True, slots=True)
class FlagsOutcome:
    """SGLang's parser over one worker's argv (`result` is envprobe's per-argv dict)."""

    parser: bool
    error: str | None = None
    result: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class PathFacts:
    exists: bool
    is_dir: bool = False
    has_config: bool = False
    size_bytes: int | None = None  # all files under the directory
    weights_bytes: int | None = None  # *.safetensors, *.bin, *.pt, *.pth, *.gguf
    in_shm: bool = False


@dataclass(frozen=True, slots=True)
class GatewayFacts:
    """`smg --version` run by the interpreter that runs the managed gateway."""

    python: str
    version: str | None = None  # its first line of output, when it ran
    error: str | None = None  # why it did not


@dataclass(frozen=True, slots=True)
class Observations:
    """Everything `evaluate` needs; built by `gather`, or by hand in tests."""

    fleet: FleetSnapshot
    env: Mapping[int, ProbeOutcome]  # worker id -> env probe of its environment
    flags: Mapping[int, FlagsOutcome]  # worker id -> its argv through SGLang's parser
    ports: Mapping[tuple[str, int], str | None]  # (host, port) -> None if free, else why not
    models: Mapping[str, PathFacts]  # model_path as configured -> facts
    shm_free_bytes: int | None = None
    # The config file's permission bits (st_mode & 0o7777), None when not looked at.
    config_mode: int | None = None
    # The key files the config names (`key_files`), by path; those absent were not looked at.
    key_files: Mapping[str, KeyFileFacts] = field(default_factory=lambda: MappingProxyType({}))
    # The uid the agent runs as (the key files' owner); None when not looked at.
    agent_uid: int | None = None
    # Why the agent would refuse its state or socket folder (`securepath.folder_problem`).
    folder_problems: tuple[str, ...] = ()
    gateway: GatewayFacts | None = None  # None: no managed gateway, or not looked at
    numa: NumaFacts | None = None  # None: not looked at
    # net.ipv4.ip_unprivileged_port_start and the first port of ip_local_port_range
    # (`/proc/sys/net/ipv4`); None when not looked at or unreadable.
    unprivileged_port_start: int | None = None
    local_port_range_start: int | None = None
    # (host, port) -> the worker whose own running processes hold it (not a conflict).
    own_ports: Mapping[tuple[str, int], int] = field(default_factory=lambda: MappingProxyType({}))


def gb(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


@dataclass(frozen=True, slots=True)
class KeyFileFacts:
    """A key file's owner and permission bits (`st_mode & 0o7777`), or why `stat` failed."""

    uid: int | None = None
    mode: int | None = None
    error: str | None = None


def _ids(workers: tuple[int, ...]) -> str:
    return ", ".join(str(w) for w in workers)
