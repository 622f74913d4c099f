"""Pure: the doctor's GPU rules: each worker's GPUs, and the software built for them.

Kernel binaries per GPU architecture, torch's build, attention backends per compute
capability, deep_gemm and CUDA_HOME (docs/reference/sglang.md §14), the seed host's three
launch failures on an SM 12.0 card (docs/reference/seed-host.md §3-§5, §11), and the
memory a worker's static pool leaves. Each verdict is a `Check` with a status and a fix.
The farm's `attention_backend = "auto"` pick is `worker_commands.resolve_attention_backend`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from sglang_farm.doctor.checks import Check, CheckId, ProbeOutcome, Status, gb
from sglang_farm.gpus.snapshot import FleetSnapshot
from sglang_farm.sglang.commands import AUTO, resolve_attention_backend
from sglang_farm.sglang.flags import (
    ATTENTION_BACKEND_KEYS,
    NOT_NVIDIA_BACKENDS,
    SGLANG_MODULE,
    mamba_strategy,
    parse_version,
)
from sglang_farm.spec import FarmSpec, WorkerSpec

# Above this, CUDA graphs, activations and the CUDA context (outside SGLang's static
# pool) have almost nothing left: the seed host ran 0.88 on 48 GB cards (~6 GB spare).
MEM_FRACTION_WARN = 0.95
# sglang's environ treats these as false (SGLANG_ENABLE_JIT_DEEPGEMM=0 disables DeepGEMM).
_FALSE_WORDS = frozenset({"0", "false", "no", "off", "n"})


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


def worker_cc(fleet: FleetSnapshot, worker: WorkerSpec) -> tuple[int, int] | None:
    """The lowest compute capability among the worker's GPUs; None when NVML has none."""
    ccs = {
        cc
        for i in worker.gpus
        if (g := fleet.gpu(i)) is not None and (cc := g.compute_capability) is not None
    }
    return min(ccs) if ccs else None


def worker_memory(fleet: FleetSnapshot, worker: WorkerSpec) -> int | None:
    totals = [
        g.memory_total_bytes
        for i in worker.gpus
        if (g := fleet.gpu(i)) is not None and g.memory_total_bytes
    ]
    return min(totals) if totals else None


def gpu_checks(fleet: FleetSnapshot, w: WorkerSpec) -> list[Check]:
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
            mem = f", {gb(g.memory_total_bytes)}" if g.memory_total_bytes else ""
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


def env_checks(
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


def attention_checks(
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


def memory_fraction_check(w: WorkerSpec, mem_total: int | None) -> list[Check]:
    frac = w.flags.get("mem_fraction_static")
    if not isinstance(frac, int | float) or isinstance(frac, bool):
        return []
    if frac > MEM_FRACTION_WARN:
        spare = f" ({gb((1 - frac) * mem_total)} of {gb(mem_total)})" if mem_total else ""
        return [
            Check(
                CheckId.MEMORY,
                Status.WARN,
                f"mem_fraction_static {frac} leaves {1 - frac:.0%} of the card{spare} "
                "for CUDA graphs, activations and the CUDA context: expect CUDA OOM",
                "use 0.80-0.92 (the seed ran 0.88 on 48 GB cards)",
            )
        ]
    share = f": {gb(frac * mem_total)} of {gb(mem_total)}" if mem_total else ""
    return [Check(CheckId.MEMORY, Status.PASS, f"mem_fraction_static {frac}{share}")]
