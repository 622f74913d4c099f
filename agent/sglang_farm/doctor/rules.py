"""Pure: the doctor's rules: what `gather` observed -> a `DoctorReport` of checks.

Every rule is data plus a function: kernel binaries per GPU architecture, attention
backends per compute capability, deep_gemm and CUDA_HOME (docs/reference/sglang.md §14),
the seed host's three launch failures on an SM 12.0 card (docs/reference/seed-host.md §3-§5, §11),
ports, the model and memory. Each verdict is a `Check` with a status and a fix.

Flags are judged by the installed SGLang: its own parser (envprobe's `flags` mode)
decides, and for a flag it rejects whose other spelling `sglang_flags.RENAMES` knows,
the message names the spelling of the installed version ("SGLang 0.5.12 calls it
--mamba-scheduler-strategy").

The farm's `attention_backend = "auto"` pick is `worker_commands.resolve_attention_backend`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any

from sglang_farm.gateway.managed import is_loopback
from sglang_farm.gpu import FleetSnapshot
from sglang_farm.sglang_flags import (
    ATTENTION_BACKEND_KEYS,
    NOT_NVIDIA_BACKENDS,
    SGLANG_MODULE,
    Version,
    flag_key,
    flag_name,
    log_advice,
    mamba_strategy,
    parse_version,
    stale_spelling,
    unknown_flag_hint,
    version_text,
)
from sglang_farm.spec import FarmSpec, ModelSpec, WorkerSpec
from sglang_farm.worker_commands import AUTO, resolve_attention_backend

GIB = 1024**3

# Above this, CUDA graphs, activations and the CUDA context (outside SGLang's static
# pool) have almost nothing left: the seed host ran 0.88 on 48 GB cards (~6 GB spare).
MEM_FRACTION_WARN = 0.95
# Weights above this share of the static budget leave a KV cache too small to be useful.
WEIGHTS_SHARE_WARN = 0.9
# SGLang's processes and NCCL put shared-memory segments in /dev/shm too.
SHM_MIN_FREE_BYTES = 1 * GIB
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
    EXPOSURE = "exposure"
    GATEWAY = "gateway"


# Checks whose verdict goes stale within seconds (another process binds the port; the
# worker's own previous instance held it when the report was made): `preflight_blocking`
# tests them again, live, instead of trusting the report.
_LIVE_CHECKS = frozenset({CheckId.PORT_HTTP, CheckId.PORT_NCCL})
# Checks that never keep a worker from starting: the gateway is the farm's front door,
# the workers serve (and can be reached directly) without it.
_NOT_WORKER_CHECKS = frozenset({CheckId.GATEWAY})


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


# --- pure rules ------------------------------------------------------------------------


def _sm(cc: tuple[int, int]) -> str:
    return f"SM {cc[0]}.{cc[1]}"


_FIX_BACKEND = (
    'set attention_backend = "flashinfer" (works on every GPU) or "auto" (the farm picks '
    "per architecture) in [sglang]"
)


def backend_verdict(backend: str, cc: tuple[int, int]) -> tuple[Status, str]:
    """Whether SGLang 0.5.23 runs attention backend `backend` on `cc` (sglang.md §14.2).

    Returns a status and the reason (for a pass, a short note).
    """
    major = cc[0]
    sm = _sm(cc)
    if backend in NOT_NVIDIA_BACKENDS:
        return Status.FAIL, (
            f"{backend} is a backend for {NOT_NVIDIA_BACKENDS[backend]}, not NVIDIA GPUs"
        )
    if backend == "fa3":
        if major == 9:
            return Status.PASS, f"FlashAttention 3 runs on {sm}"
        if major == 8:
            return Status.WARN, (
                f"FlashAttention 3 runs on {sm} for non-MLA models only "
                "(SGLang asserts major == 9 for MLA models)"
            )
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
        return Status.FAIL, (
            f"TRT-LLM MHA is only supported on Hopper (SM90), Blackwell (SM100) and SM120, not {sm}"
        )
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
        return Status.FAIL, (
            f"FlashMLA ships kernels for sm_90a, sm_100f and sm_103a only, not {sm}"
        )
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
        if (
            kind == "sm"
            and amaj == major
            and (
                (suffix == "" and amin <= minor)
                or (suffix == "a" and amin == minor)
                or (suffix == "f" and amin <= minor)
            )
        ):
            return True
    return False


def _gb(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def worker_cc(fleet: FleetSnapshot, worker: WorkerSpec) -> tuple[int, int] | None:
    """The lowest compute capability among the worker's GPUs; None when NVML has none."""
    ccs = {
        cc
        for i in worker.gpus
        if (g := fleet.gpu(i)) is not None and (cc := g.compute_capability) is not None
    }
    return min(ccs) if ccs else None


def _worker_memory(fleet: FleetSnapshot, worker: WorkerSpec) -> int | None:
    totals = [
        g.memory_total_bytes
        for i in worker.gpus
        if (g := fleet.gpu(i)) is not None and g.memory_total_bytes
    ]
    return min(totals) if totals else None


