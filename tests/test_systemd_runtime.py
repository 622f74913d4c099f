"""SystemdRuntime against real systemd + D-Bus in a container (docs/reference/machines.md §2).

The pure part (`observe`, `exit_status`, unit names) is tests/test_unit_state.py. The
rest runs INSIDE one container per module: the shipped
`sglang@.service` template plus drop-ins rendered by `units.render` from a real
farm.toml, simulator workers (`python -m sglang_farm.sim`: port bound after the load,
/health 503 during warm-up), and the
real `sglang-farm wait-ready` gate as ExecStartPost=. A driver script (below, run
with the venv's python through nsenter) drives `SystemdRuntime` on the container's
system bus and prints what it saw as JSON.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from sdcontainer import VENV_PYTHON, SystemdContainer
from sglang_farm.runtime.systemd import SystemdRuntime

# -- unit installs -------------------------------------------------------------------


class _SlowReload(SystemdRuntime):
    """A runtime whose daemon-reload waits until released, recording what was on disk."""

    def __init__(self, path: Path) -> None:
        super().__init__(lambda ev: None, follow_logs=False)
        self.path = path
        self.release = asyncio.Event()
        self.reloaded: list[str] = []

    async def daemon_reload(self) -> None:
        self.reloaded.append(self.path.read_text())
        await self.release.wait()


async def test_concurrent_unit_installs_never_interleave(tmp_path: Path) -> None:
    # An older flags snapshot must never land after a newer one: the second install
    # waits until the first has written AND reloaded.
    rel = PurePosixPath("sglang@0.service.d/50-farm.conf")
    rt = _SlowReload(tmp_path / rel)
    first = asyncio.create_task(rt.apply_units({rel: "# old\n"}, tmp_path))
    while not rt.reloaded:  # noqa: ASYNC110  # the reload under test is what sets it
        await asyncio.sleep(0.01)
    second = asyncio.create_task(rt.apply_units({rel: "# new\n"}, tmp_path))
    await asyncio.sleep(0.3)  # time for the second install to write, were it not held
    assert (tmp_path / rel).read_text() == "# old\n"
    rt.release.set()
    await asyncio.wait_for(asyncio.gather(first, second), 10)
    assert rt.reloaded == ["# old\n", "# new\n"]
    assert (tmp_path / rel).read_text() == "# new\n"


# -- in the container --------------------------------------------------------------------

REPO = Path(__file__).resolve().parent.parent
SGLANG_FARM = str(Path(VENV_PYTHON).parent / "sglang-farm")
D = "/run/sf-test"  # scratch folder inside the container (its own tmpfs)
BASE_PORT = 30000
LOAD_SECONDS = 0.5  # the simulator's model load; then 0.2 s of warm-up (/health 503)

FARM_TOML = textwrap.dedent(
    f"""
    [farm]
    python = "{VENV_PYTHON}"
    module = "sglang_farm.sim"
    user = "root"
    group = "root"
    [farm.env]
    SGLANG_SIM_LOAD_SECONDS = "{LOAD_SECONDS}"
    SGLANG_SIM_WARMUP_SECONDS = "0.2"
    SGLANG_SIM_HEALTH_DELAY = "0.05"
    SGLANG_SIM_DRAIN_SECONDS = "1"
    [workers]
    gpus = [0, 1, 2]
    host = "127.0.0.1"
    base_port = {BASE_PORT}
    nccl_base_port = 31000
    [startup]
    load_timeout = "30s"
    poll_interval = "0.1s"
    [health]
    timeout = "2s"
    [restart]
    stop_timeout = "10s"
    [sglang]
    model_path = "/tmp"
    """
)

# Runs inside the container: drives SystemdRuntime, prints one JSON object (last line).
DRIVER = textwrap.dedent(
    """
    import asyncio, json, logging, os, signal, subprocess, sys, time, urllib.request
    import structlog
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    from sglang_farm.runtime import Exited, LogLine, Started
    from sglang_farm.runtime.systemd import SystemdRuntime

    T0 = time.monotonic()
    events = []
    got = asyncio.Event

    def now():
        return round(time.monotonic() - T0, 3)

    def is_active(n):
        return subprocess.run(["systemctl", "is-active", f"sglang@{n}"],
                              capture_output=True, text=True).stdout.strip()

    def health(port):
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status
        except OSError as exc:
            return str(exc)

    async def until(pred, timeout=15.0):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            hit = [e for e in events if pred(e)]
            if hit:
                return hit[0]
            await asyncio.sleep(0.02)  # the test's own wait, not the runtime's
        raise TimeoutError(f"no such event; saw {events}")

    def emit(ev):
        d = {"t": now(), "type": type(ev).__name__, **{k: getattr(ev, k) for k in ev.__slots__}}
        events.append(d)

    async def main(scenario, *args):
        out = {}
        rt = SystemdRuntime(emit)
        await rt.open()
        try:
            out.update(await SCENARIOS[scenario](rt, out, *args))
        finally:
            await rt.close()
        out["events"] = [e for e in events if e["type"] != "LogLine"]
        out["logs"] = [e for e in events if e["type"] == "LogLine"]
        print(json.dumps(out))

    async def start_kill_stop(rt, out, n):
        n = int(n)
        port = 30000 + n
        t_start = now()
        await rt.start(n, None)
        st = await until(lambda e: e["type"] == "Started" and e["worker"] == n)
        out["started_after"] = st["t"] - t_start
        out["is_active_loading"] = is_active(n)
        out["health_loading"] = health(port)
        s = await rt.wait_for(n, lambda s: s.active_state == "active", 15)
        out["t_active"] = now() - t_start
        out["health_when_active"] = health(port)
        out["is_active_ready"] = is_active(n)
        out["main_pid"] = s.main_pid
        t_kill = now()
        os.kill(s.main_pid, signal.SIGKILL)
        ex = await until(lambda e: e["type"] == "Exited" and e["worker"] == n)
        out["exited_after_kill"] = ex["t"] - t_kill
        out["state_after_kill"] = (await rt.unit_state(n)).active_state
        out["tail"] = rt.log_tail(n, 50)
        # Start again, then stop through the runtime: Exited is out when stop returns.
        await rt.start(n, None)
        s2 = await rt.wait_for(n, lambda s: s.active_state == "active" and s.main_pid > 0, 15)
        out["second_pid"] = s2.main_pid
        before = len(events)
        t_stop = now()
        await rt.stop(n, 10)
        out["stop_took"] = now() - t_stop
        out["events_during_stop"] = [e for e in events[before:] if e["type"] != "LogLine"]
        out["state_after_stop"] = is_active(n)
        return out

    async def adopt(rt, out, *ns):
        found = await rt.adopt()
        out["adopted"] = {str(k): {"pid": v.pid, "active": v.active} for k, v in found.items()}
        out["mainpids"] = {n: int(subprocess.run(
            ["systemctl", "show", "-P", "MainPID", f"sglang@{n}"],
            capture_output=True, text=True).stdout) for n in ns}
        return out

    def show(prop, n):
        return subprocess.run(["systemctl", "show", "-P", prop, f"sglang@{n}"],
                              capture_output=True, text=True).stdout.strip()

    def on_disk():
        from pathlib import Path, PurePosixPath
        root = Path("/run/systemd/system")
        return {PurePosixPath(p.relative_to(root).as_posix()): p.read_text()
                for p in root.glob("sglang@*.service.d/50-farm.conf")}

    def environ(pid):
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return [e.decode() for e in fh.read().split(b"\\0") if e]

    async def stale(rt, out):
        # The agent wrote new drop-ins and died before daemon-reload: the files are what
        # a new agent renders (nothing changed on disk), systemd still has the old ones.
        from pathlib import PurePosixPath
        from sglang_farm.runtime.systemd import install_units
        # systemd keeps a definition for loaded units only: worker 0 runs, worker 1 is
        # held loaded (the runtime references every unit it reads).
        await rt.start(0, None)
        await rt.wait_for(0, lambda s: s.active_state == "active", 15)
        await rt.unit_state(1)
        orig = on_disk()
        files = dict(orig)
        d0 = PurePosixPath("sglang@0.service.d/50-farm.conf")
        d1 = PurePosixPath("sglang@1.service.d/50-farm.conf")
        files[d0] += "Environment=SF_MARK=0\\n"
        files[d1] += "Environment=SF_MARK=1\\n"
        written = {**orig, d0: files[d0]}  # every drop-in: the others are not stale
        install_units(written)
        out["stale_before"] = show("NeedDaemonReload", 0)
        changes = await rt.apply_units(written)
        out["changed"] = changes.changed
        out["stale_after"] = show("NeedDaemonReload", 0)
        out["env_after_apply"] = show("Environment", 0)
        # The start path: a drop-in rewritten without reload, then started at once.
        install_units(files)
        out["stale_before_start"] = show("NeedDaemonReload", 1)
        await rt.start(1, None)
        # Active: the main process has long exec'd (at fork it still has systemd's env).
        s = await rt.wait_for(1, lambda s: s.active_state == "active", 15)
        out["env_started"] = [e for e in environ(s.main_pid) if e.startswith("SF_MARK=")]
        await rt.stop(1, 10)
        await rt.stop(0, 10)
        return out

    async def adopt_strays(rt, out, keep):
        found = await rt.adopt(configured=[int(keep)])
        out["adopted"] = {str(k): {"pid": v.pid, "argv": v.argv} for k, v in found.items()}
        out["strays"] = [{"worker": r.worker, "pid": r.pid} for r in rt.strays]
        end = time.monotonic() + 20
        while time.monotonic() < end and is_active(2) not in ("inactive", "failed"):
            await asyncio.sleep(0.1)
        out["stray_state"] = is_active(2)
        return out

    SCENARIOS = {"start_kill_stop": start_kill_stop, "adopt": adopt, "stale": stale,
                 "adopt_strays": adopt_strays}
    asyncio.run(main(*sys.argv[1:]))
    """
)


@pytest.fixture(scope="module")
def farm(sd_container: SystemdContainer) -> Iterator[SystemdContainer]:
    """The container with the farm's units installed (template + rendered drop-ins)."""
    from sglang_farm.config import load_spec
    from sglang_farm.runtime.unit_secrets import credentials_dir, render_secrets
    from sglang_farm.runtime.units import render, static_unit

    c = sd_container
    c.write_file(f"{D}/driver.py", DRIVER)
    c.write_file(f"{D}/farm.toml", FARM_TOML)
    spec = load_spec(FARM_TOML, source=f"{D}/farm.toml")
    files = render(spec, agent_bin=SGLANG_FARM, config_path=f"{D}/farm.toml", static=False)
    # The template as the package ships it (in /lib on a real host); drop-ins in /run.
    c.write_file("/run/systemd/system/sglang@.service", static_unit("sglang@.service"))
    for rel, text in files.items():
        if rel.parts[0].startswith("sglang@"):
            c.write_file(f"/run/systemd/system/{rel}", text)
    # The secret files the drop-ins name (EnvironmentFile=), root-only, as `prepare` writes them.
    folder = str(credentials_dir(spec))
    c.run(["install", "-d", "-m", "0700", folder])
    for name, data in render_secrets(spec).items():
        c.write_file(f"{folder}/{name}", data.decode(), mode=0o600)
    c.run(["systemctl", "daemon-reload"])
    yield c


