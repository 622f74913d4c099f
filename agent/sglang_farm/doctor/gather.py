"""I/O: the doctor's gathering: everything `rules.evaluate` needs, observed on this host.

One GPU snapshot; the environment probe (`envprobe.py`, run by the WORKERS'
interpreter with the worker's environment, once per distinct interpreter/environment/
GPU architecture); SGLang's own argument parser over every rendered command line (the
probe's `flags` mode); bind tests of the HTTP and NCCL ports; the model directory; and
`/dev/shm`. `run_doctor` gathers and evaluates; `preflight_blocking` is what the agent
calls before starting a worker.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import MappingProxyType
from typing import Any

from sglang_farm.doctor.rules import (
    Check,
    DoctorReport,
    FlagsOutcome,
    Observations,
    PathFacts,
    ProbeOutcome,
    blocking_checks,
    evaluate,
    live_port_keys,
    resolve_flags,
    worker_cc,
)
from sglang_farm.errors import ProbeError
from sglang_farm.gpu import GpuPoller
from sglang_farm.ports import port_problem
from sglang_farm.sglang_argv import build_command
from sglang_farm.sglang_flags import SGLANG_MODULE
from sglang_farm.spec import FarmSpec, WorkerSpec

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


ProbeRunner = Callable[[str, Mapping[str, str], str, Mapping[str, Any] | None], Mapping[str, Any]]
"""(python, worker environment, mode "env" | "flags", payload) -> the probe's JSON.

Raises `ProbeError` when the probe cannot run or prints no JSON."""


def _probe_source() -> str:
    # The probe is a standalone script, never imported: its text runs in the workers'
    # interpreter (`<python> -c <text>`), see envprobe.py's docstring.
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
        groups.setdefault(_group_key(spec, w, worker_cc(fleet, w)), []).append(w)

    def call(w: WorkerSpec, mode: str, payload: Mapping[str, Any] | None) -> ProbeOutcome:
        env = build_command(spec.farm, w).env_dict
        try:
            return ProbeOutcome(result=runner(spec.farm.python, env, mode, payload))
        except ProbeError as exc:
            missing = not os.path.exists(spec.farm.python)
            return ProbeOutcome(error=str(exc), missing=missing)

    env_out: dict[int, ProbeOutcome] = {}
    flags_out: dict[int, FlagsOutcome] = {}
    with ThreadPoolExecutor(max_workers=4) as pool:
        jobs = []
        for members in groups.values():
            first = members[0]
            cc = worker_cc(fleet, first)
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
        for host, port in live_port_keys(w):
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
    verdict may be stale (`rules.blocking_checks`). Raises KeyError for a worker the
    spec does not have.
    """
    w = spec.worker(worker_id)
    live = {(host, port): port_check(host, port) for host, port in live_port_keys(w)}
    return blocking_checks(spec, worker_id, report, live)