def _gpu_checks(fleet: FleetSnapshot, w: WorkerSpec) -> list[Check]:
    out: list[Check] = []
    if not fleet.nvml_up:
        return out  # one farm-wide NVML row says it
    for i in w.gpus:
        g = fleet.gpu(i)
        if g is None:
            out.append(
                Check(
                    CheckId.GPU,
                    Status.FAIL,
                    f"GPU {i} is not on this host (NVML sees {len(fleet.gpus)} GPU(s))",
                    "fix workers.gpus in the config (NVML indices, as in nvidia-smi)",
                )
            )
        elif not g.healthy:
            out.append(
                Check(
                    CheckId.GPU,
                    Status.FAIL,
                    f"GPU {i} does not answer: {g.error}",
                    "check `nvidia-smi` and the kernel log (XID errors); the GPU may "
                    "need a reset or the host a reboot",
                )
            )
        elif g.compute_capability is None:
            out.append(
                Check(
                    CheckId.GPU,
                    Status.WARN,
                    f"GPU {i}: NVML does not report its compute capability; the "
                    "architecture checks are skipped",
                    "check the NVIDIA driver",
                )
            )
        elif g.compute_capability < (8, 0):
            out.append(
                Check(
                    CheckId.GPU,
                    Status.FAIL,
                    f"GPU {i} is {_sm(g.compute_capability)}: SGLang's kernels "
                    "(sglang-kernel) are built for SM 8.0 and newer",
                    "use GPUs of SM 8.0 (Ampere) or newer",
                )
            )
        else:
            mem = f", {_gb(g.memory_total_bytes)}" if g.memory_total_bytes else ""
            out.append(
                Check(
                    CheckId.GPU,
                    Status.PASS,
                    f"{g.name or 'GPU'}: {_sm(g.compute_capability)}{mem}"
                    + (" (simulated)" if fleet.simulated else ""),
                )
            )
    for i in w.gpus:
        g = fleet.gpu(i)
        if g is None or not g.healthy:
            continue
        if g.remapped_rows_pending:
            out.append(
                Check(
                    CheckId.GPU,
                    Status.FAIL,
                    f"GPU {i} has row remaps pending: the farm would quarantine it "
                    "at its worker's start",
                    f"reset it once no process holds it (sudo nvidia-smi -r -i {i}), "
                    "or reboot (docs/gpu-health.md)",
                )
            )
        if g.persistence_mode is False and not fleet.simulated:
            out.append(
                Check(
                    CheckId.GPU,
                    Status.WARN,
                    f"GPU {i}: persistence mode is off (each NVML open re-initialises "
                    "the driver, tens of ms, and its state is torn down between "
                    "processes)",
                    "sudo nvidia-smi -pm 1, or enable nvidia-persistenced",
                )
            )
    ccs = {g.compute_capability for i in w.gpus if (g := fleet.gpu(i)) is not None}
    if len(ccs) > 1:
        out.append(
            Check(
                CheckId.GPU,
                Status.WARN,
                f"the worker's GPUs {list(w.gpus)} differ in architecture",
                "give a tensor-parallel worker GPUs of one model",
            )
        )
    return out


_EXAMPLE_PYTHON = "/opt/sglang/bin/python3"
# For an interpreter that is not there: what to do, never the path just found missing.
_FIX_MISSING_PYTHON = (
    "install SGLang in a virtual environment (`python3 -m venv DIR && DIR/bin/pip install "
    "sglang`) and set [farm] python to DIR/bin/python3, or to the interpreter of an "
    "existing SGLang environment (the one where `import sglang` works)"
)


def _fix_python(python: str) -> str:
    """Point [farm] python elsewhere; the example only when it is not the configured path."""
    example = f" (e.g. {_EXAMPLE_PYTHON})" if python != _EXAMPLE_PYTHON else ""
    return f"set [farm] python to the interpreter of the SGLang environment{example}"


def _env_checks(
    spec: FarmSpec, w: WorkerSpec, cc: tuple[int, int] | None, probe: ProbeOutcome
) -> list[Check]:
    python = spec.farm.python
    if probe.result is None and probe.missing:
        return [
            Check(
                CheckId.ENVIRONMENT,
                Status.FAIL,
                f"the workers' interpreter {python} ([farm] python) does not exist",
                _FIX_MISSING_PYTHON,
            )
        ]
    if probe.result is None:
        error = (probe.error or "no result").replace(python, "it")
        return [
            Check(
                CheckId.ENVIRONMENT,
                Status.FAIL,
                f"cannot probe the SGLang environment {python}: {error}",
                _fix_python(python),
            )
        ]
    r = probe.result
    out = [
        Check(
            CheckId.ENVIRONMENT,
            Status.PASS,
            f"{python}: Python {r.get('python', {}).get('version', '?')}",
        )
    ]
    # Another module (the demo's simulator) needs none of SGLang's stack.
    if spec.farm.module == SGLANG_MODULE:
        out += _torch_checks(r.get("torch") or {}, cc, len(w.gpus))
        sg = r.get("sglang") or {}
        if sg.get("installed"):
            out.append(
                Check(
                    CheckId.SGLANG,
                    Status.PASS,
                    f"sglang {sg.get('version') or '(version unknown)'} installed",
                )
            )
        else:
            out.append(
                Check(
                    CheckId.SGLANG,
                    Status.FAIL,
                    f"sglang is not installed in {python}",
                    f"`{python} -m pip install sglang`, or " + _fix_python(python),
                )
            )
        out.append(_kernel_check(r.get("sgl_kernel") or {}, cc, python))
        out.append(_deep_gemm_check(r, cc))
    return out


