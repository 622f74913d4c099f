"""Issue 30, item 4: the doctor says which of the farm's ports any local user may bind.

A worker's crash frees its port until the gateway drops it, and anyone may bind a port
at or above `net.ipv4.ip_unprivileged_port_start` (1024 by default): the doctor reads
that sysctl (and the first port of `ip_local_port_range`, above which the kernel refuses
it) and names the workers' and the gateway's ports it leaves open, with what to do. The
sysctls come from a fake /proc/sys; the rule is pure over what `gather` read.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from asuser import SETPRIV, require
from sglang_farm.config import load_spec
from sglang_farm.doctor.checks import CheckId, DoctorReport, Status
from sglang_farm.doctor.gather import gather
from sglang_farm.doctor.rules import blocking_checks, evaluate
from sglang_farm.gpus.simulated import FakeGpuPoller
from sglang_farm.runtime.units import render
from sglang_farm.spec import FarmSpec

FARM = """
[workers]
gpus = [0, 1, 2, 3]
base_port = 30000
nccl_base_port = 31000
[sglang]
model_path = "/models/m"
[gateway]
mode = "managed"
listen = "127.0.0.1:8100"
metrics_listen = "127.0.0.1:8101"
"""


def proc_sys(tmp: Path, start: str, local_range: str = "32768\t60999\n") -> str:
    d = tmp / "sys" / "net" / "ipv4"
    d.mkdir(parents=True)
    (d / "ip_unprivileged_port_start").write_text(start)
    (d / "ip_local_port_range").write_text(local_range)
    return str(tmp / "sys")


def doctor(spec: FarmSpec, sys_dir: str) -> DoctorReport:
    def probe(*_a: Any) -> dict[str, Any]:
        return {}

    obs = gather(
        spec,
        FakeGpuPoller(count=4),
        run_probe=probe,
        port_check=lambda _h, _p: None,
        gateway_python="/nonexistent/python",
        proc_sys=sys_dir,
    )
    return evaluate(spec, obs)


def privilege(report: DoctorReport) -> list[Any]:
    return [c for c in report.checks if c.id is CheckId.PORT_PRIVILEGE]


def test_the_kernels_default_leaves_every_farm_port_to_any_user_and_says_what_to_do(
    tmp_path: Path,
) -> None:
    spec = load_spec(FARM, source="farm.toml")
    report = doctor(spec, proc_sys(tmp_path, "1024\n"))
    (check,) = privilege(report)
    assert check.status is Status.WARN and check.workers == ()
    assert "workers' HTTP ports 30000-30003" in check.message
    assert "workers' NCCL ports 31000-31003" in check.message
    assert "the gateway's port 8100" in check.message
    assert "net.ipv4.ip_unprivileged_port_start (1024)" in check.message
    assert "any local user can bind one" in check.message
    # The fix: the sysctl just above the farm's highest port, persisted, and its cost.
    assert "sysctl -w net.ipv4.ip_unprivileged_port_start=31004" in check.fix
    assert "/etc/sysctl.d/60-sglang-farm.conf" in check.fix
    assert "CAP_NET_BIND_SERVICE" in check.fix and "ss -ltnp" in check.fix
    # A warning: it never keeps a worker from starting.
    blocking = blocking_checks(spec, 0, report, {})
    assert [c for c in blocking if c.id is CheckId.PORT_PRIVILEGE] == []


def test_farm_ports_below_the_sysctl_pass_and_a_metrics_port_below_it_is_named(
    tmp_path: Path,
) -> None:
    spec = load_spec(FARM, source="farm.toml")
    report = doctor(spec, proc_sys(tmp_path, "31004\n"))
    checks = privilege(report)
    assert [c.status for c in checks] == [Status.PASS, Status.WARN]
    assert "every farm port is below net.ipv4.ip_unprivileged_port_start (31004)" in (
        checks[0].message
    )
    # The agent's own exporter (9840 by default) then needs a privilege its unit lacks.
    assert "[metrics] listen port 9840" in checks[1].message
    assert "31004 or above" in checks[1].fix


def test_ports_the_sysctl_cannot_cover_are_said_so(tmp_path: Path) -> None:
    # The kernel refuses the sysctl at or above ip_local_port_range's first port.
    spec = load_spec(FARM.replace("nccl_base_port = 31000", "nccl_base_port = 40000"), source="f")
    report = doctor(spec, proc_sys(tmp_path, "1024\n"))
    (check,) = privilege(report)
    assert check.status is Status.WARN
    assert "workers' NCCL ports 40000-40003" in check.message
    assert "ip_local_port_range (32768)" in check.fix and "below 32767" in check.fix


def test_an_unreadable_sysctl_is_no_verdict(tmp_path: Path) -> None:
    spec = load_spec(FARM, source="farm.toml")
    report = doctor(spec, str(tmp_path / "missing"))
    assert privilege(report) == []


# --- what the units do with it: CAP_NET_BIND_SERVICE for a privileged port, nothing else


def test_units_give_a_worker_and_smg_the_bind_capability_only_for_privileged_ports() -> None:
    spec = load_spec(FARM + '[farm]\nuser = "sglang"\ngroup = "sglang"\n', source="farm.toml")
    files = render(spec, static=False, python=sys.executable, unprivileged_port_start=31004)
    dropin = files[PurePosixPath("sglang@2.service.d/50-farm.conf")]
    assert "CapabilityBoundingSet=CAP_NET_BIND_SERVICE\n" in dropin
    assert "AmbientCapabilities=CAP_NET_BIND_SERVICE\n" in dropin
    assert "Port 30002, 31002 is below this host's" in dropin
    unit = files[PurePosixPath("sglang-farm-gateway.service")]
    assert "CapabilityBoundingSet=CAP_NET_BIND_SERVICE\n" in unit
    assert "AmbientCapabilities=CAP_NET_BIND_SERVICE\n" in unit
    assert "PrivateUsers=no\n" in unit and "PrivateUsers=yes" not in unit
    # The kernel's default (or not known): no capability anywhere, as before.
    for start in (1024, None):
        plain = render(spec, static=False, python=sys.executable, unprivileged_port_start=start)
        assert "CAP_NET_BIND_SERVICE" not in "".join(plain.values())
        assert "PrivateUsers=yes\n" in plain[PurePosixPath("sglang-farm-gateway.service")]


BIND = """
import socket, sys
s = socket.socket()
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
    s.listen()
    print("bound")
