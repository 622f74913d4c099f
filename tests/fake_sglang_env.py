"""Fake SGLang environments for the preflight doctor, on a fake SM 12.0 host: the preflight
tests and the staging doctor's share them.

The fake environment is a directory tree put on the probe's PYTHONPATH: a `torch`
reporting a version, CUDA build, arch list and device capability; an `sgl_kernel`
shipping `sm90/` + `sm100/` whose import raises the real "[sgl_kernel] CRITICAL" text
when the variant it loads does not cover the GPU; a `deep_gemm` that asserts
`cuda_home is not None` like the real one; a `sglang` (0.5.23 by default, or the seed
host's 0.5.12) whose `srt/server_args.py` builds an argparse parser (allow_abbrev=True)
with that version's spelling of the renamed flags (0.5.23: --mamba-radix-cache-strategy
and --cuda-graph-max-bs-decode/-prefill; 0.5.12: --mamba-scheduler-strategy and
--cuda-graph-max-bs); optionally `flashinfer`. The probe runs for real, with this
interpreter, as the doctor runs it on a host.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from sglang_farm.config import load_spec
from sglang_farm.doctor import (
    Check,
    CheckId,
    DoctorReport,
    Status,
    make_probe_runner,
    port_problem,
)
from sglang_farm.gpus.snapshot import FleetSnapshot, GpuSnapshot
from sglang_farm.spec import FarmSpec, FlagValue

REPO = Path(__file__).resolve().parent.parent
SEED_TOML = REPO / "etc" / "sglang-farm" / "farm.toml"
GIB = 1024**3
_TORCH_INIT = """
import json as _json, os as _os
_conf = _json.load(open(_os.path.join(_os.path.dirname(__file__), "..", "fakeconf.json")))
__version__ = _conf["torch_version"]
from torch import cuda, version
"""


_TORCH_VERSION = """
import json as _json, os as _os
_conf = _json.load(open(_os.path.join(_os.path.dirname(__file__), "..", "fakeconf.json")))
cuda = _conf["torch_cuda"]
"""


_TORCH_CUDA = """
import json as _json, os as _os
_conf = _json.load(open(_os.path.join(_os.path.dirname(__file__), "..", "fakeconf.json")))
def is_available(): return True
def device_count(): return 1
def get_arch_list(): return list(_conf["torch_archs"])
def get_device_capability(device=None): return tuple(_conf["cc"])
"""


# The real loader's shape and text (sgl_kernel/load_utils.py): cc 9.0 -> sm90/, any
# other -> sm100/. A fake "binary" is a text file listing the SASS archs it holds.
_SGL_KERNEL_INIT = '''
import glob, os, torch
_here = os.path.dirname(__file__)
major, minor = torch.cuda.get_device_capability()
compute_capability = major * 10 + minor
variant = "sm90" if compute_capability == 90 else "sm100"
ops_pattern = os.path.join(_here, variant, "common_ops.*")
matching_files = glob.glob(ops_pattern)
errors = []
loaded = False
for path in matching_files:
    archs = open(path).read().split()
    if any(a.rstrip("af") == f"sm_{compute_capability}" for a in archs):
        loaded = True
    else:
        errors.append(ImportError(f"{path}: no kernel image for sm_{compute_capability}"))
if not loaded:
    attempt_error_msg = "\\n".join(f"- {type(e).__name__}: {e}" for e in errors)
    raise ImportError(f"""
[sgl_kernel] CRITICAL: Could not load any common_ops library!

Attempted locations:
1. Architecture-specific pattern: {ops_pattern} - found files: {matching_files}
2. Fallback pattern: {_here}/common_ops.* - found files: []
3. Standard Python import: common_ops - failed

GPU Info:
- Compute capability: {compute_capability}
- Expected variant: {variant.upper()}

Please ensure sgl_kernel is properly installed with:
pip install --upgrade sgl_kernel

Error details from previous import attempts:
{attempt_error_msg}
""")
'''


# sgl-deep-gemm 0.2.3.post2: find_cuda_home() at import, then the bare assert.
_DEEP_GEMM_INIT = """
import os, shutil
def find_cuda_home():
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home is None:
        nvcc = shutil.which("nvcc")
        if nvcc is not None:
            cuda_home = os.path.dirname(os.path.dirname(nvcc))
        else:
            fallback = os.environ.get("ENVPROBE_CUDA_FALLBACK", "/usr/local/cuda")
            if os.path.exists(fallback):
                cuda_home = fallback
    assert cuda_home is not None
    return cuda_home
_cuda_home = find_cuda_home()
"""


# The subset of SGLang's flags the seed config uses, plus the farm's own; RENAMED holds
# the flags whose spelling depends on the version (`_renamed_flags`).
_SERVER_ARGS = """
import argparse

ATTENTION_BACKEND_CHOICES = ["triton", "torch_native", "flex_attention", "fa3", "fa4",
    "flashinfer", "flashmla", "trtllm_mla", "cutedsl_mla", "trtllm_mha"]