def _torch_checks(t: Mapping[str, Any], cc: tuple[int, int] | None, n_gpus: int) -> list[Check]:
    if not t.get("installed"):
        return [
            Check(
                CheckId.TORCH,
                Status.FAIL,
                f"torch does not import: {t.get('error', 'not installed')}",
                "install the torch build SGLang pins (sglang 0.5.23: torch==2.14.1) "
                "in the SGLang environment",
            )
        ]
    version, cuda = t.get("version") or "?", t.get("cuda")
    arch = list(t.get("arch_list") or [])
    out: list[Check] = []
    if not cuda:
        return [
            Check(
                CheckId.TORCH,
                Status.FAIL,
                f"torch {version} is a CPU-only build (torch.version.cuda is None)",
                "install a CUDA build of torch (e.g. the cu128/cu130 wheels)",
            )
        ]
    head = f"torch {version} (CUDA {cuda})"
    if cc is not None and arch and not arch_covers(arch, cc):
        out.append(
            Check(
                CheckId.TORCH,
                Status.FAIL,
                f"{head} has no kernels for {_sm(cc)} (sm_{cc[0]}{cc[1]}): its arch list is "
                f"{' '.join(arch)}; CUDA would fail with 'no kernel image is available'",
                f"install a torch build whose arch list has sm_{cc[0]}{cc[1]} (SM 12.x needs "
                "CUDA >= 12.8 wheels, e.g. cu128 or cu130), the version sglang pins",
            )
        )
    elif t.get("cuda_available") is False:
        why = t.get("cuda_available_error") or "torch.cuda.is_available() is False"
        out.append(
            Check(
                CheckId.TORCH,
                Status.FAIL,
                f"{head} cannot use CUDA in the workers' environment: {why}",
                "check the driver (`nvidia-smi`), that the driver supports CUDA "
                f"{cuda}, and the workers' CUDA_VISIBLE_DEVICES",
            )
        )
    else:
        covers = f", covers {_sm(cc)}" if cc is not None and arch else ""
        out.append(Check(CheckId.TORCH, Status.PASS, f"{head}{covers}"))
    cuda_v = parse_version(cuda)
    if n_gpus > 1 and cc is not None and cc[0] == 12 and cuda_v is not None and cuda_v < (12, 9):
        out.append(
            Check(
                CheckId.NCCL,
                Status.WARN,
                f"NCCL has a known issue on SM 12.x before CUDA 12.9 (torch is built "
                f"with CUDA {cuda}) and this worker spans {n_gpus} GPUs",
                "use a torch build with CUDA >= 12.9, or one GPU per worker",
            )
        )
    return out


