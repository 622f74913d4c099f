"""I/O: the doctor's gathering: everything `rules.evaluate` needs, observed on this host.

One GPU snapshot; the environment probe (`envprobe.py`, run by the WORKERS'
interpreter with the worker's environment, once per distinct interpreter/environment/
GPU architecture); SGLang's own argument parser over every rendered command line (the
probe's `flags` mode); bind tests of the HTTP and NCCL ports; the model directory; and
`/dev/shm`; two sysctls (`proc_sys`: which ports need a privilege to bind). `run_doctor`
gathers and evaluates; `preflight_blocking` is what the agent calls before starting a
worker.

The probe runs the workers' interpreter with the workers' environment, so it runs as
the workers' account ([farm] user/group), never as root: anything that account can
write (a `.pth` file in the venv, a directory on `PYTHONPATH`) runs when the
interpreter starts, and must not run with the agent's privileges. When this process is
root (the agent; `sglang-farm doctor` under sudo), the probe runs as that account:

- on a systemd host, as a transient unit (`systemd-run`) with the worker unit's own
  sandbox (`WORKER_SANDBOX`, the hardening of units/sglang@.service) and its
  environment in a root-only `EnvironmentFile=`. Chosen over dropping privileges in
  the child because the agent's unit grants no CAP_SETUID/CAP_SETGID (it would need
  both, only for this), because the probe (torch, sglang: gigabytes, many threads)
  then counts against its own cgroup instead of the agent's memory and task limits,
  and because it sees what a worker sees (the worker's sandbox, not the agent's);
- elsewhere (no systemd: containers, CI, the process runtime), in a child that drops
  to the account's uid, gid and supplementary groups before it execs, with HOME,
  USER and LOGNAME of that account.

A missing account is a doctor finding (the environment checks fail and say so), never
a reason to run the probe as root.
"""

from __future__ import annotations

import contextlib
import dataclasses
import grp
import json
import math
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from sglang_farm.doctor.accounts import account_fix
from sglang_farm.doctor.checks import (
    Check,
    CheckId,
    DoctorReport,
    FlagsOutcome,
    GatewayFacts,
    KeyFileFacts,
    Observations,
    PathFacts,
    ProbeOutcome,
    Status,
)
from sglang_farm.doctor.gpu_rules import worker_cc
from sglang_farm.doctor.host_rules import key_files
from sglang_farm.doctor.rules import blocking_checks, evaluate, live_port_keys
from sglang_farm.errors import ProbeError
from sglang_farm.gpus.snapshot import FleetSnapshot, GpuPoller
from sglang_farm.host.numa_facts import NumaFacts
from sglang_farm.host.numa_probe import read_numa_facts
from sglang_farm.host.portowner import held_by
from sglang_farm.host.ports import AGENT_TROUBLE, port_problem, sysctl_int, unprivileged_port_start
from sglang_farm.runtime.running import running_worker_pids
from sglang_farm.runtime.unit_syntax import worker_unit
from sglang_farm.sglang.argv import Command
from sglang_farm.sglang.commands import worker_commands
from sglang_farm.sglang.flags import SGLANG_MODULE
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
# The worker unit's hardening, as units/sglang@.service writes it (a test keeps the two
# equal): the sandbox of the probe's transient unit, so the probe sees what a worker sees.
WORKER_SANDBOX: tuple[str, ...] = (
    "NoNewPrivileges=yes",
    "CapabilityBoundingSet=",
    "AmbientCapabilities=",
    "ProtectSystem=full",
    "PrivateTmp=yes",
    "ProtectKernelTunables=yes",
    "ProtectKernelModules=yes",
    "ProtectKernelLogs=yes",
    "ProtectControlGroups=yes",
    "ProtectHostname=yes",
    "ProtectProc=invisible",
    "RestrictNamespaces=yes",
    "RestrictRealtime=yes",
    "RestrictSUIDSGID=yes",
    "LockPersonality=yes",
    "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK",
    "PrivateMounts=yes",
    "SystemCallArchitectures=native",
    "SystemCallFilter=~@clock @cpu-emulation @module @mount @obsolete @raw-io @reboot @swap",
    "SystemCallErrorNumber=EPERM",
    "UMask=0027",
)
# Where the transient unit's environment file is written (root only, 0600): a place
# systemd itself can read, so not under the agent's PrivateTmp=. The first that works.
PROBE_ENV_DIRS = ("/run/sglang-farm", "/run")
# How long systemd-run may take beyond the probe's own limit (RuntimeMaxSec=) to return.
_UNIT_GRACE_S = 15.0