class ServerArgs:
    @staticmethod
    def add_cli_args(parser):
        parser.add_argument("--model-path", "--model", type=str, required=True)
        parser.add_argument("--reasoning-parser", type=str)
        parser.add_argument("--attention-backend", choices=ATTENTION_BACKEND_CHOICES)
        parser.add_argument("--prefill-attention-backend", choices=ATTENTION_BACKEND_CHOICES)
        parser.add_argument("--decode-attention-backend", choices=ATTENTION_BACKEND_CHOICES)
        parser.add_argument("--mem-fraction-static", type=float)
        parser.add_argument("--max-running-requests", type=int)
        parser.add_argument("--context-length", type=int)
        parser.add_argument("--trust-remote-code", action="store_true")
        parser.add_argument("--chunked-prefill-size", type=int)
        for name, kind in RENAMED:
            if kind == "mamba":
                parser.add_argument(name,
                    choices=["auto", "no_buffer", "extra_buffer", "extra_buffer_lazy"])
            else:
                parser.add_argument(name, type=int)
        parser.add_argument("--mamba-ssm-dtype", choices=["float32", "bfloat16", "float16"])
        parser.add_argument("--disable-overlap-schedule", action="store_true")
        parser.add_argument("--enable-metrics", action="store_true")
        parser.add_argument("--enable-metrics-for-all-schedulers", action="store_true")
        parser.add_argument("--uvicorn-access-log-exclude-prefixes", nargs="*", default=[])
        parser.add_argument("--host", type=str, default="127.0.0.1")
        parser.add_argument("--port", type=int, default=30000)
        parser.add_argument("--nccl-port", type=int)
        parser.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=1)

def prepare_server_args(argv):
    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    return parser.parse_args(argv)