def _first_lines(text: str, limit: int = 3) -> str:
    """The first line of an error, plus its underlying errors (sgl_kernel lists them
    after "Error details"), joined on one line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    details = [i for i, ln in enumerate(lines) if ln.startswith("Error details")]
    rest = lines[details[0] + 1 :] if details else []
    return " | ".join(lines[:1] + rest[: limit - 1])


def _variant_order(name: str) -> tuple[int, str]:
    digits = re.sub(r"\D", "", name)
    return (int(digits) if digits else 0, name)


def _kernel_check(k: Mapping[str, Any], cc: tuple[int, int] | None, python: str) -> Check:
    if not k.get("installed"):
        return Check(
            CheckId.SGL_KERNEL,
            Status.FAIL,
            "sgl_kernel (PyPI: sglang-kernel) is not installed",
            f"`{python} -m pip install sglang-kernel` (the version sglang pins)",
        )
    name = f"sglang-kernel {k.get('version') or '(version unknown)'}"
    variants = sorted(k.get("variants") or [], key=_variant_order)
    ships = ", ".join(f"{v}/" for v in variants) or "no sm*/ binaries"
    expected = None if cc is None else ("sm90" if cc == (9, 0) else "sm100")
    loads = f"; {_sm(cc)} loads {expected}/" if cc is not None else ""
    imp = k.get("import") or {}
    fix = (
        f"install an sglang-kernel built for {_sm(cc) if cc else 'this GPU'} and this torch "
        f"(sglang-kernel 0.4.10 ships sm_80 to sm_120a in sm90/ and sm100/): "
        f"`{python} -m pip install --upgrade sglang-kernel` (the version sglang pins)"
    )
    if imp.get("ok"):
        return Check(CheckId.SGL_KERNEL, Status.PASS, f"{name} imports (ships {ships}{loads})")
    if imp:
        text = imp.get("message") or ""
        why = _first_lines(text) or f"{imp.get('type')}"
        abi = (
            (
                "; 'undefined symbol' means a torch ABI mismatch: sglang-kernel was built "
                "for another torch"
            )
            if "undefined symbol" in text
            else ""
        )
        return Check(
            CheckId.SGL_KERNEL,
            Status.FAIL,
            f"import sgl_kernel fails{' on ' + _sm(cc) if cc else ''}: {why} "
            f"({name} ships {ships}{loads}){abi}",
            fix,
        )
    if expected is not None and expected not in variants and not k.get("top_level_common_ops"):
        return Check(
            CheckId.SGL_KERNEL,
            Status.FAIL,
            f"{name} ships {ships} but {_sm(cc) if cc else 'this GPU'} loads {expected}/",
            fix,
        )
    return Check(
        CheckId.SGL_KERNEL,
        Status.WARN,
        f"{name} ships {ships}{loads}; its import was not tested",
        "",
    )


def _deep_gemm_disabled(env: Mapping[str, Any]) -> str | None:
    for var in ("SGLANG_ENABLE_JIT_DEEPGEMM", "SGL_ENABLE_JIT_DEEPGEMM"):
        value = env.get(var)
        if isinstance(value, str) and value.strip().lower() in _FALSE_WORDS:
            return f"{var}={value}"
    return None


_FIX_CUDA_HOME = (
    "set CUDA_HOME=/usr/local/cuda-12.x (a CUDA toolkit with bin/nvcc) or "
    "SGLANG_ENABLE_JIT_DEEPGEMM=0 in [farm].env, e.g. env = { CUDA_HOME = "
    '"/usr/local/cuda-12.9" }'
)


def _deep_gemm_check(r: Mapping[str, Any], cc: tuple[int, int] | None) -> Check:
    d = r.get("deep_gemm") or {}
    home = r.get("cuda_home") or {}
    disabled = _deep_gemm_disabled(r.get("env") or {})
    where = (
        f"CUDA toolkit: {home['path']} (from {home.get('source')})"
        if home.get("path")
        else "no CUDA toolkit: CUDA_HOME and CUDA_PATH unset, no nvcc on PATH, no /usr/local/cuda"
    )
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
            return Check(
                CheckId.DEEP_GEMM,
                Status.FAIL,
                f"import deep_gemm fails with {text}: SGLang imports it on SM >= 9.0 "
                f"unless SGLANG_ENABLE_JIT_DEEPGEMM=0, and the scheduler dies ({where})",
                _FIX_CUDA_HOME,
            )
        return Check(
            CheckId.DEEP_GEMM,
            Status.WARN,
            f"import deep_gemm fails with {text}; SGLang catches this and runs without DeepGEMM",
            "reinstall sgl-deep-gemm, or set "
            "SGLANG_ENABLE_JIT_DEEPGEMM=0 in [farm].env to silence it",
        )
    if not home.get("path"):
        return Check(
            CheckId.DEEP_GEMM,
            Status.FAIL,
            f"deep_gemm is installed and there is {where}: its import asserts "
            "`cuda_home is not None`",
            _FIX_CUDA_HOME,
        )
    return Check(
        CheckId.DEEP_GEMM,
        Status.WARN,
        f"deep_gemm is installed; its import was not tested ({where})",
        "",
    )


def _attention_checks(
    w: WorkerSpec, cc: tuple[int, int] | None, facts: Mapping[str, Any] | None
) -> tuple[list[Check], str | None]:
    out: list[Check] = []
    keys = [k for k in ATTENTION_BACKEND_KEYS if k in w.flags]
    picked: str | None = None
    if cc is None:
        if keys:
            out.append(
                Check(
                    CheckId.ATTENTION_BACKEND,
                    Status.WARN,
                    "GPU architecture unknown: the attention backend is not checked",
                )
            )
        return out, None
    if not keys:
        picked = resolve_attention_backend(cc)
        status, why = backend_verdict(picked, cc)
        out.append(
            Check(
                CheckId.ATTENTION_BACKEND,
                status,
                f"not set: SGLang picks its default for {_sm(cc)}, {picked} for MHA models ({why})",
                "" if status is Status.PASS else _FIX_BACKEND,
            )
        )
    for key in keys:
        raw = w.flags[key]
        backend = resolve_attention_backend(cc) if raw == AUTO else str(raw)
        if key == "attention_backend":
            picked = backend
        status, why = backend_verdict(backend, cc)
        label = (
            f"{key} = auto: the farm picked {backend} for {_sm(cc)}"
            if raw == AUTO
            else (f"{key} = {backend}")
        )
        out.append(
            Check(
                CheckId.ATTENTION_BACKEND,
                status,
                f"{label}: {why}",
                "" if status is Status.PASS else _FIX_BACKEND,
            )
        )
    uses_flashinfer = picked == "flashinfer" or any(
        w.flags.get(k) == "flashinfer" for k in (*keys, "mamba_backend")
    )
    if facts is not None and uses_flashinfer:
        fi = facts.get("flashinfer") or {}
        if fi.get("installed"):
            out.append(
                Check(
                    CheckId.FLASHINFER,
                    Status.PASS,
                    f"flashinfer {fi.get('version') or ''} installed".replace("  ", " "),
                )
            )
        else:
            out.append(
                Check(
                    CheckId.FLASHINFER,
                    Status.FAIL,
                    "the attention backend is flashinfer and flashinfer is not installed",
                    "install flashinfer-python (the version sglang pins) in the SGLang environment",
                )
            )
    mamba = mamba_strategy(w.flags)
    if mamba is not None and mamba[1] == "no_buffer" and picked == "trtllm_mha":
        out.append(
            Check(
                CheckId.ATTENTION_BACKEND,
                Status.FAIL,
                f"{mamba[0]} = no_buffer with trtllm_mha: SGLang asserts "
                "a backend other than trtllm_mha for no_buffer",
                _FIX_BACKEND,
            )
        )
    return out, picked


_FIX_PARSER = (
    "make `sglang.srt.server_args` importable in the SGLang environment "
    "(it needs torch) so the doctor can use SGLang's own parser"
)


def installed_sglang(probe: ProbeOutcome | None) -> Version | None:
    """The SGLang version the environment probe found (its package metadata), if any."""
    if probe is None or probe.result is None:
        return None
    sg = probe.result.get("sglang") or {}
    return parse_version(sg.get("version")) if sg.get("installed") else None


def _spelling_check(key: str, installed: Version | None, why: str) -> Check | None:
    """A FAIL naming the installed SGLang's spelling of `key`, when the table knows one."""
    if installed is not None:
        hint = unknown_flag_hint(key, installed)
        if hint is None:
            return None
        says, fix = hint
        return Check(
            CheckId.FLAGS,
            Status.FAIL,
            f"{flag_name(key)} is not a flag of SGLang {version_text(installed)} ({why}): {says}",
            fix,
        )
    advice = log_advice(key)
    if advice is None:
        return None
    return Check(
        CheckId.FLAGS,
        Status.FAIL,
        f"{flag_name(key)} is not a flag of the installed SGLang ({why})",
        advice,
    )