Isolation = Literal["auto", "unit", "process"]


@dataclass(frozen=True, slots=True)
class Account:
    """The account the probe runs as: the workers' ([farm] user and group)."""

    user: str
    group: str
    uid: int
    gid: int
    # Supplementary groups, as systemd's User= gives them (getgrouplist of user and gid).
    groups: tuple[int, ...]
    home: str


def worker_account(user: str, group: str) -> Account:
    """I/O (passwd, group databases): the account; `ProbeError` saying what is missing."""
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        raise ProbeError(
            f"the workers' user {user!r} ([farm] user) does not exist on this host, and the "
            "probe runs only as that user, never as root"
        ) from None
    try:
        gid = grp.getgrnam(group).gr_gid
    except KeyError:
        raise ProbeError(
            f"the workers' group {group!r} ([farm] group) does not exist on this host, and "
            "the probe runs only as the workers' account, never as root"
        ) from None
    groups = tuple(sorted(set(os.getgrouplist(user, gid))))
    return Account(user, group, pw.pw_uid, gid, groups, pw.pw_dir)


def probe_account(spec: FarmSpec, *, euid: int | None = None) -> Account | None:
    """Whom the probe must run as: the workers' account when this process is root (raises
    `ProbeError` when it does not exist); None otherwise (this process's own user, which
    cannot switch and has no privilege to hand the probe)."""
    if (os.geteuid() if euid is None else euid) != 0:
        return None
    return worker_account(spec.farm.user, spec.farm.group)


def choose_isolation(account: Account | None, isolation: Isolation, *, systemd: bool) -> str:
    """Pure: "unit", "process" (drop to the account in the child) or "self" (no account)."""
    if account is None:
        return "self"
    if isolation == "auto":
        return "unit" if systemd else "process"
    return isolation


def environment_file_text(env: Mapping[str, str]) -> str:
    """Pure: `env` as a systemd EnvironmentFile= (each value double-quoted, escaped)."""
    lines = []
    for key, value in sorted(env.items()):
        quoted = "".join("\\" + c if c in '"\\`$' else c for c in value)
        lines.append(f'{key}="{quoted}"\n')
    return "".join(lines)


def transient_unit_argv(
    python: str, source: str, mode: str, account: Account, env_file: str, timeout: float
) -> list[str]:
    """Pure: `systemd-run` running the probe as the workers' account in their sandbox.

    `--pipe` hands the probe our stdin (the payload) and stdout (its JSON); `--wait`
    returns when it ended; `--collect` leaves no failed unit behind. ExecStart= expands
    `$NAME`, so a `$` in the source is written `$$` (systemd.service(5), Command lines).
    """
    name = f"sglang-farm-probe-{uuid.uuid4().hex[:12]}.service"
    args = [
        "systemd-run", "--quiet", "--wait", "--pipe", "--collect", "--service-type=exec",
        f"--unit={name}", "--description=sglang-farm doctor: environment probe",
        f"--uid={account.user}", f"--gid={account.group}", "--working-directory=/",
        f"--property=EnvironmentFile={env_file}",
        f"--property=RuntimeMaxSec={math.ceil(timeout)}",
    ]  # fmt: skip
    args += [f"--property={p}" for p in WORKER_SANDBOX]
    return [*args, "--", python, "-c", source.replace("$", "$$"), mode]


