"""Pure: the doctor's rules, all of them: what `gather` observed -> a `DoctorReport`.

`evaluate` runs the GPU rules (`gpu_rules`), the flag rules (`flag_rules`) and the host
rules (`host_rules`) over every worker and merges identical verdicts into one row;
`blocking_checks` is what must keep a worker from starting now.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

from sglang_farm.doctor.checks import (
    Check,
    CheckId,
    DoctorReport,
    Observations,
    ProbeOutcome,
    Status,
)
from sglang_farm.doctor.flag_rules import flag_checks, installed_sglang
from sglang_farm.doctor.gpu_rules import (
    attention_checks,
    env_checks,
    gpu_checks,
    memory_fraction_check,
    worker_cc,
    worker_memory,
)
from sglang_farm.doctor.host_rules import (
    config_secrets_check,
    exposure_check,
    gateway_check,
    key_file_checks,
    model_checks,
    port_checks,
    port_privilege_checks,
)
from sglang_farm.doctor.numa_rules import numa_checks
from sglang_farm.gpus.snapshot import FleetSnapshot
from sglang_farm.sglang.flags import SGLANG_MODULE
from sglang_farm.spec import FarmSpec, WorkerSpec

# Checks whose verdict goes stale within seconds (another process binds the port; the
# worker's own previous instance held it when the report was made): `preflight_blocking`
# tests them again, live, instead of trusting the report.
_LIVE_CHECKS = frozenset({CheckId.PORT_HTTP, CheckId.PORT_NCCL})
# Checks that never keep a worker from starting: the gateway is the farm's front door,
# the workers serve (and can be reached directly) without it.
_NOT_WORKER_CHECKS = frozenset({CheckId.GATEWAY})


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
        mem_total = worker_memory(fleet, w)
        probe = obs.env.get(w.id) or ProbeOutcome(error="not probed")
        for c in gpu_checks(fleet, w):
            found.append((w.id, c))
        for c in env_checks(spec, w, cc, probe):
            found.append((w.id, c))
        if spec.farm.module == SGLANG_MODULE:
            att, picked = attention_checks(w, cc, probe.result)
            found += [(w.id, c) for c in att]
            if picked is not None:
                attention[w.id] = picked
        found += [
            (w.id, c) for c in flag_checks(spec, w, obs.flags.get(w.id), installed_sglang(probe))
        ]
        found += [(w.id, c) for c in port_checks(obs, w)]
        found.append((w.id, exposure_check(w)))
        if spec.farm.module == SGLANG_MODULE:
            found += [(w.id, c) for c in model_checks(obs, w, mem_total, spec.model)]
            found += [(w.id, c) for c in memory_fraction_check(w, mem_total)]
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
    found += numa_checks(spec, obs.numa, simulated=fleet.simulated)
    found += [(None, c) for c in port_privilege_checks(spec, obs)]
    envs: list[Mapping[str, Any]] = []
    for outcome in obs.env.values():
        if outcome.result is not None and all(outcome.result is not e for e in envs):
            envs.append(outcome.result)
    numa = None if fleet.simulated else obs.numa  # a simulated GPU's PCI id is made up
    return DoctorReport(_merge(found), MappingProxyType(attention), tuple(envs), numa)


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
    out += [_with_workers(c, (worker_id,)) for c in port_checks(live, w) if c.status is Status.FAIL]
    return out


def live_port_keys(w: WorkerSpec) -> tuple[tuple[str, int], ...]:
    """The (host, port) pairs a worker binds: its HTTP port, and NCCL's on all interfaces."""
    return ((w.host, w.port), ("0.0.0.0", w.nccl_port))


def _with_workers(c: Check, workers: tuple[int, ...]) -> Check:
    return Check(c.id, c.status, c.message, c.fix, workers)