def _flag_checks(
    spec: FarmSpec, w: WorkerSpec, outcome: FlagsOutcome | None, installed: Version | None
) -> list[Check]:
    """The worker's flags as the installed SGLang judges them.

    Its parser decides; without one, the rename table judges by the installed version
    (when the probe found one) and otherwise only warns about an older spelling.
    """
    if spec.farm.module != SGLANG_MODULE:
        return [
            Check(
                CheckId.FLAGS,
                Status.SKIP,
                f"module {spec.farm.module} is not {SGLANG_MODULE}: flags not validated",
            )
        ]
    ladder = _ladder_flag_checks(spec, installed)
    out: list[Check] = []
    if outcome is None or not outcome.parser or outcome.result is None:
        why = (outcome.error if outcome else None) or "no result"
        out.append(
            Check(
                CheckId.FLAGS,
                Status.WARN,
                f"cannot validate flags: sglang not importable ({why})",
                _FIX_PARSER,
            )
        )
        for key in w.flags:
            if installed is not None:
                found = _spelling_check(key, installed, "by the farm's table of renamed flags")
                if found is not None:
                    out.append(found)
            elif (stale := stale_spelling(key)) is not None:
                out.append(
                    Check(
                        CheckId.FLAGS,
                        Status.WARN,
                        f"{key}: {stale}",
                        "check which spelling the installed SGLang uses",
                    )
                )
        return ladder + out
    res = outcome.result
    hard = False
    for tok in res.get("tokens") or ():
        flag, match = str(tok.get("flag")), tok.get("match")
        snake = flag_key(flag)
        if match in ("unknown", "ambiguous"):
            hard = True
            why = (
                "argparse: unrecognized arguments, exit 2"
                if match == "unknown"
                else f"argparse: ambiguous, could match {', '.join(tok.get('candidates') or ())}, "
                "exit 2"
            )
            found = _spelling_check(snake, installed, why)
            if found is not None:
                out.append(found)
            elif match == "unknown":
                out.append(
                    Check(
                        CheckId.FLAGS,
                        Status.FAIL,
                        f"{flag} is not a flag of the installed SGLang (argparse: "
                        "unrecognized arguments, exit 2)",
                        f"remove or correct {snake} in [sglang]; `{spec.farm.python} -m "
                        f"{SGLANG_MODULE} --help` lists the flags",
                    )
                )
            else:
                cands = ", ".join(tok.get("candidates") or ())
                out.append(
                    Check(
                        CheckId.FLAGS,
                        Status.FAIL,
                        f"{flag} is ambiguous: it could match {cands} (argparse exit 2)",
                        f"write the full name of one of them instead of {snake}",
                    )
                )
        elif match == "prefix":
            full = str(tok.get("expands_to"))
            out.append(
                Check(
                    CheckId.FLAGS,
                    Status.WARN,
                    f"{flag} is not a full flag name: SGLang's argparse accepts it as "
                    f"an abbreviation of {full}",
                    f"write {flag_key(full)} in [sglang] (an "
                    "abbreviation can bind to another flag after an upgrade)",
                )
            )
    error = res.get("error")
    if res.get("exit_status") and not hard:
        out.append(
            Check(
                CheckId.FLAGS,
                Status.FAIL,
                f"SGLang's parser rejects the command line: {error}",
                "correct the value in [sglang]",
            )
        )
    if not out:
        n = len(res.get("tokens") or ())
        out.append(Check(CheckId.FLAGS, Status.PASS, f"{n} flags accepted by SGLang's parser"))
    return ladder + out


def _ladder_flag_checks(spec: FarmSpec, installed: Version | None) -> list[Check]:
    """OOM-ladder steps that would set a flag the installed SGLang spells otherwise.

    A warning, not a failure: the step only runs after an out-of-memory failure, and
    then the worker fails with argparse's exit 2 instead of stepping down.
    """
    if installed is None:
        return []
    out: list[Check] = []
    for step in spec.oom.steps:
        for a in step.adjust:
            hint = unknown_flag_hint(a.flag, installed, "in that [[oom.steps]] table")
            if hint is not None:
                says, fix = hint
                out.append(
                    Check(
                        CheckId.FLAGS,
                        Status.WARN,
                        f"OOM step {step.name!r} changes {flag_name(a.flag)}, which "
                        f"SGLang {version_text(installed)} does not have: {says}",
                        fix,
                    )
                )
    return out


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
            out.append(
                Check(
                    cid,
                    Status.FAIL,
                    f"{what} port {port} on {host}: {busy}",
                    f"stop what listens there (`ss -ltnp 'sport = :{port}'`; if the "
                    f"farm is running, its own worker holds it) or change "
                    f"workers.{key}",
                )
            )
    return out