def _write_env_file(env: Mapping[str, str]) -> str:
    """The environment in a new 0600 file that systemd can read; its path."""
    text = environment_file_text(env)
    last: OSError | None = None
    for d in PROBE_ENV_DIRS:
        try:
            fd, path = tempfile.mkstemp(prefix="probe-", suffix=".env", dir=d)
        except OSError as exc:
            last = exc
            continue
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        return path
    raise ProbeError(f"cannot write the probe's environment file in {PROBE_ENV_DIRS}: {last}")


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
    account: Account | None = None,
    isolation: Isolation = "auto",
) -> ProbeRunner:
    """A `ProbeRunner` that runs `envprobe.py` with the worker's interpreter.

    The environment is `base_env` (what a systemd service sees), then `extra_env`, then
    the account's HOME/USER/LOGNAME, then the worker's own (`[farm] env`,
    CUDA_VISIBLE_DEVICES, ...). With an `account` (see `probe_account`) the probe runs
    as that account: in a transient unit or a child that drops to it (`isolation`;
    "auto": a unit on a systemd host). Without one it runs as this process's user.
    """
    source = _probe_source()
    how = choose_isolation(account, isolation, systemd=os.path.isdir("/run/systemd/system"))

    def run(
        python: str, env: Mapping[str, str], mode: str, payload: Mapping[str, Any] | None
    ) -> Mapping[str, Any]:
        ident = {}
        if account is not None:
            ident = {"HOME": account.home, "USER": account.user, "LOGNAME": account.user}
        full = {**base_env, **(extra_env or {}), **ident, **env}
        drop: dict[str, Any] = {}
        argv = [python, "-c", source, mode]
        run_env: Mapping[str, str] = full
        env_file: str | None = None
        limit = timeout
        if (
            how == "process"
            and account is not None
            and ((account.uid, account.gid) != (os.geteuid(), os.getegid()))
        ):
            # setgroups, setregid, setreuid in the child, before exec: the interpreter
            # (and the dynamic loader, with the worker's LD_* variables) runs as the account.
            drop = {"user": account.uid, "group": account.gid,
                    "extra_groups": list(account.groups)}  # fmt: skip
        elif how == "unit" and account is not None:
            env_file = _write_env_file(full)
            argv = transient_unit_argv(python, source, mode, account, env_file, timeout)
            # systemd-run itself runs as root: none of the worker's variables (LD_PRELOAD...).
            run_env = {k: v for k, v in base_env.items() if k in ("PATH", "LANG")}
            limit = timeout + _UNIT_GRACE_S
        try:
            proc = subprocess.run(
                argv,
                input=json.dumps(payload or {}),
                capture_output=True,
                text=True,
                env=run_env,
                cwd="/",
                timeout=limit,
                check=False,
                **drop,
            )
        except FileNotFoundError as exc:
            raise ProbeError(f"{argv[0]} does not exist") from exc
        except PermissionError as exc:
            who = f" as user {account.user!r}" if account is not None else ""
            raise ProbeError(f"{argv[0]} cannot be run{who}: {exc.strerror or exc}") from exc
        except OSError as exc:
            raise ProbeError(f"cannot run {argv[0]}: {exc.strerror or exc}") from exc
        except subprocess.TimeoutExpired as exc:
            raise ProbeError(f"the probe took over {timeout:g} s") from exc
        finally:
            if env_file is not None:
                with contextlib.suppress(OSError):
                    os.unlink(env_file)
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


def key_file_facts(spec: FarmSpec) -> dict[str, KeyFileFacts]:
    """Owner and mode of each key file the config names (`host_rules.key_files`); no key is read."""
    out: dict[str, KeyFileFacts] = {}
    for _key, path in key_files(spec):
        try:
            st = os.stat(path)
        except OSError as exc:
            out[path] = KeyFileFacts(error=exc.strerror or str(exc))
        else:
            out[path] = KeyFileFacts(uid=st.st_uid, mode=stat.S_IMODE(st.st_mode))
    return out


def farm_folder_problems(spec: FarmSpec) -> tuple[str, ...]:
    """Why the agent would refuse its state folder or its control socket's folder."""
    from sglang_farm.host.securepath import folder_problem

    found = (
        folder_problem(spec.farm.state_dir, "the state folder", "[farm] state_dir"),
        folder_problem(
            os.path.dirname(spec.control.socket), "the control socket's folder", "[control] socket"
        ),
    )
    return tuple(p for p in found if p is not None)


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
    return PathFacts(
        True,
        True,
        (p / "config.json").is_file(),
        size,
        weights,
        real == "/dev/shm" or real.startswith("/dev/shm/"),
    )


# `smg --version` answers in a tenth of a second; a cold page cache (a 100 MB native
# library) makes it seconds. A hung interpreter must not hold up the agent's start.
GATEWAY_PROBE_TIMEOUT_S = 30.0


