"""I/O: the Ansible role and rolling playbook (deploy/ansible) run for real, under load.

    ansible-lint (production profile) and ansible-playbook --syntax-check pass on deploy/ansible
    two systemd containers (tests/sdcontainer.py) are the hosts, reached with the test's
        nsenter connection plugin (tests/ansible_plugins); they share this machine's network,
        so one external smg here routes to both hosts' workers (2 simulated workers each)
    rolling.yml on fresh hosts: the package installed, farm.toml written (validated by
        check-config), the farm enabled and started; all 4 workers ready and in the gateway
    under steady load through the gateway, rolling.yml with the next version of the package
        (the same files, version bumped) and a changed farm.toml (the workers'
        environment): 0 failed requests; host by host (one drained while the other
        serves); both hosts end on the new version, their agents restarted by the
        upgrade, their workers by the reload handler, every worker ready and in the gateway
    run again with the same package and config, after host-a's farm.toml was left on disk
        but not in force (a reload of another file, then the file put back): host-a
        reloads it, host-b changes nothing (changed=0) and never leaves the gateway
    a [gateway] change (which farmctl reload refuses, exit 10) is applied by restarting
        the agents: the workers keep running and are adopted; nothing left pending; on
        host-b, switched from mode "off" to "external", nothing to drain

The real ansible-core, the real package (tests/debbuild.py), a real systemd per host and
the real smg; the controller runs as root (nsenter). The container tests of this module
share the containers and run in file order.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

import debbuild
import sdcontainer
from farmproc import free_port_block, tmpdir
from sdcontainer import SystemdContainer
from sglang_farm.gateway.managed import ManagedGateway, smg_argv

REPO = Path(__file__).resolve().parent.parent
ANSIBLE_DIR = REPO / "deploy" / "ansible"
PLUGINS = Path(__file__).resolve().parent / "ansible_plugins"
BIN = Path(sys.executable).parent  # the venv's ansible-playbook and ansible-lint

pytestmark = [pytest.mark.slow, pytest.mark.systemd, pytest.mark.timeout(1800)]

ADMIN_KEY = "ansible-test-admin-key-0123456789"
MODEL = "sim/Qwen3.6-27B"
WORKERS = 2  # per host
HOSTS = ("host-a", "host-b")
VENV_PY = "/usr/lib/sglang-farm/venv/bin/python3"  # the package's interpreter
NEXT_VERSION_SUFFIX = "+rolled1"


def _env(tmp: Path) -> dict[str, str]:
    """The controller's environment: the venv's tools, the test's plugin, no user state."""
    return {
        **os.environ,
        "PATH": f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "LC_ALL": "C.UTF-8",
        "ANSIBLE_HOME": str(tmp / "ansible-home"),
        "ANSIBLE_LOCAL_TEMP": str(tmp / "ansible-local"),
        "ANSIBLE_CONNECTION_PLUGINS": str(PLUGINS / "connection"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_RETRY_FILES_ENABLED": "0",
        # One nsenter per task (the module on stdin) instead of copy, chmod, run, remove.
        "ANSIBLE_PIPELINING": "1",
        "XDG_CACHE_HOME": str(tmp / "cache"),
    }


def until(cond: Callable[[], bool], within: float, what: str) -> None:
    end = time.monotonic() + within
    while time.monotonic() < end:
        with contextlib.suppress(httpx.HTTPError):
            if cond():
                return
        time.sleep(0.2)
    raise AssertionError(f"not within {within} s: {what}")


# -- lint (no container) ------------------------------------------------------------------


def test_ansible_lint_production_profile_passes(tmp_path: Path) -> None:
    r = subprocess.run(
        [str(BIN / "ansible-lint"), "--offline"],
        cwd=ANSIBLE_DIR,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Profile 'production' was required, and it passed" in r.stdout + r.stderr


def test_rolling_playbook_passes_the_syntax_check(tmp_path: Path) -> None:
    r = subprocess.run(
        [
            str(BIN / "ansible-playbook"),
            "-i",
            str(ANSIBLE_DIR / "inventory.example.yml"),
            "--syntax-check",
            str(ANSIBLE_DIR / "rolling.yml"),
        ],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr


# -- the fleet ----------------------------------------------------------------------------


@dataclass
class Host:
    name: str
    c: SystemdContainer
    base_port: int
    metrics_port: int

    def urls(self) -> set[str]:
        return {f"http://127.0.0.1:{self.base_port + i}" for i in range(WORKERS)}

    def sh(self, script: str, timeout: float = 60) -> str:
        return self.c.sh(script, timeout=timeout).stdout

    def version(self) -> str:
        return self.sh("dpkg-query -W -f '${Version}' sglang-farm 2>/dev/null || true")

    def agent_pid(self) -> int:
        return int(self.sh("systemctl show -p MainPID --value sglang-farm.service").strip())

    def worker_pids(self) -> list[int]:
        units = " ".join(f"sglang@{i}.service" for i in range(WORKERS))
        return [int(p) for p in self.sh(f"systemctl show -p MainPID --value {units}").split()]

    def worker_states(self) -> dict[int, str]:
        r = self.c.run(["farmctl", "--json", "status"], check=False, timeout=30)
        if r.returncode != 0:
            return {}
        return {w["id"]: w["state"] for w in json.loads(r.stdout).get("workers", [])}


@dataclass
class Fleet:
    tmp: Path
    gateway: str
    hosts: list[Host]
    v1: Path
    v2: Path
    seen: dict[str, Any] = field(default_factory=dict)

    def routed(self) -> set[str]:
        r = httpx.get(
            f"{self.gateway}/workers",
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            timeout=5,
        )
        r.raise_for_status()
        return {w["url"] for w in r.json()["workers"] if w.get("status", "ready") == "ready"}

    def all_urls(self) -> set[str]:
        return set().union(*(h.urls() for h in self.hosts))

    def inventory(
        self,
        deb: Path,
        worker_env: dict[str, str],
        gateway: dict[str, str] | None = None,
        host_gateway: dict[str, dict[str, Any]] | None = None,
        host_key: dict[str, str] | None = None,
    ) -> Path:
        """A YAML (here JSON) inventory: the group sglang_farm, one entry per container."""
        config = {
            "farm": {
                "python": VENV_PY,
                "module": "sglang_farm.sim",
                "user": "sglang",
                "group": "sglang",
                "env": {
                    "SGLANG_SIM_LOAD_SECONDS": "0.5",
                    "SGLANG_SIM_WARMUP_SECONDS": "0.2",
                    "SGLANG_SIM_HEALTH_DELAY": "0.05",
                    **worker_env,
                },
            },
            "workers": {"gpus": list(range(WORKERS)), "host": "127.0.0.1"},
            "startup": {"parallel": WORKERS, "load_timeout": "60s", "poll_interval": "200ms"},
            "health": {"period": "1s", "timeout": "5s"},
            "restart": {"backoff_initial": "1s", "stop_timeout": "10s"},
            "metrics": {"gpu_source": "fake", "gpu_poll_interval": "1s"},
            "sglang": {"model_path": MODEL},
            # A changed config restarts the workers canary first; its analysis (judged on
            # minutes of traffic) is canary.md's to test: off here.
            "rollout": {"analysis_window": "0s"},
            "gateway": {
                "mode": "external",
                "url": self.gateway,
                "admin_key_file": "/etc/sglang-farm/gateway-admin.key",
                "drain_timeout": "20s",
                **(gateway or {}),
            },
        }
        by_host = host_gateway or {}
        keys = host_key or {}
        hosts = {
            h.name: {
                "ansible_nsenter_pid": h.c.pid1,
                "sglang_farm_host_config": {
                    "workers": {"base_port": h.base_port},
                    "metrics": {"listen": f"127.0.0.1:{h.metrics_port}"},
                    **({"gateway": by_host[h.name]} if h.name in by_host else {}),
                },
                **({"sglang_farm_gateway_admin_key": keys[h.name]} if h.name in keys else {}),
            }
            for h in self.hosts
        }
        inv = {
            "sglang_farm": {
                "hosts": hosts,
                "vars": {
                    "ansible_connection": "nsenter",
                    "ansible_python_interpreter": "/usr/bin/python3",
                    "sglang_farm_deb": str(deb),
                    "sglang_farm_gateway_admin_key": ADMIN_KEY,
                    "sglang_farm_config": config,
                    "sglang_farm_wait_timeout": 120,
                    "sglang_farm_drain_timeout": 60,
                },
            }
        }
        path = self.tmp / f"inventory-{deb.stem}-{len(list(self.tmp.glob('inventory-*')))}.yml"
        path.write_text(json.dumps(inv, indent=1))
        return path

    def play(
        self,
        deb: Path,
        worker_env: dict[str, str] | None = None,
        gateway: dict[str, str] | None = None,
        *,
        check: bool = False,
        host_gateway: dict[str, dict[str, Any]] | None = None,
        host_key: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        inventory = self.inventory(deb, worker_env or {}, gateway, host_gateway, host_key)
        return subprocess.run(
            [
                str(BIN / "ansible-playbook"),
                "-i",
                str(inventory),
                str(ANSIBLE_DIR / "rolling.yml"),
                *(["--check"] if check else []),
            ],
            env=_env(self.tmp),
            capture_output=True,
            text=True,
            timeout=900,
        )


def _next_version(v1: Path, out: Path) -> Path:
    """The same package with its version bumped: what an upgrade installs (files unchanged)."""
    tree = out / "tree"
    subprocess.run(["dpkg-deb", "-R", str(v1), str(tree)], check=True)
    control = tree / "DEBIAN" / "control"
    lines = control.read_text().splitlines()
    version = next(ln.split(": ", 1)[1] for ln in lines if ln.startswith("Version: "))
    new = version + NEXT_VERSION_SUFFIX
    bumped = [f"Version: {new}" if ln.startswith("Version: ") else ln for ln in lines]
    control.write_text("\n".join(bumped) + "\n")
    deb = out / v1.name.replace(f"_{version}_", f"_{new}_")
    # gzip -1: quick on 2 cores; dpkg reads any of its compressions.
    subprocess.run(["dpkg-deb", "-Zgzip", "-z1", "-b", str(tree), str(deb)], check=True)
    shutil.rmtree(tree)
    return deb


@contextlib.contextmanager
def _gateway(tmp: Path) -> Iterator[str]:
    """The fleet's external gateway: the real smg on this machine's loopback."""
    key = tmp / "admin.key"
    key.write_text(ADMIN_KEY)
    key.chmod(0o600)
    port = free_port_block(2)
    spec = ManagedGateway(host="127.0.0.1", port=port, metrics_port=port + 1, policy="round_robin")
    argv = smg_argv(
        spec, smg=[sys.executable, "-m", "sglang_farm.gateway.launch", "--admin-key-file", str(key)]
    )
    with (tmp / "smg.log").open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        until(lambda: httpx.get(f"{spec.url}/health", timeout=2).status_code == 200, 30, "smg up")
        yield spec.url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    sdcontainer.require_or_skip()
    v1 = debbuild.package(tmp_path_factory.mktemp("deb"))
    v2 = _next_version(v1, tmp_path_factory.mktemp("deb-next"))
    tmp = tmpdir()
    with contextlib.ExitStack() as stack:
        gateway = stack.enter_context(_gateway(tmp))
        hosts = []
        for name in HOSTS:
            c = stack.enter_context(SystemdContainer(private_network=False))
            # A Docker-built machine's policy-rc.d forbids maintainer scripts to touch
            # services (so the upgrade would not restart the agent); a real host has none.
            c.sh("rm -f /usr/sbin/policy-rc.d")
            base = free_port_block(WORKERS + 1)
            hosts.append(Host(name, c, base_port=base, metrics_port=base + WORKERS))
        yield Fleet(tmp, gateway, hosts, v1, v2)
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def fleet_logs(fleet: Fleet, request: pytest.FixtureRequest) -> Iterator[Fleet]:
    """The fleet; prints the hosts' journals and smg's log when the test fails."""
    failed_before = request.session.testsfailed
    yield fleet
    if request.session.testsfailed > failed_before:
        for h in fleet.hosts:
            print(f"===== journal of {h.name} =====")
            print(h.c.journal(lines=120))
        print("===== smg =====")
        print((fleet.tmp / "smg.log").read_text(errors="replace")[-4000:])


def test_playbook_installs_and_starts_fresh_hosts(fleet_logs: Fleet) -> None:
    f = fleet_logs
    r = f.play(f.v1)
    assert r.returncode == 0, r.stdout[-8000:] + r.stderr[-3000:]
    for h in f.hosts:
        assert h.version() == f.v1.name.split("_")[1]
        assert h.sh("systemctl is-enabled sglang-farm.target").strip() == "enabled"
        assert h.worker_states() == dict.fromkeys(range(WORKERS), "ready")
        # The template as the agent reads it: this host's ports, the shared gateway.
        toml = h.sh("cat /etc/sglang-farm/farm.toml")
        assert f"base_port = {h.base_port}" in toml and f'url = "{f.gateway}"' in toml
        assert h.sh("stat -c '%U %a' /etc/sglang-farm/gateway-admin.key").strip() == "root 600"
    # farmctl wait returned 0 on each host: every worker is in the gateway.
    assert f.routed() == f.all_urls()


def test_rolling_upgrade_under_load_fails_no_request(fleet_logs: Fleet) -> None:
    f = fleet_logs
    assert f.routed() == f.all_urls(), "the previous test left the fleet unsettled"
    before = {h.name: h.agent_pid() for h in f.hosts}
    workers_before = {h.name: h.worker_pids() for h in f.hosts}
    ok, failed = [0], []
    routed_seen: list[set[str]] = []
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                try:
                    resp = client.post(
                        f"{f.gateway}/v1/chat/completions",
                        json={
                            "model": MODEL,
                            "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": 8,
                        },
                    )
                except httpx.HTTPError as exc:
                    failed.append(repr(exc))
                    time.sleep(0.05)  # a refused connection fails at once: do not spin
                    continue
                if resp.status_code == 200:
                    ok[0] += 1
                else:
                    failed.append(f"{resp.status_code}: {resp.text[:200]}")
                    time.sleep(0.05)

    def watch() -> None:
        while not stop.is_set():
            with contextlib.suppress(httpx.HTTPError):
                routed_seen.append(f.routed())
            time.sleep(0.2)

    threads = [threading.Thread(target=load) for _ in range(3)]
    threads.append(threading.Thread(target=watch))
    for t in threads:
        t.start()
    t0 = time.monotonic()
    try:
        # The next version, and a changed farm.toml (the workers' environment): the
        # handler's farmctl reload restarts every worker, each out of the gateway first.
        r = f.play(f.v2, worker_env={"SGLANG_SIM_ROLLED": "1"})
    finally:
        print(f"rolling upgrade of {len(f.hosts)} hosts: {time.monotonic() - t0:.1f} s,", end=" ")
        print(f"{ok[0]} requests answered, {len(failed)} failed")
        stop.set()
        for t in threads:
            t.join(60)
    assert r.returncode == 0, r.stdout[-8000:] + r.stderr[-3000:]
    assert failed == [], f"{len(failed)} failed of {ok[0] + len(failed)}: {failed[:5]}"
    assert ok[0] > 0
    new = f.v2.name.split("_")[1]
    for h in f.hosts:
        assert h.version() == new
        assert h.agent_pid() not in (0, before[h.name]), "the upgrade did not restart the agent"
        # The reload (the handler) restarted every worker on the changed config.
        pids = h.worker_pids()
        assert 0 not in pids and not set(pids) & set(workers_before[h.name]), (h.name, pids)
        assert "SGLANG_SIM_ROLLED=1" in h.sh(f"tr '\\0' '\\n' < /proc/{pids[0]}/environ")
        assert h.worker_states() == dict.fromkeys(range(WORKERS), "ready")
    assert f.routed() == f.all_urls()
    # Host by host: each host was out of the gateway at some point, never both at once.
    a, b = (h.urls() for h in f.hosts)
    assert any(not (s & a) and s >= b for s in routed_seen), "host-a never drained alone"
    assert any(not (s & b) and s >= a for s in routed_seen), "host-b never drained alone"
    assert all(s for s in routed_seen), "the gateway was empty at some point"


# -- a second look (fleet review) ---------------------------------------------------------

ROLLED = {"SGLANG_SIM_ROLLED": "1"}  # the workers' environment since the rolling upgrade
NEW_GATEWAY = {"drain_timeout": "21s"}  # a [gateway] change: only an agent restart applies it


def _recap(out: str) -> dict[str, dict[str, int]]:
    """PLAY RECAP's counters per host: {"host-a": {"ok": 12, "changed": 1, ...}}."""
    recap: dict[str, dict[str, int]] = {}
    for line in out.split("PLAY RECAP", 1)[-1].splitlines()[1:]:
        host, _, counts = line.partition(" : ")
        if counts:
            recap[host.strip()] = {k: int(v) for k, v in (kv.split("=") for kv in counts.split())}
    return recap


def _status(h: Host) -> dict[str, Any]:
    status: dict[str, Any] = json.loads(h.sh("farmctl --json status"))
    return status


def test_a_rerun_applies_a_pending_config_and_leaves_an_unchanged_host_alone(
    fleet_logs: Fleet,
) -> None:
    """Fleet review #2 and #3. host-a: farm.toml on disk is the inventory's, but the agent
    runs another (reloaded from an edit, then the file put back, as a refused reload
    leaves it): the run reloads it. host-b: same package, same config, nothing pending:
    not drained, changed=0. Second review: host-b drained by hand stays drained (before,
    every run undrained it), and the run says so; `ansible-playbook --check` runs
    through (before, the status command was skipped and its rc undefined) and changes
    nothing."""
    f = fleet_logs
    a, b = f.hosts
    a.sh(
        "cp -p /etc/sglang-farm/farm.toml /root/farm.toml.ok"
        ' && sed -i \'s/SGLANG_SIM_ROLLED = "1"/SGLANG_SIM_ROLLED = "2"/\''
        " /etc/sglang-farm/farm.toml"
        " && farmctl reload --timeout 60"
        " && cp -p /root/farm.toml.ok /etc/sglang-farm/farm.toml",
        timeout=90,
    )
    assert _status(a)["config_pending"] is True
    assert "SGLANG_SIM_ROLLED=2" in a.sh(f"tr '\\0' '\\n' < /proc/{a.worker_pids()[0]}/environ")
    b_workers = b.worker_pids()
    b.sh("farmctl drain-host --timeout 30", timeout=60)  # an operator's own drain
    assert "held_out_since" in _status(b)
    checked = f.play(f.v2, worker_env=ROLLED, check=True)
    assert checked.returncode == 0, checked.stdout[-8000:] + checked.stderr[-3000:]
    assert _status(a)["config_pending"] is True and "held_out_since" not in _status(a)
    seen: list[set[str]] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            with contextlib.suppress(httpx.HTTPError):
                seen.append(f.routed())
            time.sleep(0.2)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        r = f.play(f.v2, worker_env=ROLLED)  # as the rolling upgrade left them
    finally:
        stop.set()
        watcher.join(30)
    assert r.returncode == 0, r.stdout[-8000:] + r.stderr[-3000:]
    recap = _recap(r.stdout)
    assert recap["host-b"]["changed"] == 0, recap
    assert recap["host-a"]["changed"] > 0, recap
    assert seen and not any(s & b.urls() for s in seen), "host-b was put back"
    assert "held_out_since" in _status(b), "the operator's drain was undone"
    assert "host-b was drained by hand" in r.stdout
    assert b.worker_pids() == b_workers
    st = _status(a)
    assert st["config_pending"] is False and "held_out_since" not in st
    assert "SGLANG_SIM_ROLLED=1" in a.sh(f"tr '\\0' '\\n' < /proc/{a.worker_pids()[0]}/environ")
    for h in f.hosts:  # the play's own drain marker is gone
        assert h.sh("ls /var/lib/sglang-farm/ansible-drained 2>/dev/null || true") == ""
    b.sh("farmctl undrain-host && farmctl wait --timeout 60", timeout=90)
    assert f.routed() == f.all_urls()


def test_a_gateway_change_restarts_the_agent_and_keeps_the_workers(fleet_logs: Fleet) -> None:
    """Fleet review #1: farmctl reload refuses a [gateway] change (exit 10): the handler
    restarts the agent, which adopts the running workers; before, the play failed at the
    first host with the new farm.toml on disk and not in force. A host whose farm in force
    has no gateway (mode "off" to "external") is not drained. Second review: host-b's
    package cache is gone (before: "Destination directory does not exist")."""
    f = fleet_logs
    # host-b runs without a gateway for now ([gateway] mode = "off", its agent restarted
    # by hand): the play switches it to "external". Its farm in force has nothing to
    # drain, whatever the new farm.toml says; before, drain-host was refused (exit 1).
    b = f.hosts[1]
    # Second review: its package cache cleaned (the play's check-mode probe copied the
    # package into a folder that was not there).
    b.sh(
        "rm -rf /var/cache/sglang-farm-deploy && "
        """sed -i 's/^mode = "external"/mode = "off"/' /etc/sglang-farm/farm.toml"""
        " && systemctl restart sglang-farm.service && farmctl wait --timeout 60",
        timeout=90,
    )
    assert _status(b)["gateway"] is None
    agents = {h.name: h.agent_pid() for h in f.hosts}
    workers = {h.name: h.worker_pids() for h in f.hosts}
    r = f.play(f.v2, worker_env=ROLLED, gateway=NEW_GATEWAY)
    assert r.returncode == 0, r.stdout[-8000:] + r.stderr[-3000:]
    for h in f.hosts:
        assert 'drain_timeout = "21s"' in h.sh("cat /etc/sglang-farm/farm.toml")
        assert h.agent_pid() not in (0, agents[h.name]), "the agent was not restarted"
        assert h.worker_pids() == workers[h.name], "the workers did not keep running"
        st = _status(h)
        assert st["config_pending"] is False and st["config_sha256"] == st["config_file_sha256"]
        assert {w["state"] for w in st["workers"]} == {"ready"}
    assert f.routed() == f.all_urls()


ROTATED_KEY = "ansible-test-rotated-key-9876543210"


def test_a_rotated_key_restarts_a_managed_gateway(fleet_logs: Fleet) -> None:
    """Second review #1: host-b runs its own managed gateway (the unit
    sglang-farm-gateway, its admin key read at the unit's start); the play rotates that
    key. The handler restarts the agent, then the gateway's unit: smg takes the new key
    and routes to host-b's workers. Before, smg kept the old key, every call of the
    agent's was refused (401) and farmctl wait failed."""
    f = fleet_logs
    b = f.hosts[1]
    port = free_port_block(2)
    managed = {
        "mode": "managed",
        "listen": f"127.0.0.1:{port}",
        "metrics_listen": f"127.0.0.1:{port + 1}",
        "extra_args": ["--shutdown-grace-period-secs", "2"],
    }
    lines = "\\n".join(f"{k} = {json.dumps(v)}" for k, v in managed.items())
    b.sh(  # switched by hand, its key still the fleet's
        f"""sed -i 's/^mode = "external"/{lines}/' /etc/sglang-farm/farm.toml"""
        " && systemctl restart sglang-farm.service && farmctl wait --timeout 90",
        timeout=150,
    )
    gw = f"http://127.0.0.1:{port}"

    def members(key: str) -> httpx.Response:
        return httpx.get(f"{gw}/workers", headers={"Authorization": f"Bearer {key}"}, timeout=5)

    assert members(ADMIN_KEY).status_code == 200
    r = f.play(
        f.v2,
        worker_env=ROLLED,
        gateway=NEW_GATEWAY,
        host_gateway={"host-b": managed},
        host_key={"host-b": ROTATED_KEY},
    )
    assert r.returncode == 0, r.stdout[-8000:] + r.stderr[-3000:]
    assert _recap(r.stdout)["host-a"]["changed"] == 0
    assert b.sh("cat /etc/sglang-farm/gateway-admin.key").strip() == ROTATED_KEY
    assert members(ADMIN_KEY).status_code == 401
    until(
        lambda: {w["url"] for w in members(ROTATED_KEY).json()["workers"]} == b.urls(),
        30,
        "host-b's workers in its own gateway, reached with the rotated key",
    )
    st = _status(b)
    assert st["gateway"]["up"] is True and "held_out_since" not in st