def _model_checks(
    obs: Observations, w: WorkerSpec, mem_total: int | None, model: ModelSpec | None = None
) -> list[Check]:
    raw = w.flags.get("model_path")
    if not isinstance(raw, str):
        return []
    facts = obs.models.get(raw)
    out: list[Check] = []
    if facts is None:
        return out
    if not facts.exists and model is not None and raw.startswith("/"):
        # [model]: the agent stages it here before any worker starts (docs/staging.md).
        out.append(
            Check(
                CheckId.MODEL_PATH,
                Status.PASS,
                f"{raw} is not there yet: the agent stages it from {model.source} "
                "before any worker starts ([model])",
            )
        )
        return out
    if not facts.exists:
        if _HF_REPO_RE.match(raw) and not raw.startswith((".", "/")):
            out.append(
                Check(
                    CheckId.MODEL_PATH,
                    Status.WARN,
                    f"{raw} is not a local directory: SGLang will download it from "
                    "Hugging Face at the first start (minutes, on every worker at once)",
                    "download it once (`huggingface-cli download`) and set model_path "
                    "to the local directory",
                )
            )
        else:
            tmpfs = (
                " (/dev/shm is a tmpfs, emptied at every boot: copy the model there again)"
                if raw.startswith("/dev/shm")
                else ""
            )
            fix = (
                "add a [model] section (source = the model's persistent directory or Hugging "
                "Face repo id): the agent then stages it here at every start, before any "
                "worker (docs/staging.md)"
                if raw.startswith("/dev/shm")
                else "copy the model there or set model_path in [sglang]"
            )
            out.append(Check(CheckId.MODEL_PATH, Status.FAIL, f"{raw} does not exist{tmpfs}", fix))
        return out
    if not facts.is_dir or not facts.has_config:
        out.append(
            Check(
                CheckId.MODEL_PATH,
                Status.FAIL,
                f"{raw} has no config.json: not a Hugging Face model directory",
                "point model_path at the directory that holds config.json and the weights",
            )
        )
        return out
    size = f" ({_gb(facts.weights_bytes)} of weights)" if facts.weights_bytes else ""
    out.append(Check(CheckId.MODEL_PATH, Status.PASS, f"{raw} has config.json{size}"))
    if facts.in_shm and model is None:
        out.append(
            Check(
                CheckId.SHM,
                Status.WARN,
                f"{raw} is on /dev/shm, a tmpfs emptied at every boot, and nothing "
                "puts it back: after a reboot every worker fails its load",
                "add a [model] section (source = the model's persistent directory or "
                "Hugging Face repo id): the agent stages it into model_path at every "
                "start, before any worker (docs/staging.md)",
            )
        )
    if facts.in_shm and obs.shm_free_bytes is not None:
        used = _gb(facts.size_bytes or 0)
        if obs.shm_free_bytes < SHM_MIN_FREE_BYTES:
            out.append(
                Check(
                    CheckId.SHM,
                    Status.WARN,
                    f"the model takes {used} of /dev/shm (RAM-backed) and only "
                    f"{_gb(obs.shm_free_bytes)} is left; SGLang and NCCL need "
                    "/dev/shm for shared-memory segments",
                    "free /dev/shm or enlarge it (mount -o remount,size=...)",
                )
            )
        else:
            out.append(
                Check(
                    CheckId.SHM,
                    Status.PASS,
                    f"the model takes {used} of /dev/shm; {_gb(obs.shm_free_bytes)} free",
                )
            )
    frac = w.flags.get("mem_fraction_static")
    if isinstance(frac, int | float) and not isinstance(frac, bool) and mem_total:
        budget = frac * mem_total
        per_gpu = (facts.weights_bytes or 0) / max(1, len(w.gpus))
        tp = f" per GPU (tp {len(w.gpus)})" if len(w.gpus) > 1 else ""
        if per_gpu and per_gpu > budget:
            out.append(
                Check(
                    CheckId.MEMORY,
                    Status.FAIL,
                    f"the weights alone ({_gb(per_gpu)}{tp}) exceed "
                    f"mem_fraction_static {frac} x {_gb(mem_total)} = {_gb(budget)}: "
                    "SGLang stops with 'Loaded weights leave no GPU memory for the KV "
                    "cache'",
                    "raise mem_fraction_static, use more GPUs per worker "
                    "(gpus_per_worker), or a smaller/quantized model",
                )
            )
        elif per_gpu and per_gpu > WEIGHTS_SHARE_WARN * budget:
            out.append(
                Check(
                    CheckId.MEMORY,
                    Status.WARN,
                    f"the weights ({_gb(per_gpu)}{tp}) fill over "
                    f"{WEIGHTS_SHARE_WARN:.0%} of mem_fraction_static {frac} x "
                    f"{_gb(mem_total)}: little room for the KV cache",
                    "raise mem_fraction_static a little or use more GPUs per worker",
                )
            )
    return out