"""


def _renamed_flags(version: str) -> list[tuple[str, str]]:
    """The renamed flags as SGLang `version` spells them (docs/reference/sglang.md §4)."""
    if version == "0.5.12":  # the seed host
        return [("--mamba-scheduler-strategy", "mamba"), ("--cuda-graph-max-bs", "int")]
    assert version == "0.5.23", version
    return [
        ("--mamba-radix-cache-strategy", "mamba"),
        ("--cuda-graph-max-bs-decode", "int"),
        ("--cuda-graph-max-bs-prefill", "int"),
    ]


@dataclass(frozen=True)
class FakeEnv:
    pythonpath: Path
    nvcc_home: Path  # a "toolkit" with bin/nvcc, for CUDA_HOME


def _dist(root: Path, name: str, version: str) -> None:
    d = root / f"{name.replace('-', '_')}-{version}.dist-info"
    d.mkdir()
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def make_fake_env(
    root: Path,
    *,
    cc: tuple[int, int] = (12, 0),
    torch_archs: tuple[str, ...] = ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100"),
    sm100_archs: tuple[str, ...] = ("sm_80", "sm_89", "sm_90", "sm_90a", "sm_100f"),
    kernel_version: str = "0.4.2.post2",
    flashinfer: bool = False,
    sglang: bool = True,
    sglang_version: str = "0.5.23",
) -> FakeEnv:
    """The seed host's environment by default: torch cu130 without sm_120, sglang-kernel
    0.4.2.post2 with sm90/ and sm100/ built without sm_120, deep_gemm, no flashinfer."""
    site = root / "site"
    site.mkdir(parents=True)
    (site / "fakeconf.json").write_text(
        json.dumps(
            {
                "torch_version": "2.9.1+cu130",
                "torch_cuda": "13.0",
                "torch_archs": list(torch_archs),
                "cc": list(cc),
            }
        )
    )
    torch = site / "torch"
    torch.mkdir()
    (torch / "__init__.py").write_text(_TORCH_INIT)
    (torch / "version.py").write_text(_TORCH_VERSION)
    (torch / "cuda.py").write_text(_TORCH_CUDA)
    kernel = site / "sgl_kernel"
    for variant, archs in (("sm90", ("sm_80", "sm_89", "sm_90", "sm_90a")), ("sm100", sm100_archs)):
        (kernel / variant).mkdir(parents=True)
        (kernel / variant / "common_ops.abi3.so").write_text(" ".join(archs))
    (kernel / "__init__.py").write_text(_SGL_KERNEL_INIT)
    _dist(site, "sglang-kernel", kernel_version)
    (site / "deep_gemm").mkdir()
    (site / "deep_gemm" / "__init__.py").write_text(_DEEP_GEMM_INIT)
    _dist(site, "sgl-deep-gemm", "0.2.3.post2")
    if sglang:
        srt = site / "sglang" / "srt"
        srt.mkdir(parents=True)
        (site / "sglang" / "__init__.py").write_text("")
        (srt / "__init__.py").write_text("")
        renamed = f"RENAMED = {_renamed_flags(sglang_version)!r}\n"
        (srt / "server_args.py").write_text(renamed + _SERVER_ARGS)
        _dist(site, "sglang", sglang_version)
    if flashinfer:
        (site / "flashinfer").mkdir()
        (site / "flashinfer" / "__init__.py").write_text("")
        _dist(site, "flashinfer-python", "0.7.2")
    toolkit = root / "cuda-12.9"
    (toolkit / "bin").mkdir(parents=True)
    nvcc = toolkit / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.9, V12.9.86'\n")
    nvcc.chmod(0o755)
    return FakeEnv(site, toolkit)


def fake_runner(env: FakeEnv, tmp: Path):  # type: ignore[no-untyped-def]  # a closure factory
    """The real probe runner, with the fake tree importable and no host toolkit visible."""
    empty_bin = tmp / "emptybin"
    empty_bin.mkdir(exist_ok=True)
    return make_probe_runner(
        base_env={"PATH": str(empty_bin), "LANG": "C.UTF-8"},
        extra_env={
            "PYTHONPATH": str(env.pythonpath),
            "ENVPROBE_CUDA_FALLBACK": str(tmp / "no-cuda-here"),
        },
        timeout=60,
    )


class Sm120Poller:
    """A GpuPoller of N RTX PRO 6000 Blackwell cards (compute capability 12.0, 48 GB)."""

    def __init__(
        self, count: int = 8, cc: tuple[int, int] = (12, 0), memory: int = 48 * GIB
    ) -> None:
        self.count, self.cc, self.memory = count, cc, memory

    def snapshot(self) -> FleetSnapshot:
        gpus = tuple(
            GpuSnapshot(
                index=i,
                name="NVIDIA RTX PRO 6000 Blackwell",
                compute_capability=self.cc,
                memory_total_bytes=self.memory,
                memory_used_bytes=0,
            )
            for i in range(self.count)
        )
        return FleetSnapshot(taken_at=0.0, duration_s=0.0, nvml_up=True, gpus=gpus)

    def close(self) -> None:
        return None


def _free_base(n: int) -> int:
    """A base port with n free consecutive ports on 0.0.0.0 (probed by binding)."""
    for base in range(41000, 60000, 97):
        if all(port_problem("0.0.0.0", base + i) is None for i in range(n)):
            return base
    raise AssertionError("no free port range")


def seed_spec(
    tmp: Path,
    *,
    attention: str | None = None,
    env: str = "{}",
    extra_sglang: str = "",
    model: Path | None = None,
    gpus: int = 8,
    mamba_key: str | None = None,
    oom_mamba_key: str | None = None,
) -> FarmSpec:
    """etc/sglang-farm/farm.toml as shipped, with this interpreter, free ports and the model
    in tmp (a config.json and 2 GiB of sparse "weights"); `mamba_key` and `oom_mamba_key`
    respell the mamba strategy in [sglang] and in the OOM ladder."""
    if model is None:
        model = tmp / "Qwen3.6-27B"
        model.mkdir(exist_ok=True)
        (model / "config.json").write_text("{}")
        with open(model / "model.safetensors", "wb") as f:
            f.truncate(2 * GIB)
    text = SEED_TOML.read_text()
    text = text.replace('python = "/opt/sglang/bin/python3"', f'python = "{sys.executable}"')
    text = text.replace('model_path = "/dev/shm/Qwen3.6-27B"', f'model_path = "{model}"')
    text = text.replace("env = {}", f"env = {env}", 1)
    base = _free_base(16)
    text = text.replace("base_port = 30000", f"base_port = {base}")
    text = text.replace("nccl_base_port = 31000", f"nccl_base_port = {base + 8}")
    if attention is not None:
        text = text.replace(
            'attention_backend = "flashinfer"', f'attention_backend = "{attention}"'
        )
    if mamba_key is not None:
        text = text.replace(
            'mamba_radix_cache_strategy = "extra_buffer"', f'{mamba_key} = "extra_buffer"'
        )
    if oom_mamba_key is not None:
        text = text.replace(
            'set = { mamba_radix_cache_strategy = "no_buffer"',
            f'set = {{ {oom_mamba_key} = "no_buffer"',
        )
    text += extra_sglang
    return load_spec(text, source="farm.toml", gpu_count=gpus)


def _by_id(report: DoctorReport, cid: CheckId) -> list[Check]:
    return [c for c in report.checks if c.id is cid]


def _fails(report: DoctorReport) -> dict[CheckId, Check]:
    return {c.id: c for c in report.checks if c.status is Status.FAIL}


def _with_worker_flags(spec: FarmSpec, flags: Mapping[str, FlagValue]) -> FarmSpec:
    """`spec` with worker 0's flags replaced and only worker 0 kept."""
    return replace(spec, workers=(replace(spec.workers[0], flags=flags),))


def _demo_with_gateway(base_port: int | None = None) -> FarmSpec:
    """The demo's config; `base_port`: its workers elsewhere (the README walkthrough
    tests may run the demo itself on its own ports meanwhile)."""
    text = (REPO / "etc" / "sglang-farm" / "demo.toml").read_text()
    if base_port is not None:
        assert "\nbase_port = 30000\n" in text
        text = text.replace("\nbase_port = 30000\n", f"\nbase_port = {base_port}\n")
    spec = load_spec(text, source="demo.toml", agent_python=sys.executable)
    assert spec.gateway.mode == "managed"  # the demo runs smg itself
    return spec