except OSError as e:
    print("refused", e.errno)
"""


def test_with_the_sysctl_raised_nobody_cannot_squat_a_freed_worker_port() -> None:
    """What the doctor's fix closes, measured in a network namespace of its own (the
    sysctl is per namespace; the host's is left alone): at the kernel's default nobody
    binds worker 5's port the moment it is free; with the sysctl just above the farm's
    ports it is refused (EACCES), and only a process holding CAP_NET_BIND_SERVICE (what
    the worker's unit is given) binds it."""
    require()
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    script = (
        "set -e; ip link set lo up 2>/dev/null || true; "
        'for start in 1024 31004; do sysctl -qw "net.ipv4.ip_unprivileged_port_start=$start"; '
        f'echo "$start $({shlex.join([*SETPRIV, sys.executable, "-I", "-c", BIND, "30005"])}) '
        f'$({shlex.join([*SETPRIV, *CAPS, sys.executable, "-I", "-c", BIND, "30005"])})"; done'
    )
    r = subprocess.run(["unshare", "-n", "sh", "-c", script], capture_output=True, text=True)
    if r.returncode != 0 and "unshare" in r.stderr:
        pytest.skip(f"no network namespace here: {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["1024 bound bound", "31004 refused 13 bound"], r.stdout


CAPS = ["--inh-caps=+net_bind_service", "--ambient-caps=+net_bind_service"]
