"""doctor: `sglang-farm doctor`, the checks before any GPU time is spent (a map, pure and I/O).

- `rules` (pure): what was observed -> a `DoctorReport` of checks, each with a fix.
- `gather` (I/O): the observations: a GPU snapshot, the environment probe, SGLang's own
  parser over every command line, port bind tests, the model directory, /dev/shm.
- `envprobe.py`: the environment probe, a standalone script run by the workers'
  interpreter (never imported).
- `report` (pure): the table for people (`DoctorReport.to_dict` is the JSON).
- `accounts` (I/O lookups over a pure core): the config's accounts this host lacks, which
  the agent refuses under systemd and `check-config` warns of.

The click command is `cli/doctor.py`. This module only re-exports the names other
modules use.
"""

from __future__ import annotations

from sglang_farm.doctor.checks import Check, CheckId, DoctorReport, Observations, Status
from sglang_farm.doctor.gather import (
    ProbeRunner,
    gather,
    make_probe_runner,
    preflight_blocking,
    run_doctor,
)
from sglang_farm.doctor.gpu_rules import arch_covers, backend_verdict
from sglang_farm.doctor.report import format_report
from sglang_farm.doctor.rules import evaluate
from sglang_farm.errors import ProbeError
from sglang_farm.host.ports import port_problem

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
    "evaluate",
    "format_report",
    "gather",
    "make_probe_runner",
    "port_problem",
    "preflight_blocking",
    "run_doctor",
]