def _drive(c: SystemdContainer, *args: str, timeout: float = 90) -> dict[str, Any]:
    r = c.run([VENV_PYTHON, f"{D}/driver.py", *args], check=False, timeout=timeout)
    if r.returncode != 0:
        pytest.fail(f"driver {shlex.join(args)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    reply: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    return reply


@pytest.mark.systemd
def test_start_ready_gate_sigkill_and_stop(farm: SystemdContainer, sd: SystemdContainer) -> None:
    out = _drive(farm, "start_kill_stop", "0")
    print(json.dumps({k: v for k, v in out.items() if k != "logs"}, indent=1), file=sys.stderr)
    # Started comes from systemd's signals as soon as the main process exists.
    assert out["started_after"] < 1.0
    # Readiness gate: activating while loading (port not bound yet), active once /health is 200.
    assert out["is_active_loading"] == "activating"
    assert out["health_loading"] != 200
    assert out["t_active"] >= LOAD_SECONDS * 0.9
    assert out["health_when_active"] == 200
    assert out["is_active_ready"] == "active"
    # SIGKILL of MainPID -> Exited with -9 and Result=signal, learned from signals at once.
    kill_ev = [e for e in out["events"] if e["type"] == "Exited" and e["pid"] == out["main_pid"]]
    assert kill_ev == [
        {
            "t": kill_ev[0]["t"],
            "type": "Exited",
            "worker": 0,
            "pid": out["main_pid"],
            "status": -9,
            "result": "signal",
        }
    ]
    assert out["exited_after_kill"] < 1.0
    assert out["state_after_kill"] == "failed"  # Restart=no: the agent owns restarts
    # The worker's lines reach the journal, the follower and log_tail.
    assert any(
        "fired up and ready to roll" in ln["text"] for ln in out["logs"] if ln["worker"] == 0
    )
    assert any("fired up and ready to roll" in ln for ln in out["tail"])
    assert "sglang@0.service: Main process exited, code=killed, status=9/KILL" in out["tail"]
    # sglang@0 had never logged when the follower started: it learned the unit from
    # systemd's "Starting" entry, so systemd's own lines about it come through too.
    followed = [ln["text"] for ln in out["logs"] if ln["worker"] == 0]
    assert any(t.startswith("Starting ") for t in followed), followed[:5]
    assert "sglang@0.service: Main process exited, code=killed, status=9/KILL" in followed
    # stop() returns after the unit is down and Exited is out (SGLang drains on SIGTERM, exits 0).
    assert out["second_pid"] != out["main_pid"]
    stop_events = out["events_during_stop"]
    assert [(e["type"], e["pid"], e["status"]) for e in stop_events] == [
        ("Exited", out["second_pid"], 0)
    ]
    assert out["state_after_stop"] == "inactive"
    assert out["stop_took"] < 5


@pytest.mark.systemd
def test_adopt_finds_running_units_and_close_leaves_them(
    farm: SystemdContainer, sd: SystemdContainer
) -> None:
    # Worker 2 stays loading: a slower model load, in a drop-in of the test's own (15 min:
    # longer than any loaded machine takes to reach the adoption below). An environment
    # file, not Environment=: the farm's drop-in reads the config's environment from an
    # EnvironmentFile=, which overrides any Environment= (systemd.exec(5)); a later file
    # overrides an earlier one. (With Environment= worker 2 loaded in 0.5 s and the test
    # passed only when adoption came first.)
    farm.write_file("/run/sf-test-slow-load.env", "SGLANG_SIM_LOAD_SECONDS=900\n")
    farm.write_file(
        "/run/systemd/system/sglang@2.service.d/60-test.conf",
        "[Service]\nEnvironmentFile=/run/sf-test-slow-load.env\n",
    )
    farm.run(["systemctl", "daemon-reload"])
    # Worker 1 is started (and ready) by someone else, as before an agent restart.
    farm.run(["systemctl", "start", "sglang@1"], timeout=30)
    farm.run(["systemctl", "start", "--no-block", "sglang@2"])
    try:
        # The queued start job runs at once; a give-up bound for a busy machine.
        end = time.monotonic() + 30
        state = "inactive"
        while state == "inactive" and time.monotonic() < end:
            state = farm.run(["systemctl", "is-active", "sglang@2"], check=False).stdout.strip()
        assert state == "activating", f"worker 2 should still be loading, is {state}"
        # What it loads with, once its main process has exec'd (at fork it still has
        # systemd's environment).
        env: list[str] = []
        while time.monotonic() < end and not any(e.startswith("SGLANG_SIM") for e in env):
            env = farm.run(
                [
                    "sh",
                    "-c",
                    "tr '\\0' '\\n' < /proc/$(systemctl show -P MainPID sglang@2)/environ",
                ],
                check=False,
            ).stdout.splitlines()
        assert "SGLANG_SIM_LOAD_SECONDS=900" in env, env
        out = _drive(farm, "adopt", "1", "2")
        assert out["adopted"] == {
            "1": {"pid": out["mainpids"]["1"], "active": True},
            "2": {"pid": out["mainpids"]["2"], "active": False},
        }
        assert out["mainpids"]["1"] > 0 and out["mainpids"]["2"] > 0
        # Adoption restarts nothing and reports no new start.
        assert out["events"] == []
        # close() left both running with the same PIDs.
        for n in ("1", "2"):
            pid = farm.run(["systemctl", "show", "-P", "MainPID", f"sglang@{n}"]).stdout.strip()
            assert int(pid) == out["mainpids"][n]
    finally:
        farm.run(["systemctl", "stop", "sglang@1", "sglang@2"], check=False)
        farm.run(["rm", "-f", "/run/systemd/system/sglang@2.service.d/60-test.conf"])
        farm.run(["rm", "-f", "/run/sf-test-slow-load.env"])
        farm.run(["systemctl", "daemon-reload"])


@pytest.mark.systemd
def test_start_returns_when_ready_through_the_gate(
    farm: SystemdContainer, sd: SystemdContainer
) -> None:
    # `systemctl start` blocks until ExecStartPost= (wait-ready) passed: then /health is 200.
    t0 = time.monotonic()
    farm.run(["systemctl", "start", "sglang@1"], timeout=30)
    took = time.monotonic() - t0
    try:
        code = farm.run(
            [
                VENV_PYTHON,
                "-c",
                "import urllib.request as u; "
                f"print(u.urlopen('http://127.0.0.1:{BASE_PORT + 1}/health', timeout=2).status)",
            ]
        ).stdout.strip()
        assert code == "200"
        assert took >= LOAD_SECONDS * 0.9
        assert "wait_ready_ok" in farm.journal("sglang@1.service")
    finally:
        farm.run(["systemctl", "stop", "sglang@1"], check=False)


@pytest.mark.systemd
def test_units_changed_on_disk_but_not_reloaded_are_reloaded_before_use(
    farm: SystemdContainer, sd: SystemdContainer
) -> None:
    try:
        out = _drive(farm, "stale")
        # Identical files (nothing to write), yet systemd's definition was stale: reloaded.
        assert out["stale_before"] == "yes"
        assert out["changed"] is False
        assert out["stale_after"] == "no"
        assert "SF_MARK=0" in out["env_after_apply"].split()
        # start() itself refuses to start a unit from its stale definition.
        assert out["stale_before_start"] == "yes"
        assert out["env_started"] == ["SF_MARK=1"]
    finally:
        farm.run(["systemctl", "stop", "sglang@0", "sglang@1"], check=False)
        for n in (0, 1):
            conf = f"/run/systemd/system/sglang@{n}.service.d/50-farm.conf"
            farm.run(["sed", "-i", "/^Environment=SF_MARK=/d", conf])
        farm.run(["systemctl", "daemon-reload"])


@pytest.mark.systemd
def test_adoption_reports_and_stops_strays_and_records_each_workers_argv(
    farm: SystemdContainer, sd: SystemdContainer
) -> None:
    # Workers 1 and 2 run; the config now names worker 1 only (a shrink while the agent
    # was down): worker 2 is a stray holding its GPU.
    farm.run(["systemctl", "start", "sglang@1", "sglang@2"], timeout=30)
    try:
        cmdline = {
            n: farm.run(
                [
                    "sh",
                    "-c",
                    f"tr '\\0' '\\n' < /proc/$(systemctl show -P MainPID sglang@{n})/cmdline",
                ]
            ).stdout.splitlines()
            for n in (1,)
        }
        out = _drive(farm, "adopt_strays", "1")
        assert list(out["adopted"]) == ["1"]
        # What worker 1 runs, to compare with what the config renders now.
        assert out["adopted"]["1"]["argv"] == cmdline[1]
        assert "--port" in cmdline[1] and str(BASE_PORT + 1) in cmdline[1]
        assert [s["worker"] for s in out["strays"]] == [2]
        assert out["stray_state"] == "inactive"
        # Worker 1 keeps running.
        assert farm.run(["systemctl", "is-active", "sglang@1"], check=False).stdout.strip() == (
            "active"
        )
    finally:
        farm.run(["systemctl", "stop", "sglang@1", "sglang@2"], check=False)


def test_the_shipped_worker_unit_lets_sglang_bind_to_numa_and_a_narrowing_dropin_is_seen(
    farm: SystemdContainer,
) -> None:
    """The doctor's NUMA check reads each worker unit's effective filter from systemd: the
    shipped template's deny-list keeps @resources (set_mempolicy, mbind, sched_setaffinity);
    an operator's drop-in that narrows it to an allow-list without them is reported."""
    from sglang_farm.host.numa_facts import BINDING_SYSCALLS
    from sglang_farm.host.numa_probe import read_numa_facts

    def filter_of(unit: str) -> str:
        show = ["systemctl", "show", "-p", "SystemCallFilter", "--value", unit]
        return farm.run(show).stdout

    shipped = read_numa_facts({}, [(0, "sglang@0.service")], unit_filter=_container_filter(farm))
    got = shipped.unit_filters[0].filter
    assert got is not None and got.deny and "reboot" in got.names, filter_of("sglang@0.service")
    assert got.refused(BINDING_SYSCALLS) == ()
    dropin = "/run/systemd/system/sglang@9.service.d/90-narrow.conf"
    farm.write_file(
        dropin, "[Service]\nSystemCallFilter=\nSystemCallFilter=@basic-io @network-io\n"
    )
    try:
        farm.run(["systemctl", "daemon-reload"])
        narrowed = read_numa_facts(
            {}, [(9, "sglang@9.service")], unit_filter=_container_filter(farm)
        ).unit_filters[9]
        assert narrowed.filter is not None, narrowed.error
        assert narrowed.filter.refused(BINDING_SYSCALLS) == BINDING_SYSCALLS, filter_of(
            "sglang@9.service"
        )
    finally:
        farm.run(["rm", "-rf", "/run/systemd/system/sglang@9.service.d"])
        farm.run(["systemctl", "daemon-reload"])


def _container_filter(c: SystemdContainer) -> Any:
    """`numa_probe.systemctl_filter`, run inside the container."""
    from sglang_farm.host.numa_facts import UnitFilter, parse_systemctl_filter

    def read(unit: str) -> UnitFilter:
        r = c.run(["systemctl", "show", "-p", "SystemCallFilter", "--value", unit], check=False)
        if r.returncode != 0:
            return UnitFilter(error=r.stderr.strip())
        return UnitFilter(filter=parse_systemctl_filter(r.stdout))

    return read