def _memory_fraction_check(w: WorkerSpec, mem_total: int | None) -> list[Check]:
    frac = w.flags.get("mem_fraction_static")
    if not isinstance(frac, int | float) or isinstance(frac, bool):
        return []
    if frac > MEM_FRACTION_WARN:
        spare = f" ({_gb((1 - frac) * mem_total)} of {_gb(mem_total)})" if mem_total else ""
        return [
            Check(
                CheckId.MEMORY,
                Status.WARN,
                f"mem_fraction_static {frac} leaves {1 - frac:.0%} of the card{spare} "
                "for CUDA graphs, activations and the CUDA context: expect CUDA OOM",
                "use 0.80-0.92 (the seed ran 0.88 on 48 GB cards)",
            )
        ]
    share = f": {_gb(frac * mem_total)} of {_gb(mem_total)}" if mem_total else ""
    return [Check(CheckId.MEMORY, Status.PASS, f"mem_fraction_static {frac}{share}")]


_FIX_EXPOSURE = (
    'bind the workers to loopback (host = "127.0.0.1" in [workers]) and serve through the '
    'gateway ([gateway] mode = "managed"), or set api_key and keep the key out of '
    'world-readable files (docs/config.md, "Exposure and keys")'
)


def _exposure_check(w: WorkerSpec) -> Check:
    """Whether anyone on the network can use the worker (docs/reference/sglang.md §6.2:
    without --api-key SGLang serves every route, admin ones included, to any caller)."""
    if is_loopback(w.host):
        return Check(CheckId.EXPOSURE, Status.PASS, f"listens on loopback ({w.host})")
    if w.flags.get("api_key"):
        return Check(
            CheckId.EXPOSURE,
            Status.PASS,
            f"listens on {w.host!r}; api_key is set (routes need the key)",
        )
    return Check(
        CheckId.EXPOSURE,
        Status.WARN,
        f"workers listen on {w.host!r} (not loopback) without api_key: anyone who "
        "can reach this host can use them, admin routes included",
        _FIX_EXPOSURE,
    )


# Words in an environment variable's name that mark its value as a credential
# (HF_TOKEN, WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, a PASSWORD...).
_SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH")


def is_secret_name(name: str) -> bool:
    """Whether an environment variable's name says its value is a credential."""
    upper = name.upper()
    return any(word in upper for word in _SECRET_WORDS)


def config_secrets_check(spec: FarmSpec, mode: int | None) -> Check | None:
    """A warning when the config holds a secret (an `api_key`, or an `env` value whose
    name says it is a credential: `HF_TOKEN`, not `SGLANG_SIM_FAIL_AFTER`) and the file
    is readable by every local user (`mode & 0o004`); None otherwise. The units never
    show any configured value (every one goes to a root-only file: docs/security.md),
    but the file itself would."""
    if mode is None or not mode & 0o004:
        return None
    what = []
    if any(w.flags.get("api_key") for w in spec.workers):
        what.append("api_key")
    names = sorted(
        {
            n
            for env in (spec.farm.env, *(w.env for w in spec.workers))
            for n in env
            if is_secret_name(n)
        }
    )
    if names:
        what.append(f"environment values that look like credentials ({', '.join(names)})")
    if not what:
        return None
    return Check(
        CheckId.EXPOSURE,
        Status.WARN,
        f"{spec.source} holds {' and '.join(what)} and is readable by every local user "
        f"(mode {mode & 0o7777:04o})",
        f"chmod 0640 {spec.source} (root:sglang-farm) or chmod 0600 {spec.source}",
    )


@dataclass(frozen=True, slots=True)
class KeyFileFacts:
    """A key file's owner and permission bits (`st_mode & 0o7777`), or why `stat` failed."""

    uid: int | None = None
    mode: int | None = None
    error: str | None = None


def key_files(spec: FarmSpec) -> tuple[tuple[str, str], ...]:
    """The files the config names that hold a secret: (its key in the config, path)."""
    named = [
        ("[gateway] admin_key_file", spec.gateway.admin_key_file),
        ("[gateway] api_key_file", spec.gateway.api_key_file),
        ("[model] token_file", spec.model.token_file if spec.model is not None else None),
    ]
    return tuple((key, path) for key, path in named if path)


def key_file_checks(
    spec: FarmSpec, facts: Mapping[str, KeyFileFacts], agent_uid: int
) -> list[Check]:
    """A warning for each key file (`key_files`) that another user could read or replace:
    any group or other permission bit, or an owner other than the agent's user
    (`agent_uid`). The Hub token file is refused at stage time for the same reasons
    (`staging.hub.read_token`); the gateway's keys are read by whoever starts smg, so the
    config check and the doctor say it before a key leaks (issue 22, item 12)."""
    out = []
    for key, path in key_files(spec):
        f = facts.get(path)
        fix = f"chown root: {path} && chmod 0600 {path}"
        if f is None:
            continue  # not looked at
        if f.error is not None:
            out.append(
                Check(
                    CheckId.EXPOSURE,
                    Status.WARN,
                    f"{key} {path}: cannot read it: {f.error}",
                    f"write the key alone into {path}; {fix}",
                )
            )
            continue
        if f.mode is not None and f.mode & 0o077:
            out.append(
                Check(
                    CheckId.EXPOSURE,
                    Status.WARN,
                    f"{key} {path} is open to other users (mode {f.mode:04o}): "
                    "only its owner may read a key",
                    fix,
                )
            )
        if f.uid is not None and f.uid != agent_uid:
            out.append(
                Check(
                    CheckId.EXPOSURE,
                    Status.WARN,
                    f"{key} {path} is owned by uid {f.uid}, not by the agent's user "
                    f"(uid {agent_uid}): its owner can change the key",
                    fix,
                )
            )
    return out