def gateway_facts(python: str, timeout: float = GATEWAY_PROBE_TIMEOUT_S) -> GatewayFacts:
    """Run `smg --version` the way the managed gateway imports smg (its CLI, in `python`:
    `gateway.launch`), with a timeout. Never raises."""
    code = "from smg.cli import main; main(['--version'])"
    try:
        r = subprocess.run(
            [python, "-c", code],
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except FileNotFoundError:
        return GatewayFacts(python, error=f"{python} does not exist")
    except (OSError, subprocess.TimeoutExpired) as exc:
        return GatewayFacts(python, error=f"`smg --version` did not answer: {exc}")
    if r.returncode != 0:
        lines = (r.stderr or r.stdout).strip().splitlines()
        return GatewayFacts(python, error=lines[-1] if lines else f"exit status {r.returncode}")
    first = r.stdout.strip().splitlines()
    return GatewayFacts(python, version=first[0] if first else None)


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
    gateway_python: str | None = None,
    commands: Mapping[int, Command] | None = None,
    numa: Callable[[FarmSpec, FleetSnapshot], NumaFacts] | None = None,
    proc_sys: str = "/proc/sys",
    worker_pids: Callable[[FarmSpec], Mapping[int, frozenset[int]]] | None = None,
) -> Observations:
    """All the I/O of the doctor. Probes run once per (interpreter, environment, GPU
    architecture), in parallel; never raises for what it finds (that is the report).
    `gateway_python`: the interpreter of a managed gateway (default: this one, which is
    the agent's, as `gateway.managed.launch_argv` is given). `commands`: what each
    worker runs (`worker_commands`: the agent's, at each worker's OOM-ladder step);
    default: each at step 0, for the GPUs NVML sees now. `numa`: reads the NUMA facts
    (default `numa_facts`, this host's sysfs and systemd). `worker_pids`: the processes of
    each worker that runs now (default `runtime.running.running_worker_pids`): a busy
    port its own worker holds (`portowner.held_by`) passes, anyone else's fails."""
    account_error: str | None = None
    runner = run_probe
    if runner is None:
        try:
            runner = make_probe_runner(account=probe_account(spec))
        except ProbeError as exc:
            account_error = str(exc)  # no probe at all: never as root instead
    fleet = gpu_poller.snapshot()
    if commands is None:
        caps = {g.index: g.compute_capability for g in fleet.gpus if g.compute_capability}
        commands = worker_commands(spec, {}, caps)
    runs = commands
    groups: dict[tuple[object, ...], list[WorkerSpec]] = {}
    for w in spec.workers:
        groups.setdefault(_group_key(spec, w, worker_cc(fleet, w)), []).append(w)

    def call(w: WorkerSpec, mode: str, payload: Mapping[str, Any] | None) -> ProbeOutcome:
        env = runs[w.id].env_dict
        if runner is None:
            missing = not os.path.exists(spec.farm.python)
            return ProbeOutcome(error=account_error or "not probed", missing=missing)
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
            argvs = [list(runs[m.id].argv[3:]) for m in members]
            env_job = pool.submit(call, first, "env", None)
            flag_job = (
                pool.submit(call, first, "flags", {"argvs": argvs})
                if spec.farm.module == SGLANG_MODULE
                else None
            )
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
                    flags_out[m.id] = FlagsOutcome(
                        True, None, results[i] if i < len(results) else None
                    )
    ports: dict[tuple[str, int], str | None] = {}
    own_ports: dict[tuple[str, int], int] = {}
    running: Mapping[int, frozenset[int]] | None = None
    for w in spec.workers:
        for host, port in live_port_keys(w):
            if (host, port) in ports:
                continue
            ports[(host, port)] = problem = port_check(host, port)
            if problem is None or problem.startswith(AGENT_TROUBLE):
                continue
            if running is None:  # asked once, and only when a port is busy
                running = (worker_pids or running_worker_pids)(spec)
            if held_by(host, port, running.get(w.id, frozenset())):
                own_ports[(host, port)] = w.id
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
    try:  # who may read farm.toml: it may hold the workers' secrets (docs/security.md)
        config_mode: int | None = stat.S_IMODE(os.stat(spec.source).st_mode)
    except OSError:
        config_mode = None
    gateway: GatewayFacts | None = None
    if spec.gateway.enabled and spec.gateway.mode == "managed":
        gateway = gateway_facts(gateway_python or sys.executable)
    return Observations(
        fleet,
        MappingProxyType(env_out),
        MappingProxyType(flags_out),
        MappingProxyType(ports),
        MappingProxyType(models),
        shm_free,
        config_mode=config_mode,
        key_files=MappingProxyType(key_file_facts(spec)),
        agent_uid=os.geteuid(),
        folder_problems=farm_folder_problems(spec),
        gateway=gateway,
        numa=(numa or numa_facts)(spec, fleet),
        unprivileged_port_start=unprivileged_port_start(proc_sys),
        local_port_range_start=sysctl_int("net/ipv4/ip_local_port_range", proc_sys),
        own_ports=MappingProxyType(own_ports),
    )


