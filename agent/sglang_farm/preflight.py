"""I/O: the preflight doctor — checks before any GPU time is spent, reported as data.

Two halves:

- `gather(spec, gpu_poller, ...) -> Observations` does all the I/O: one GPU snapshot,
  the environment probe (`envprobe.py`, run by the WORKERS' interpreter with the
  worker's environment, once per distinct interpreter/environment/GPU architecture),
  SGLang's own argument parser over every rendered command line, bind tests of the
  HTTP and NCCL ports, the model directory, and `/dev/shm`.
- `evaluate(spec, observations) -> DoctorReport` is pure: every rule of the interface
  sheet §5 (kernel binaries per architecture, attention backends per compute
  capability, deep_gemm and CUDA_HOME) and field notes §1 (the seed host's three
  launch failures on an SM 12.0 card) as data: a `Check` with a status and a fix.

`run_doctor` is both; `format_report` renders a table for people, `DoctorReport.to_dict`
the JSON. `preflight_blocking` is what the agent calls before starting a worker, and
`doctor` is the click command (`sglang-farm doctor [--config] [--json]`).

`resolve_attention_backend(cc)` is the farm's `attention_backend = "auto"`: one
backend per architecture (SGLang's own default order, field notes §1 for SM 12.0).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from types import MappingProxyType
from typing import Any

import click

from sglang_farm.classify import RENAMED_FLAGS
from sglang_farm.cmdline import build_command, flag_name
from sglang_farm.errors import ConfigError, FarmError
from sglang_farm.gpu import FleetSnapshot, GpuPoller
from sglang_farm.spec import FarmSpec, FlagValue, WorkerSpec

SGLANG_MODULE = "sglang.launch_server"
AUTO = "auto"
GIB = 1024**3

# Above this, CUDA graphs, activations and the CUDA context (outside SGLang's static
# pool) have almost nothing left: the seed host ran 0.88 on 48 GB cards (~6 GB spare).
MEM_FRACTION_WARN = 0.95
# Weights above this share of the static budget leave a KV cache too small to be useful.
WEIGHTS_SHARE_WARN = 0.9
# SGLang's processes and NCCL put shared-memory segments in /dev/shm too.
SHM_MIN_FREE_BYTES = 1 * GIB
# One probe imports torch and two native extensions in child processes; a cold page
# cache makes that tens of seconds. SGLang's parser import (torch, triton) likewise.
PROBE_TIMEOUT_S = 240.0
# What a systemd service sees (systemd's default PATH): workers run under systemd, so
# the probe must not inherit the operator's shell (a CUDA_HOME exported there would
# hide the seed's deep_gemm failure).
SYSTEMD_BASE_ENV: Mapping[str, str] = MappingProxyType(
    {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_HF_REPO_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# sglang's environ treats these as false (SGLANG_ENABLE_JIT_DEEPGEMM=0 disables DeepGEMM).
_FALSE_WORDS = frozenset({"0", "false", "no", "off", "n"})


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


# Checks whose verdict goes stale within seconds (another process binds the port; the
# worker's own previous instance held it when the report was made): `preflight_blocking`
# tests them again, live, instead of trusting the report.
_LIVE_CHECKS = frozenset({CheckId.PORT_HTTP, CheckId.PORT_NCCL})


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

    @property
    def ok(self) -> bool:
        """True when no check failed (warnings do not block)."""
        return not any(c.status is Status.FAIL for c in self.checks)

    def blocking(self, worker: int) -> list[Check]:
        """The failed checks that stop `worker` from starting (its own and farm-wide)."""
        return [c for c in self.checks if c.status is Status.FAIL and c.applies_to(worker)]

    def counts(self) -> dict[str, int]:
        return {str(s): sum(1 for c in self.checks if c.status is s) for s in Status}

    def to_dict(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "counts": self.counts(),
            "checks": [c.to_dict() for c in self.checks],
            "attention_backend": {str(k): v for k, v in sorted(self.attention.items())},
            "environments": [dict(e) for e in self.environments],
        }


class ProbeError(FarmError):
    """The environment probe could not run or gave no result (the message says why)."""


# --- observations (what gather() found) ----------------------------------------------


@dataclass(frozen=True, slots=True)
class ProbeOutcome:
    """One probe run: its JSON, or why there is none."""

    result: Mapping[str, Any] | None = None
    error: str | None = None


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
class Observations:
    """Everything `evaluate` needs; built by `gather`, or by hand in tests."""

    fleet: FleetSnapshot
    env: Mapping[int, ProbeOutcome]  # worker id -> env probe of its environment
    flags: Mapping[int, FlagsOutcome]  # worker id -> its argv through SGLang's parser
    ports: Mapping[tuple[str, int], str | None]  # (host, port) -> None if free, else why not
    models: Mapping[str, PathFacts]  # model_path as configured -> facts
    shm_free_bytes: int | None = None


# --- pure rules ------------------------------------------------------------------------


def resolve_attention_backend(cc: tuple[int, int]) -> str:
    """The farm's pick for `attention_backend = "auto"` on compute capability `cc`.

    SGLang's own default order for MHA models (interface sheet §5.2): Hopper -> fa3,
    datacenter Blackwell (SM 10.x) -> trtllm_mha, everything else -> flashinfer. On
    SM 12.x flashinfer is the only backend the seed host could run (no tcgen05 for
    FA3/FA4; Triton's tiles want more than the ~99 KB of shared memory per block).
    Below SM 8.0 flashinfer's prebuilt kernels do not apply: triton.
    """
    major = cc[0]
    if major == 9:
        return "fa3"
    if major == 10:
        return "trtllm_mha"
    if major >= 8:
        return "flashinfer"
    return "triton"


def resolve_flags(
    flags: Mapping[str, FlagValue], cc: tuple[int, int] | None
) -> dict[str, FlagValue]:
    """`flags` with every `"auto"` attention backend resolved for `cc`.

    With `cc` unknown the flag is dropped, so SGLang picks by itself.
    """
    out: dict[str, FlagValue] = {}
    for key, value in flags.items():
        if key.endswith("attention_backend") and value == AUTO:
            if cc is not None:
                out[key] = resolve_attention_backend(cc)
            continue
        out[key] = value
    return out


def _sm(cc: tuple[int, int]) -> str:
    return f"SM {cc[0]}.{cc[1]}"


_FIX_BACKEND = (
    'set attention_backend = "flashinfer" (works on every GPU) or "auto" (the farm picks '
    "per architecture) in [sglang]"
)
_NOT_NVIDIA = {
    "aiter": "AMD ROCm",
    "wave": "AMD ROCm",
    "ascend": "Huawei Ascend NPUs",
    "intel_amx": "Intel CPUs (AMX)",
    "intel_xpu": "Intel GPUs",
}


def backend_verdict(backend: str, cc: tuple[int, int]) -> tuple[Status, str]:
    """Whether SGLang 0.5.23 runs attention backend `backend` on `cc` (sheet §5.2).

    Returns a status and the reason (for a pass, a short note).
    """
    major = cc[0]
    sm = _sm(cc)
    if backend in _NOT_NVIDIA:
        return Status.FAIL, f"{backend} is a backend for {_NOT_NVIDIA[backend]}, not NVIDIA GPUs"
    if backend == "fa3":
        if major == 9:
            return Status.PASS, f"FlashAttention 3 runs on {sm}"
        if major == 8:
            return Status.WARN, (f"FlashAttention 3 runs on {sm} for non-MLA models only "
                                 "(SGLang asserts major == 9 for MLA models)")
        return Status.FAIL, (
            f"FlashAttention 3 cannot run on {sm}: SGLang asserts SM 8.x (non-MLA) or 9.x "
            "('FlashAttention v3 Backend requires SM>=80 and SM<=90. Please use "
            "--attention-backend flashinfer.'), and sgl_kernel's flash_ops ships sm_80, "
            "sm_86 and sm_90a only"
        )
    if backend == "fa4":
        if major in (10, 11):
            return Status.PASS, f"FlashAttention 4 (CuTe DSL, tcgen05) runs on {sm}"
        if major == 12:
            return Status.WARN, (
                f"FlashAttention 4 on {sm}: SGLang 0.5.23 has a dedicated SM120 path, but "
                "SM 12.x has no tcgen05 and older SGLang could not run FA4 there (the seed "
                "host); flashinfer is the proven backend"
            )
        return Status.FAIL, f"FlashAttention 4 needs Blackwell (SM 10.x/12.x), not {sm}"
    if backend == "trtllm_mha":
        if major in (9, 10, 12):
            return Status.PASS, f"TRT-LLM MHA runs on {sm}"
        return Status.FAIL, (f"TRT-LLM MHA is only supported on Hopper (SM90), Blackwell "
                             f"(SM100) and SM120, not {sm}")
    if backend == "trtllm_mla":
        if major in (10, 11, 12):
            return Status.PASS, f"TRT-LLM MLA runs on {sm} (with CUDA >= 12.8)"
        return Status.FAIL, f"TRT-LLM MLA is Blackwell-only (SM 10.x-12.x), not {sm}"
    if backend == "cutedsl_mla":
        if major == 10:
            return Status.PASS, f"CuTe DSL MLA runs on {sm} (decode only)"
        return Status.FAIL, f"CuTe DSL MLA runs on SM 10.x only (tcgen05), not {sm}"
    if backend == "flashmla":
        if major in (9, 10):
            return Status.PASS, f"FlashMLA ships kernels for {sm}"
        return Status.FAIL, (f"FlashMLA ships kernels for sm_90a, sm_100f and sm_103a only, "
                             f"not {sm}")
    if backend == "triton":
        if major == 12:
            return Status.WARN, (
                f"Triton attention on {sm} is risky: the card has ~99 KB of shared memory per "
                "block and Triton's tiles were sized for more (the seed host could run only "
                "flashinfer)"
            )
        return Status.PASS, f"Triton attention has tile sizes for {sm}"
    if backend in ("torch_native", "flex_attention"):
        return Status.WARN, f"{backend} runs on {sm} but disables CUDA graphs (slow)"
    if backend == "flashinfer":
        if major < 8:
            return Status.WARN, f"flashinfer on {sm}: SGLang's kernels need SM 8.0 or newer"
        return Status.PASS, f"flashinfer runs on {sm}"
    return Status.PASS, f"{backend}: no compute-capability rule is known for it"


def _parse_version(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    nums = re.findall(r"\d+", text.split("+")[0])
    return tuple(int(n) for n in nums[:3]) if nums else None


def arch_covers(arch_list: Sequence[str], cc: tuple[int, int]) -> bool:
    """True when a CUDA binary built for `arch_list` runs on `cc`.

    sm_XY cubins run on the same major with minor >= Y; sm_XYa / sm_XYf only on XY
    itself (f: the whole family of that major); compute_XY (PTX) JITs for anything >= XY.
    """
    major, minor = cc
    for arch in arch_list:
        m = re.fullmatch(r"(sm|compute)_(\d+?)(\d)([af]?)", arch.strip())
        if m is None:
            continue
        kind, amaj, amin, suffix = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
        if kind == "compute" and (amaj, amin) <= (major, minor):
            return True
        if kind == "sm" and amaj == major and (
            (suffix == "" and amin <= minor) or (suffix == "a" and amin == minor)
            or (suffix == "f" and amin <= minor)
        ):
            return True
    return False


def _gb(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def _worker_cc(fleet: FleetSnapshot, worker: WorkerSpec) -> tuple[int, int] | None:
    ccs = {g.compute_capability for i in worker.gpus if (g := fleet.gpu(i)) is not None}
    ccs.discard(None)
    return min(ccs) if ccs else None  # type: ignore[type-var]


def _worker_memory(fleet: FleetSnapshot, worker: WorkerSpec) -> int | None:
    totals = [g.memory_total_bytes for i in worker.gpus
              if (g := fleet.gpu(i)) is not None and g.memory_total_bytes]
    return min(totals) if totals else None


def _gpu_checks(fleet: FleetSnapshot, w: WorkerSpec) -> list[Check]:
    out: list[Check] = []
    if not fleet.nvml_up:
        return out  # one farm-wide NVML row says it
    for i in w.gpus:
        g = fleet.gpu(i)
        if g is None:
            out.append(Check(CheckId.GPU, Status.FAIL,
                             f"GPU {i} is not on this host (NVML sees {len(fleet.gpus)} GPU(s))",
                             "fix workers.gpus in the config (NVML indices, as in nvidia-smi)"))
        elif not g.healthy:
            out.append(Check(CheckId.GPU, Status.FAIL, f"GPU {i} does not answer: {g.error}",
                             "check `nvidia-smi` and the kernel log (XID errors); the GPU may "
                             "need a reset or the host a reboot"))
        elif g.compute_capability is None:
            out.append(Check(CheckId.GPU, Status.WARN,
                             f"GPU {i}: NVML does not report its compute capability; the "
                             "architecture checks are skipped", "check the NVIDIA driver"))
        elif g.compute_capability < (8, 0):
            out.append(Check(CheckId.GPU, Status.FAIL,
                             f"GPU {i} is {_sm(g.compute_capability)}: SGLang's kernels "
                             "(sglang-kernel) are built for SM 8.0 and newer",
                             "use GPUs of SM 8.0 (Ampere) or newer"))
        else:
            mem = f", {_gb(g.memory_total_bytes)}" if g.memory_total_bytes else ""
            out.append(Check(CheckId.GPU, Status.PASS,
                             f"{g.name or 'GPU'}: {_sm(g.compute_capability)}{mem}"
                             + (" (simulated)" if fleet.simulated else "")))
    ccs = {g.compute_capability for i in w.gpus if (g := fleet.gpu(i)) is not None}
    if len(ccs) > 1:
        out.append(Check(CheckId.GPU, Status.WARN,
                         f"the worker's GPUs {list(w.gpus)} differ in architecture",
                         "give a tensor-parallel worker GPUs of one model"))
    return out


_FIX_PYTHON = ("set [farm] python to the interpreter of the SGLang environment "
               "(e.g. /opt/sglang/bin/python3)")


def _env_checks(
    spec: FarmSpec, w: WorkerSpec, cc: tuple[int, int] | None, probe: ProbeOutcome
) -> list[Check]:
    python = spec.farm.python
    if probe.result is None:
        return [Check(CheckId.ENVIRONMENT, Status.FAIL,
                      f"cannot probe the SGLang environment {python}: {probe.error}",
                      _FIX_PYTHON)]
    r = probe.result
    out = [Check(CheckId.ENVIRONMENT, Status.PASS,
                 f"{python}: Python {r.get('python', {}).get('version', '?')}")]
    # Another module (the demo's simulator) needs none of SGLang's stack.
    if spec.farm.module == SGLANG_MODULE:
        out += _torch_checks(r.get("torch") or {}, cc, len(w.gpus))
        sg = r.get("sglang") or {}
        if sg.get("installed"):
            out.append(Check(CheckId.SGLANG, Status.PASS,
                             f"sglang {sg.get('version') or '(version unknown)'} installed"))
        else:
            out.append(Check(CheckId.SGLANG, Status.FAIL,
                             f"sglang is not installed in {python}",
                             f"`{python} -m pip install sglang`, or " + _FIX_PYTHON))
        out.append(_kernel_check(r.get("sgl_kernel") or {}, cc, python))
        out.append(_deep_gemm_check(r, cc))
    return out


def _torch_checks(t: Mapping[str, Any], cc: tuple[int, int] | None, n_gpus: int) -> list[Check]:
    if not t.get("installed"):
        return [Check(CheckId.TORCH, Status.FAIL,
                      f"torch does not import: {t.get('error', 'not installed')}",
                      "install the torch build SGLang pins (sglang 0.5.23: torch==2.14.1) "
                      "in the SGLang environment")]
    version, cuda = t.get("version") or "?", t.get("cuda")
    arch = list(t.get("arch_list") or [])
    out: list[Check] = []
    if not cuda:
        return [Check(CheckId.TORCH, Status.FAIL,
                      f"torch {version} is a CPU-only build (torch.version.cuda is None)",
                      "install a CUDA build of torch (e.g. the cu128/cu130 wheels)")]
    head = f"torch {version} (CUDA {cuda})"
    if cc is not None and arch and not arch_covers(arch, cc):
        out.append(Check(
            CheckId.TORCH, Status.FAIL,
            f"{head} has no kernels for {_sm(cc)} (sm_{cc[0]}{cc[1]}): its arch list is "
            f"{' '.join(arch)}; CUDA would fail with 'no kernel image is available'",
            f"install a torch build whose arch list has sm_{cc[0]}{cc[1]} (SM 12.x needs "
            "CUDA >= 12.8 wheels, e.g. cu128 or cu130), the version sglang pins"))
    elif t.get("cuda_available") is False:
        why = t.get("cuda_available_error") or "torch.cuda.is_available() is False"
        out.append(Check(CheckId.TORCH, Status.FAIL,
                         f"{head} cannot use CUDA in the workers' environment: {why}",
                         "check the driver (`nvidia-smi`), that the driver supports CUDA "
                         f"{cuda}, and the workers' CUDA_VISIBLE_DEVICES"))
    else:
        covers = f", covers {_sm(cc)}" if cc is not None and arch else ""
        out.append(Check(CheckId.TORCH, Status.PASS, f"{head}{covers}"))
    cuda_v = _parse_version(cuda)
    if n_gpus > 1 and cc is not None and cc[0] == 12 and cuda_v is not None and cuda_v < (12, 9):
        out.append(Check(CheckId.NCCL, Status.WARN,
                         f"NCCL has a known issue on SM 12.x before CUDA 12.9 (torch is built "
                         f"with CUDA {cuda}) and this worker spans {n_gpus} GPUs",
                         "use a torch build with CUDA >= 12.9, or one GPU per worker"))
    return out


def _first_lines(text: str, limit: int = 3) -> str:
    """The first line of an error, plus its underlying errors (sgl_kernel lists them
    after "Error details"), joined on one line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    details = [i for i, ln in enumerate(lines) if ln.startswith("Error details")]
    rest = lines[details[0] + 1:] if details else []
    return " | ".join(lines[:1] + rest[: limit - 1])


def _variant_order(name: str) -> tuple[int, str]:
    digits = re.sub(r"\D", "", name)
    return (int(digits) if digits else 0, name)


def _kernel_check(k: Mapping[str, Any], cc: tuple[int, int] | None, python: str) -> Check:
    if not k.get("installed"):
        return Check(CheckId.SGL_KERNEL, Status.FAIL,
                     "sgl_kernel (PyPI: sglang-kernel) is not installed",
                     f"`{python} -m pip install sglang-kernel` (the version sglang pins)")
    name = f"sglang-kernel {k.get('version') or '(version unknown)'}"
    variants = sorted(k.get("variants") or [], key=_variant_order)
    ships = ", ".join(f"{v}/" for v in variants) or "no sm*/ binaries"
    expected = None if cc is None else ("sm90" if cc == (9, 0) else "sm100")
    loads = f"; {_sm(cc)} loads {expected}/" if cc is not None else ""
    imp = k.get("import") or {}
    fix = (f"install an sglang-kernel built for {_sm(cc) if cc else 'this GPU'} and this torch "
           f"(sglang-kernel 0.4.10 ships sm_80 to sm_120a in sm90/ and sm100/): "
           f"`{python} -m pip install --upgrade sglang-kernel` (the version sglang pins)")
    if imp.get("ok"):
        return Check(CheckId.SGL_KERNEL, Status.PASS, f"{name} imports (ships {ships}{loads})")
    if imp:
        text = imp.get("message") or ""
        why = _first_lines(text) or f"{imp.get('type')}"
        abi = ("; 'undefined symbol' means a torch ABI mismatch: sglang-kernel was built "
               "for another torch") if "undefined symbol" in text else ""
        return Check(CheckId.SGL_KERNEL, Status.FAIL,
                     f"import sgl_kernel fails{' on ' + _sm(cc) if cc else ''}: {why} "
                     f"({name} ships {ships}{loads}){abi}", fix)
    if expected is not None and expected not in variants and not k.get("top_level_common_ops"):
        return Check(CheckId.SGL_KERNEL, Status.FAIL,
                     f"{name} ships {ships} but {_sm(cc) if cc else 'this GPU'} loads "
                     f"{expected}/", fix)
    return Check(CheckId.SGL_KERNEL, Status.WARN,
                 f"{name} ships {ships}{loads}; its import was not tested", "")


def _deep_gemm_disabled(env: Mapping[str, Any]) -> str | None:
    for var in ("SGLANG_ENABLE_JIT_DEEPGEMM", "SGL_ENABLE_JIT_DEEPGEMM"):
        value = env.get(var)
        if isinstance(value, str) and value.strip().lower() in _FALSE_WORDS:
            return f"{var}={value}"
    return None


_FIX_CUDA_HOME = (
    'set CUDA_HOME=/usr/local/cuda-12.x (a CUDA toolkit with bin/nvcc) or '
    'SGLANG_ENABLE_JIT_DEEPGEMM=0 in [farm].env, e.g. env = { CUDA_HOME = '
    '"/usr/local/cuda-12.9" }'
)


def _deep_gemm_check(r: Mapping[str, Any], cc: tuple[int, int] | None) -> Check:
    d = r.get("deep_gemm") or {}
    home = r.get("cuda_home") or {}
    disabled = _deep_gemm_disabled(r.get("env") or {})
    where = (f"CUDA toolkit: {home['path']} (from {home.get('source')})" if home.get("path")
             else "no CUDA toolkit: CUDA_HOME and CUDA_PATH unset, no nvcc on PATH, no "
                  "/usr/local/cuda")
    if disabled:
        return Check(CheckId.DEEP_GEMM, Status.PASS, f"DeepGEMM disabled by {disabled}")
    if not d.get("installed"):
        return Check(CheckId.DEEP_GEMM, Status.PASS, "deep_gemm not installed (SGLang skips it)")
    if cc is not None and cc[0] < 9:
        return Check(CheckId.DEEP_GEMM, Status.PASS, "deep_gemm is not used below SM 9.0")
    imp = d.get("import") or {}
    if imp.get("ok"):
        return Check(CheckId.DEEP_GEMM, Status.PASS, f"deep_gemm imports ({where})")
    if imp:
        kind, msg, line = imp.get("type"), imp.get("message") or "", imp.get("line") or ""
        text = f"{kind}: {msg or line}".strip()
        if kind == "AssertionError":
            # SGLang catches ImportError/OSError/RuntimeError only: this one kills the scheduler.
            return Check(CheckId.DEEP_GEMM, Status.FAIL,
                         f"import deep_gemm fails with {text}: SGLang imports it on SM >= 9.0 "
                         f"unless SGLANG_ENABLE_JIT_DEEPGEMM=0, and the scheduler dies ({where})",
                         _FIX_CUDA_HOME)
        return Check(CheckId.DEEP_GEMM, Status.WARN,
                     f"import deep_gemm fails with {text}; SGLang catches this and runs "
                     "without DeepGEMM", "reinstall sgl-deep-gemm, or set "
                     "SGLANG_ENABLE_JIT_DEEPGEMM=0 in [farm].env to silence it")
    if not home.get("path"):
        return Check(CheckId.DEEP_GEMM, Status.FAIL,
                     f"deep_gemm is installed and there is {where}: its import asserts "
                     "`cuda_home is not None`", _FIX_CUDA_HOME)
    return Check(CheckId.DEEP_GEMM, Status.WARN,
                 f"deep_gemm is installed; its import was not tested ({where})", "")


def _attention_checks(
    w: WorkerSpec, cc: tuple[int, int] | None, facts: Mapping[str, Any] | None
) -> tuple[list[Check], str | None]:
    out: list[Check] = []
    keys = [k for k in ("attention_backend", "prefill_attention_backend",
                        "decode_attention_backend") if k in w.flags]
    picked: str | None = None
    if cc is None:
        if keys:
            out.append(Check(CheckId.ATTENTION_BACKEND, Status.WARN,
                             "GPU architecture unknown: the attention backend is not checked"))
        return out, None
    if not keys:
        picked = resolve_attention_backend(cc)
        status, why = backend_verdict(picked, cc)
        out.append(Check(CheckId.ATTENTION_BACKEND, status,
                         f"not set: SGLang picks its default for {_sm(cc)}, {picked} for "
                         f"MHA models ({why})", "" if status is Status.PASS else _FIX_BACKEND))
    for key in keys:
        raw = w.flags[key]
        backend = resolve_attention_backend(cc) if raw == AUTO else str(raw)
        if key == "attention_backend":
            picked = backend
        status, why = backend_verdict(backend, cc)
        label = f"{key} = auto: the farm picked {backend} for {_sm(cc)}" if raw == AUTO else (
            f"{key} = {backend}")
        out.append(Check(CheckId.ATTENTION_BACKEND, status, f"{label}: {why}",
                         "" if status is Status.PASS else _FIX_BACKEND))
    uses_flashinfer = picked == "flashinfer" or any(
        w.flags.get(k) == "flashinfer" for k in (*keys, "mamba_backend"))
    if facts is not None and uses_flashinfer:
        fi = facts.get("flashinfer") or {}
        if fi.get("installed"):
            out.append(Check(CheckId.FLASHINFER, Status.PASS,
                             f"flashinfer {fi.get('version') or ''} installed".replace("  ", " ")))
        else:
            out.append(Check(CheckId.FLASHINFER, Status.FAIL,
                             "the attention backend is flashinfer and flashinfer is not installed",
                             "install flashinfer-python (the version sglang pins) in the SGLang "
                             "environment"))
    if (w.flags.get("mamba_radix_cache_strategy") == "no_buffer" and picked == "trtllm_mha"):
        out.append(Check(CheckId.ATTENTION_BACKEND, Status.FAIL,
                         "mamba_radix_cache_strategy = no_buffer with trtllm_mha: SGLang asserts "
                         "a backend other than trtllm_mha for no_buffer",
                         _FIX_BACKEND))
    return out, picked


def _flag_checks(spec: FarmSpec, w: WorkerSpec, outcome: FlagsOutcome | None) -> list[Check]:
    if spec.farm.module != SGLANG_MODULE:
        return [Check(CheckId.FLAGS, Status.SKIP,
                      f"module {spec.farm.module} is not {SGLANG_MODULE}: flags not validated")]
    out: list[Check] = []
    # Renamed flags are known without a parser (config refuses them; a ladder could not).
    for key in w.flags:
        if key in RENAMED_FLAGS:
            out.append(_renamed(key))
    if outcome is None or not outcome.parser or outcome.result is None:
        why = (outcome.error if outcome else None) or "no result"
        out.append(Check(CheckId.FLAGS, Status.WARN,
                         f"cannot validate flags: sglang not importable ({why})",
                         "make `sglang.srt.server_args` importable in the SGLang environment "
                         "(it needs torch) so the doctor can use SGLang's own parser"))
        return out
    res = outcome.result
    hard = False
    for tok in res.get("tokens") or ():
        flag, match = str(tok.get("flag")), tok.get("match")
        snake = flag.lstrip("-").replace("-", "_")
        if match == "unknown":
            hard = True
            if snake in RENAMED_FLAGS:
                if all(c.message != _renamed(snake).message for c in out):
                    out.append(_renamed(snake))
            else:
                out.append(Check(CheckId.FLAGS, Status.FAIL,
                                 f"{flag} is not a flag of the installed SGLang (argparse: "
                                 "unrecognized arguments, exit 2)",
                                 f"remove or correct {snake} in [sglang]; `{spec.farm.python} -m "
                                 f"{SGLANG_MODULE} --help` lists the flags"))
        elif match == "ambiguous":
            hard = True
            cands = ", ".join(tok.get("candidates") or ())
            out.append(Check(CheckId.FLAGS, Status.FAIL,
                             f"{flag} is ambiguous: it could match {cands} (argparse exit 2)",
                             f"write the full name of one of them instead of {snake}"))
        elif match == "prefix":
            full = str(tok.get("expands_to"))
            out.append(Check(CheckId.FLAGS, Status.WARN,
                             f"{flag} is not a full flag name: SGLang's argparse accepts it as "
                             f"an abbreviation of {full}",
                             f"write {full.lstrip('-').replace('-', '_')} in [sglang] (an "
                             "abbreviation can bind to another flag after an upgrade)"))
    error = res.get("error")
    if res.get("exit_status") and not hard:
        out.append(Check(CheckId.FLAGS, Status.FAIL,
                         f"SGLang's parser rejects the command line: {error}",
                         "correct the value in [sglang]"))
    if not out:
        n = len(res.get("tokens") or ())
        out.append(Check(CheckId.FLAGS, Status.PASS, f"{n} flags accepted by SGLang's parser"))
    return out


def _renamed(key: str) -> Check:
    new = RENAMED_FLAGS[key]
    if len(new) == 1:
        msg = (f"{flag_name(key)} is not a flag of the installed SGLang: it was renamed "
               f"{flag_name(new[0])}")
        fix = f"write {new[0]} instead of {key} in [sglang] (same values)"
    else:
        msg = (f"{flag_name(key)} was removed from SGLang: it is now "
               + " and ".join(flag_name(n) for n in new))
        fix = "write " + " and/or ".join(new) + f" instead of {key} in [sglang]"
    return Check(CheckId.FLAGS, Status.FAIL, msg, fix)


def _port_checks(obs: Observations, w: WorkerSpec) -> list[Check]:
    out = []
    for cid, host, port, what, key in (
        (CheckId.PORT_HTTP, w.host, w.port, "HTTP", "base_port"),
        (CheckId.PORT_NCCL, "0.0.0.0", w.nccl_port, "NCCL", "nccl_base_port"),
    ):
        busy = obs.ports.get((host, port))
        if busy is None:
            out.append(Check(cid, Status.PASS, f"{what} port free"))
        else:
            out.append(Check(cid, Status.FAIL, f"{what} port {port} on {host}: {busy}",
                             f"stop what listens there (`ss -ltnp 'sport = :{port}'`; if the "
                             f"farm is running, its own worker holds it) or change "
                             f"workers.{key}"))
    return out


def _model_checks(obs: Observations, w: WorkerSpec, mem_total: int | None) -> list[Check]:
    raw = w.flags.get("model_path")
    if not isinstance(raw, str):
        return []
    facts = obs.models.get(raw)
    out: list[Check] = []
    if facts is None:
        return out
    if not facts.exists:
        if _HF_REPO_RE.match(raw) and not raw.startswith((".", "/")):
            out.append(Check(CheckId.MODEL_PATH, Status.WARN,
                             f"{raw} is not a local directory: SGLang will download it from "
                             "Hugging Face at the first start (minutes, on every worker at once)",
                             "download it once (`huggingface-cli download`) and set model_path "
                             "to the local directory"))
        else:
            tmpfs = (" (/dev/shm is a tmpfs, emptied at every boot: copy the model there again)"
                     if raw.startswith("/dev/shm") else "")
            out.append(Check(CheckId.MODEL_PATH, Status.FAIL, f"{raw} does not exist{tmpfs}",
                             "copy the model there or set model_path in [sglang]"))
        return out
    if not facts.is_dir or not facts.has_config:
        out.append(Check(CheckId.MODEL_PATH, Status.FAIL,
                         f"{raw} has no config.json: not a Hugging Face model directory",
                         "point model_path at the directory that holds config.json and the "
                         "weights"))
        return out
    size = f" ({_gb(facts.weights_bytes)} of weights)" if facts.weights_bytes else ""
    out.append(Check(CheckId.MODEL_PATH, Status.PASS, f"{raw} has config.json{size}"))
    if facts.in_shm and obs.shm_free_bytes is not None:
        used = _gb(facts.size_bytes or 0)
        if obs.shm_free_bytes < SHM_MIN_FREE_BYTES:
            out.append(Check(CheckId.SHM, Status.WARN,
                             f"the model takes {used} of /dev/shm (RAM-backed) and only "
                             f"{_gb(obs.shm_free_bytes)} is left; SGLang and NCCL need "
                             "/dev/shm for shared-memory segments",
                             "free /dev/shm or enlarge it (mount -o remount,size=...)"))
        else:
            out.append(Check(CheckId.SHM, Status.PASS,
                             f"the model takes {used} of /dev/shm; {_gb(obs.shm_free_bytes)} free"))
    frac = w.flags.get("mem_fraction_static")
    if isinstance(frac, int | float) and not isinstance(frac, bool) and mem_total:
        budget = frac * mem_total
        per_gpu = (facts.weights_bytes or 0) / max(1, len(w.gpus))
        tp = f" per GPU (tp {len(w.gpus)})" if len(w.gpus) > 1 else ""
        if per_gpu and per_gpu > budget:
            out.append(Check(CheckId.MEMORY, Status.FAIL,
                             f"the weights alone ({_gb(per_gpu)}{tp}) exceed "
                             f"mem_fraction_static {frac} x {_gb(mem_total)} = {_gb(budget)}: "
                             "SGLang stops with 'Loaded weights leave no GPU memory for the KV "
                             "cache'", "raise mem_fraction_static, use more GPUs per worker "
                             "(gpus_per_worker), or a smaller/quantized model"))
        elif per_gpu and per_gpu > WEIGHTS_SHARE_WARN * budget:
            out.append(Check(CheckId.MEMORY, Status.WARN,
                             f"the weights ({_gb(per_gpu)}{tp}) fill over "
                             f"{WEIGHTS_SHARE_WARN:.0%} of mem_fraction_static {frac} x "
                             f"{_gb(mem_total)}: little room for the KV cache",
                             "raise mem_fraction_static a little or use more GPUs per worker"))
    return out


def _memory_fraction_check(w: WorkerSpec, mem_total: int | None) -> list[Check]:
    frac = w.flags.get("mem_fraction_static")
    if not isinstance(frac, int | float) or isinstance(frac, bool):
        return []
    if frac > MEM_FRACTION_WARN:
        spare = f" ({_gb((1 - frac) * mem_total)} of {_gb(mem_total)})" if mem_total else ""
        return [Check(CheckId.MEMORY, Status.WARN,
                      f"mem_fraction_static {frac} leaves {1 - frac:.0%} of the card{spare} "
                      "for CUDA graphs, activations and the CUDA context: expect CUDA OOM",
                      "use 0.80-0.92 (the seed ran 0.88 on 48 GB cards)")]
    share = f": {_gb(frac * mem_total)} of {_gb(mem_total)}" if mem_total else ""
    return [Check(CheckId.MEMORY, Status.PASS, f"mem_fraction_static {frac}{share}")]


def _merge(checks: Iterable[tuple[int | None, Check]]) -> tuple[Check, ...]:
    """One row per distinct verdict, with the workers it applies to (first-seen order)."""
    rows: dict[tuple[CheckId, Status, str, str], list[int]] = {}
    farm_wide: set[tuple[CheckId, Status, str, str]] = set()
    for worker, c in checks:
        key = (c.id, c.status, c.message, c.fix)
        rows.setdefault(key, [])
        if worker is None:
            farm_wide.add(key)
        elif worker not in rows[key]:
            rows[key].append(worker)
    return tuple(
        Check(k[0], k[1], k[2], k[3], () if k in farm_wide else tuple(sorted(ws)))
        for k, ws in rows.items()
    )


def evaluate(spec: FarmSpec, obs: Observations) -> DoctorReport:
    """Every check over what `gather` observed. Pure."""
    found: list[tuple[int | None, Check]] = []
    fleet = obs.fleet
    if not fleet.nvml_up:
        found.append((None, Check(
            CheckId.NVML, Status.WARN,
            f"NVML is not available ({fleet.error or 'no reason given'}): GPUs and their "
            "compute capability are unknown, so the architecture checks are skipped",
            "check the NVIDIA driver (`nvidia-smi`); in containers pass the GPUs through")))
    elif fleet.simulated:
        found.append((None, Check(CheckId.NVML, Status.WARN,
                                  "the GPUs are simulated ([metrics] gpu_source = \"fake\")",
                                  "use gpu_source = \"nvml\" on a real GPU host")))
    attention: dict[int, str] = {}
    for w in spec.workers:
        cc = _worker_cc(fleet, w)
        mem_total = _worker_memory(fleet, w)
        probe = obs.env.get(w.id) or ProbeOutcome(error="not probed")
        for c in _gpu_checks(fleet, w):
            found.append((w.id, c))
        for c in _env_checks(spec, w, cc, probe):
            found.append((w.id, c))
        if spec.farm.module == SGLANG_MODULE:
            att, picked = _attention_checks(w, cc, probe.result)
            found += [(w.id, c) for c in att]
            if picked is not None:
                attention[w.id] = picked
        found += [(w.id, c) for c in _flag_checks(spec, w, obs.flags.get(w.id))]
        found += [(w.id, c) for c in _port_checks(obs, w)]
        if spec.farm.module == SGLANG_MODULE:
            found += [(w.id, c) for c in _model_checks(obs, w, mem_total)]
            found += [(w.id, c) for c in _memory_fraction_check(w, mem_total)]
    envs: list[Mapping[str, Any]] = []
    for outcome in obs.env.values():
        if outcome.result is not None and all(outcome.result is not e for e in envs):
            envs.append(outcome.result)
    return DoctorReport(_merge(found), MappingProxyType(attention), tuple(envs))


# --- I/O: gathering ------------------------------------------------------------------

ProbeRunner = Callable[[str, Mapping[str, str], str, Mapping[str, Any] | None], Mapping[str, Any]]
"""(python, worker environment, mode "env" | "flags", payload) -> the probe's JSON.

Raises `ProbeError` when the probe cannot run or prints no JSON."""


def _probe_source() -> str:
    return (Path(__file__).with_name("envprobe.py")).read_text(encoding="utf-8")


def make_probe_runner(
    *,
    base_env: Mapping[str, str] = SYSTEMD_BASE_ENV,
    extra_env: Mapping[str, str] | None = None,
    timeout: float = PROBE_TIMEOUT_S,
) -> ProbeRunner:
    """A `ProbeRunner` that runs `envprobe.py` with the worker's interpreter.

    The environment is `base_env` (what a systemd service sees), then `extra_env`, then
    the worker's own (`[farm] env`, CUDA_VISIBLE_DEVICES, ...).
    """
    source = _probe_source()

    def run(
        python: str, env: Mapping[str, str], mode: str, payload: Mapping[str, Any] | None
    ) -> Mapping[str, Any]:
        full = {**base_env, **(extra_env or {}), **env}
        try:
            proc = subprocess.run(
                [python, "-c", source, mode],
                input=json.dumps(payload or {}),
                capture_output=True,
                text=True,
                env=full,
                cwd="/",
                timeout=timeout,
                check=False,
            )
        except FileNotFoundError as exc:
            raise ProbeError(f"{python} does not exist") from exc
        except PermissionError as exc:
            raise ProbeError(f"{python} is not executable") from exc
        except OSError as exc:
            raise ProbeError(f"cannot run {python}: {exc.strerror or exc}") from exc
        except subprocess.TimeoutExpired as exc:
            raise ProbeError(f"the probe took over {timeout:g} s") from exc
        for line in reversed(proc.stdout.splitlines()):
            if line.startswith("{"):
                try:
                    result: Mapping[str, Any] = json.loads(line)
                except ValueError:
                    break
                return result
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        raise ProbeError(f"the probe exited with status {proc.returncode} and no result: {tail}")

    return run


def port_problem(host: str, port: int) -> str | None:
    """None if `port` can be bound on `host` now, else why not (a bind test)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # As uvicorn and NCCL do: a port in TIME_WAIT from the last run is still usable.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return f"cannot bind: {exc.strerror or exc}"
    return None


def path_facts(path: str) -> PathFacts:
    """What is at a configured model path (sizes from one walk; no file is read)."""
    p = Path(path)
    if not p.exists():
        return PathFacts(exists=False)
    if not p.is_dir():
        return PathFacts(exists=True)
    size = weights = 0
    for root, _dirs, files in os.walk(p):
        for name in files:
            try:
                n = os.stat(os.path.join(root, name)).st_size
            except OSError:
                continue
            size += n
            if name.endswith(_WEIGHT_SUFFIXES):
                weights += n
    real = os.path.realpath(p)
    return PathFacts(True, True, (p / "config.json").is_file(), size, weights,
                     real == "/dev/shm" or real.startswith("/dev/shm/"))


def _group_key(spec: FarmSpec, w: WorkerSpec, cc: tuple[int, int] | None) -> tuple[object, ...]:
    env = tuple(sorted((k, v) for k, v in w.env.items()))
    return (spec.farm.python, env, cc)


def gather(
    spec: FarmSpec,
    gpu_poller: GpuPoller,
    *,
    run_probe: ProbeRunner | None = None,
    port_check: Callable[[str, int], str | None] = port_problem,
    shm_path: str = "/dev/shm",
) -> Observations:
    """All the I/O of the doctor. Probes run once per (interpreter, environment, GPU
    architecture), in parallel; never raises for what it finds (that is the report)."""
    runner = run_probe or make_probe_runner()
    fleet = gpu_poller.snapshot()
    groups: dict[tuple[object, ...], list[WorkerSpec]] = {}
    for w in spec.workers:
        groups.setdefault(_group_key(spec, w, _worker_cc(fleet, w)), []).append(w)

    def call(w: WorkerSpec, mode: str, payload: Mapping[str, Any] | None) -> ProbeOutcome:
        env = build_command(spec.farm, w).env_dict
        try:
            return ProbeOutcome(result=runner(spec.farm.python, env, mode, payload))
        except ProbeError as exc:
            return ProbeOutcome(error=str(exc))

    env_out: dict[int, ProbeOutcome] = {}
    flags_out: dict[int, FlagsOutcome] = {}
    with ThreadPoolExecutor(max_workers=4) as pool:
        jobs = []
        for members in groups.values():
            first = members[0]
            cc = _worker_cc(fleet, first)
            argvs = [list(build_command(spec.farm, m, resolve_flags(m.flags, cc)).argv[3:])
                     for m in members]
            env_job = pool.submit(call, first, "env", None)
            flag_job = (pool.submit(call, first, "flags", {"argvs": argvs})
                        if spec.farm.module == SGLANG_MODULE else None)
            jobs.append((members, env_job, flag_job))
        for members, env_job, flag_job in jobs:
            env_result = env_job.result()
            for m in members:
                env_out[m.id] = env_result
            if flag_job is None:
                continue
            fr = flag_job.result()
            data = fr.result or {}
            results = list(data.get("results") or [])
            for i, m in enumerate(members):
                if fr.result is None or not data.get("parser"):
                    flags_out[m.id] = FlagsOutcome(False, fr.error or str(data.get("error")))
                else:
                    flags_out[m.id] = FlagsOutcome(True, None, results[i] if i < len(results)
                                                   else None)
    ports: dict[tuple[str, int], str | None] = {}
    for w in spec.workers:
        for host, port in ((w.host, w.port), ("0.0.0.0", w.nccl_port)):
            if (host, port) not in ports:
                ports[(host, port)] = port_check(host, port)
    models: dict[str, PathFacts] = {}
    for w in spec.workers:
        mp = w.flags.get("model_path")
        if isinstance(mp, str) and mp not in models:
            models[mp] = path_facts(mp)
    shm_free: int | None = None
    if any(f.in_shm for f in models.values()):
        try:
            shm_free = shutil.disk_usage(shm_path).free
        except OSError:
            shm_free = None
    return Observations(fleet, MappingProxyType(env_out), MappingProxyType(flags_out),
                        MappingProxyType(ports), MappingProxyType(models), shm_free)


def run_doctor(
    spec: FarmSpec,
    gpu_poller: GpuPoller,
    *,
    run_probe: ProbeRunner | None = None,
    port_check: Callable[[str, int], str | None] = port_problem,
) -> DoctorReport:
    """Gather and evaluate: the whole doctor. Blocks (subprocesses); run it in a thread
    from async code. `run_probe` defaults to `make_probe_runner()` (systemd-like env)."""
    return evaluate(spec, gather(spec, gpu_poller, run_probe=run_probe, port_check=port_check))


def preflight_blocking(
    spec: FarmSpec,
    worker_id: int,
    report: DoctorReport,
    *,
    port_check: Callable[[str, int], str | None] = port_problem,
) -> list[Check]:
    """The failures that must stop `worker_id` from starting now, each with its fix.

    Cheap: the report's failures for this worker (farm-wide ones included), except the
    port checks, which are redone live (two bind tests): by now the report's port
    verdict may be stale. Raises KeyError for a worker the spec does not have.
    """
    w = spec.worker(worker_id)
    out = [c for c in report.blocking(worker_id) if c.id not in _LIVE_CHECKS]
    live = Observations(
        fleet=FleetSnapshot(taken_at=0.0, duration_s=0.0, nvml_up=False),
        env={}, flags={}, models={},
        ports={(w.host, w.port): port_check(w.host, w.port),
               ("0.0.0.0", w.nccl_port): port_check("0.0.0.0", w.nccl_port)},
    )
    out += [_with_workers(c, (worker_id,)) for c in _port_checks(live, w)
            if c.status is Status.FAIL]
    return out


def _with_workers(c: Check, workers: tuple[int, ...]) -> Check:
    return Check(c.id, c.status, c.message, c.fix, workers)


# --- presentation -----------------------------------------------------------------------


def _workers_text(workers: tuple[int, ...]) -> str:
    if not workers:
        return "all"
    parts: list[str] = []
    start = prev = workers[0]
    for w in (*workers[1:], None):
        if w is not None and w == prev + 1:
            prev = w
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if w is not None:
            start = prev = w
    return ",".join(parts)


def format_report(report: DoctorReport) -> str:
    """A table for people: status, check, workers, message, and the fix under it."""
    rows = [(c.status.upper(), str(c.id), _workers_text(c.workers), c) for c in report.checks]
    w_check = max([len("CHECK"), *(len(r[1]) for r in rows)])
    w_workers = max([len("WORKERS"), *(len(r[2]) for r in rows)])
    indent = " " * (6 + 2 + w_check + 2 + w_workers + 2)
    lines = [f"{'STATUS':<6}  {'CHECK':<{w_check}}  {'WORKERS':<{w_workers}}  MESSAGE"]
    for status, cid, workers, c in rows:
        lines.append(f"{status:<6}  {cid:<{w_check}}  {workers:<{w_workers}}  {c.message}")
        if c.fix and c.status in (Status.FAIL, Status.WARN):
            lines.append(f"{indent}fix: {c.fix}")
    counts = report.counts()
    picked = sorted(set(report.attention.values()))
    lines.append("")
    lines.append(f"{counts['fail']} failed, {counts['warn']} warnings, {counts['pass']} passed"
                 + (f"; attention backend: {', '.join(picked)}" if picked else ""))
    lines.append("OK: nothing blocks a start." if report.ok else
                 "NOT OK: the failed checks above would stop the workers they name.")
    return "\n".join(lines) + "\n"


# --- the command ------------------------------------------------------------------------


class _NoGpus:
    """A poller for `gpu_source = "none"`: NVML treated as absent."""

    def snapshot(self) -> FleetSnapshot:
        return FleetSnapshot(taken_at=0.0, duration_s=0.0, nvml_up=False,
                             error='[metrics] gpu_source = "none"')

    def close(self) -> None:
        return None


def _poller_for(config_path: str) -> GpuPoller:
    """The GPU source the config names ([metrics] gpu_source), read before full validation
    because `gpus = "all"` needs the GPU count to validate."""
    source = "nvml"
    try:
        with open(config_path, "rb") as f:
            metrics = tomllib.load(f).get("metrics", {})
        if isinstance(metrics, dict) and isinstance(metrics.get("gpu_source"), str):
            source = metrics["gpu_source"]
    except (OSError, tomllib.TOMLDecodeError):
        pass  # load_spec_file reports it properly
    if source == "fake":
        from sglang_farm.gpu_fake import FakeGpuPoller

        return FakeGpuPoller()
    if source == "none":
        return _NoGpus()
    from sglang_farm.gpu import NvmlPoller

    return NvmlPoller()


class _CountingPoller:
    """Takes one snapshot up front (for the GPU count) and hands the same one to the doctor."""

    def __init__(self, snap: FleetSnapshot) -> None:
        self._snap = snap

    def snapshot(self) -> FleetSnapshot:
        return self._snap

    def close(self) -> None:
        return None


@click.command()
@click.option("--config", "config_path", default="/etc/sglang-farm/farm.toml",
              show_default=True, envvar="SGLANG_FARM_CONFIG", help="The farm's TOML config.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def doctor(config_path: str, as_json: bool) -> None:
    """Check the GPUs, the SGLang environment and every worker's command line before a start.

    Runs the workers' interpreter with a small probe (torch and its CUDA build,
    sglang-kernel binaries, deep_gemm and CUDA_HOME, flashinfer), checks the
    attention backend against each GPU's architecture, every rendered command line
    against SGLang's own parser, ports, the model and memory. Exit 0 when nothing
    fails, 1 when a check fails (warnings do not count).
    """
    from sglang_farm.config import load_spec_file

    poller = _poller_for(config_path)
    try:
        snap = poller.snapshot()
    finally:
        poller.close()
    count = len(snap.gpus) if snap.nvml_up else None
    try:
        spec = load_spec_file(config_path, gpu_count=count)
    except ConfigError as exc:
        click.echo(str(exc), err=True)
        sys.exit(1)
    report = run_doctor(spec, _CountingPoller(snap))
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        click.echo(format_report(report), nl=False)
    sys.exit(0 if report.ok else 1)


__all__ = [
    "Check",
    "CheckId",
    "DoctorReport",
    "Observations",
    "ProbeError",
    "ProbeRunner",
    "Status",
    "arch_covers",
    "backend_verdict",
    "doctor",
    "evaluate",
    "format_report",
    "gather",
    "make_probe_runner",
    "preflight_blocking",
    "resolve_attention_backend",
    "resolve_flags",
    "run_doctor",
]