# The `gateway` extra's pin (pyproject.toml): the farm is tested against this smg.
SMG_REQUIREMENT = "smg==1.13.0"


def gateway_check(spec: FarmSpec, facts: GatewayFacts | None) -> Check | None:
    """A managed gateway needs smg in the interpreter that runs it (the agent's own):
    without it the gateway never starts and the farm has no front door. None when the
    gateway is not managed here (or was not looked at)."""
    if facts is None or not spec.gateway.enabled or spec.gateway.mode != "managed":
        return None
    if facts.error is None:
        return Check(
            CheckId.GATEWAY,
            Status.PASS,
            f"the managed gateway runs: {facts.version or 'smg'} ({facts.python})",
        )
    return Check(
        CheckId.GATEWAY,
        Status.FAIL,
        f'[gateway] mode = "managed" but smg does not run under {facts.python}: '
        f"{facts.error}; the farm has no front door until it does",
        f"install it into that Python: `{facts.python} -m pip install '{SMG_REQUIREMENT}'` "
        "(the `gateway` extra: `pip install 'sglang-farm[gateway]'`); from the Debian "
        "package: `apt install --reinstall sglang-farm`, which ships it",
    )


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
        found.append(
            (
                None,
                Check(
                    CheckId.NVML,
                    Status.WARN,
                    f"NVML is not available ({fleet.error or 'no reason given'}): GPUs and their "
                    "compute capability are unknown, so the architecture checks are skipped",
                    "check the NVIDIA driver (`nvidia-smi`); in containers pass the GPUs through",
                ),
            )
        )
    elif fleet.simulated:
        found.append(
            (
                None,
                Check(
                    CheckId.NVML,
                    Status.WARN,
                    'the GPUs are simulated ([metrics] gpu_source = "fake")',
                    'use gpu_source = "nvml" on a real GPU host',
                ),
            )
        )
    attention: dict[int, str] = {}
    for w in spec.workers:
        cc = worker_cc(fleet, w)
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
        found += [
            (w.id, c) for c in _flag_checks(spec, w, obs.flags.get(w.id), installed_sglang(probe))
        ]
        found += [(w.id, c) for c in _port_checks(obs, w)]
        found.append((w.id, _exposure_check(w)))
        if spec.farm.module == SGLANG_MODULE:
            found += [(w.id, c) for c in _model_checks(obs, w, mem_total, spec.model)]
            found += [(w.id, c) for c in _memory_fraction_check(w, mem_total)]
    secrets = config_secrets_check(spec, obs.config_mode)
    if secrets is not None:
        found.append((None, secrets))
    if obs.agent_uid is not None:
        found += [(None, c) for c in key_file_checks(spec, obs.key_files, obs.agent_uid)]
    found += [
        (
            None,
            Check(
                CheckId.EXPOSURE,
                Status.WARN,
                problem,
                "the agent refuses to start until then: fix the folder as said",
            ),
        )
        for problem in obs.folder_problems
    ]
    gateway = gateway_check(spec, obs.gateway)
    if gateway is not None:
        found.append((None, gateway))
    envs: list[Mapping[str, Any]] = []
    for outcome in obs.env.values():
        if outcome.result is not None and all(outcome.result is not e for e in envs):
            envs.append(outcome.result)
    return DoctorReport(_merge(found), MappingProxyType(attention), tuple(envs))


def blocking_checks(
    spec: FarmSpec,
    worker_id: int,
    report: DoctorReport,
    live_ports: Mapping[tuple[str, int], str | None],
) -> list[Check]:
    """The failures that must stop `worker_id` from starting now, each with its fix.

    The report's failures for this worker (farm-wide ones included), except the port
    checks, which are judged from `live_ports` ((host, port) -> None if free, else why
    not), observed just now. Raises KeyError for a worker the spec does not have.
    """
    w = spec.worker(worker_id)
    out = [
        c
        for c in report.blocking(worker_id)
        if c.id not in _LIVE_CHECKS and c.id not in _NOT_WORKER_CHECKS
    ]
    live = Observations(
        fleet=FleetSnapshot(taken_at=0.0, duration_s=0.0, nvml_up=False),
        env={},
        flags={},
        models={},
        ports=live_ports,
    )
    out += [
        _with_workers(c, (worker_id,)) for c in _port_checks(live, w) if c.status is Status.FAIL
    ]
    return out


def live_port_keys(w: WorkerSpec) -> tuple[tuple[str, int], ...]:
    """The (host, port) pairs a worker binds: its HTTP port, and NCCL's on all interfaces."""
    return ((w.host, w.port), ("0.0.0.0", w.nccl_port))


def _with_workers(c: Check, workers: tuple[int, ...]) -> Check:
    return Check(c.id, c.status, c.message, c.fix, workers)