def numa_facts(spec: FarmSpec, fleet: FleetSnapshot, sysfs: Path = Path("/sys")) -> NumaFacts:
    """This host's NUMA facts for the farm's GPUs; the worker units' system-call filters
    only where the workers are systemd units (systemd runs here)."""
    bus_ids = {
        g: (s.pci_bus_id if (s := fleet.gpu(g)) else None) for w in spec.workers for g in w.gpus
    }
    units = (
        [(w.id, worker_unit(w.id)) for w in spec.workers]
        if os.path.isdir("/run/systemd/system")
        else []
    )
    return read_numa_facts(bus_ids, units, sysfs=sysfs)


def run_doctor(
    spec: FarmSpec,
    gpu_poller: GpuPoller,
    *,
    run_probe: ProbeRunner | None = None,
    port_check: Callable[[str, int], str | None] = port_problem,
    gateway_python: str | None = None,
    commands: Mapping[int, Command] | None = None,
    worker_pids: Callable[[FarmSpec], Mapping[int, frozenset[int]]] | None = None,
) -> DoctorReport:
    """Gather and evaluate: the whole doctor. Blocks (subprocesses); run it in a thread
    from async code. `run_probe` defaults to `make_probe_runner()` (systemd-like env) as
    the workers' account (`probe_account`)."""
    report = evaluate(
        spec,
        gather(
            spec,
            gpu_poller,
            run_probe=run_probe,
            port_check=port_check,
            gateway_python=gateway_python,
            commands=commands,
            worker_pids=worker_pids,
        ),
    )
    quarantined = quarantine_checks(spec)
    if quarantined:
        report = dataclasses.replace(report, checks=(*report.checks, *quarantined))
    if run_probe is None:
        try:
            probe_account(spec)
        except ProbeError as exc:
            return _account_missing(spec, report, str(exc))
    return report


def quarantine_checks(spec: FarmSpec) -> list[Check]:
    """A warning per worker whose GPU the farm has set aside (from its state file).

    Only a quarantine the agent keeps at start (`supervisor.restored_quarantine`): one
    without its record, or naming a GPU the config no longer gives the worker, is dropped.
    """
    from sglang_farm.state import load

    out = []
    for wid, d in sorted(load(Path(spec.farm.state_dir) / "state.json").items()):
        q = d.get("quarantine")
        if not isinstance(q, dict):
            continue
        gpu = q.get("gpu")
        if wid in spec.worker_ids and gpu not in spec.worker(wid).gpus:
            continue
        out.append(
            Check(
                CheckId.GPU,
                Status.WARN,
                f"GPU {gpu} is quarantined ({q.get('reason')}): worker {wid} stays stopped",
                f"see farmctl why {wid}; reset the GPU, then farmctl release-gpu {gpu} "
                "(docs/gpu-health.md)",
                (wid,) if wid in spec.worker_ids else (),
            )
        )
    return out


def _account_missing(spec: FarmSpec, report: DoctorReport, problem: str) -> DoctorReport:
    """The environment checks that failed because the workers' account is missing: say
    how to create it (their own fix is about the interpreter, which never ran)."""
    fix = account_fix(spec.farm.user, spec.farm.group)
    checks = tuple(
        dataclasses.replace(c, fix=fix)
        if c.id is CheckId.ENVIRONMENT and c.status is Status.FAIL and problem in c.message
        else c
        for c in report.checks
    )
    return dataclasses.replace(report, checks=checks)


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
