"""The Debian package, built, linted and installed for real (issue 7).

Once per run (tests/debbuild.py, shared with test_ansible.py): `packaging/build-deb
--no-lint` builds the .deb (several minutes when pip's cache is cold: pystemd and lxml
compile), or SF_DEB=/path/to.deb names one already built.
Then lintian must print no E: or W: line, and the package goes through its life in a
throwaway systemd container (tests/sdcontainer.py; no network: its dependencies are
the host's, already installed):

    apt-get install ./sglang-farm_*.deb (dependencies present: nothing to fetch)
    farm.toml -> 4 simulated workers as user sglang      systemctl start sglang-farm
    farmctl status: all ready; farmctl restart 3: only sglang@3 gets a new MainPID
    the exporter answers
    the gateway switched on as docs/install.md says (key file, [gateway], restart):
        sglang-farm-gateway.service runs the venv's smg; the workers are routed through it
    systemctl stop sglang-farm.target: no worker process left, the gateway stopped
    start again; apt-get remove: farm and gateway stopped, config and state kept
    apt-get purge: no unit (the rendered gateway unit included), no process, no file of ours;
        the kept worker user's home and the model cache in it survive

The tests of the container part run in file order and share one container: each
step builds on the one before (an install that failed fails everything after it).
"""

from __future__ import annotations

import json
import os
import posixpath
import shlex
import shutil
import subprocess
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

import debbuild
import sdcontainer
from sdcontainer import SystemdContainer

REPO = Path(__file__).resolve().parent.parent

pytestmark = [
    pytest.mark.slow,
    pytest.mark.systemd,
    # The first test pays for the build (pystemd and lxml compile: minutes on 2 cores).
    pytest.mark.timeout(1800),
]

VENV_PY = "/usr/lib/sglang-farm/venv/bin/python3"
WORKERS = 4
BASE_PORT = 30000
METRICS = "127.0.0.1:9840"
IN = "/root/deb"  # where the .deb is copied inside the container
GATEWAY = "sglang-farm-gateway.service"
GATEWAY_LISTEN = "127.0.0.1:8000"
ADMIN_KEY_FILE = "/etc/sglang-farm/gateway-admin.key"

FARM_TOML = textwrap.dedent(
    f"""
    # test_deb.py: four simulated workers, run by the package's own interpreter.
    [farm]
    python = "{VENV_PY}"
    module = "sglang_farm.sim"
    user = "sglang"
    group = "sglang"
    [farm.env]
    SGLANG_SIM_LOAD_SECONDS = "0.5"
    SGLANG_SIM_WARMUP_SECONDS = "0.2"
    SGLANG_SIM_HEALTH_DELAY = "0.05"
    SGLANG_SIM_DRAIN_SECONDS = "1"
    [workers]
    gpus = [{", ".join(str(i) for i in range(WORKERS))}]
    host = "127.0.0.1"
    base_port = {BASE_PORT}
    [startup]
    parallel = 4
    load_timeout = "60s"
    poll_interval = "200ms"
    [health]
    period = "1s"
    timeout = "5s"
    [restart]
    backoff_initial = "1s"
    stop_timeout = "10s"
    [metrics]
    listen = "{METRICS}"
    gpu_source = "fake"
    gpu_poll_interval = "1s"
    worker_poll_interval = "1s"
    [sglang]
    model_path = "sim/Qwen3.6-27B"
    """
)

# docs/install.md's [gateway] section; smg's shutdown grace shortened so stops stay quick.
GATEWAY_TOML = textwrap.dedent(
    f"""
    [gateway]
    mode = "managed"
    listen = "{GATEWAY_LISTEN}"
    admin_key_file = "{ADMIN_KEY_FILE}"
    extra_args = ["--shutdown-grace-period-secs", "2"]
    """
)

# GET or POST from inside the container with the system's python3: prints [status, body].
_HTTP = """
import json, sys, urllib.error, urllib.request
url, key, data = sys.argv[1], sys.argv[2], sys.argv[3]
headers = {"Authorization": f"Bearer {key}"} if key else {}
if data:
    headers["Content-Type"] = "application/json"
req = urllib.request.Request(url, data=data.encode() or None, headers=headers)
try:
    with urllib.request.urlopen(req, timeout=10) as r:
        status, body = r.status, r.read()
except urllib.error.HTTPError as exc:
    status, body = exc.code, exc.read()
except Exception as exc:
    status, body = type(exc).__name__, b""
try:
    out = json.loads(body)
except ValueError:
    out = body.decode("utf-8", "replace")
print(json.dumps([status, out]))
"""

T = TypeVar("T")


def _required() -> bool:
    return os.environ.get("SF_REQUIRE_SYSTEMD_CONTAINER") == "1"


def _skip_or_fail(reason: str) -> None:
    if _required():
        pytest.fail(f"{reason} (SF_REQUIRE_SYSTEMD_CONTAINER=1: this machine must run it)")
    pytest.skip(reason)


def poll(what: str, probe: Callable[[], tuple[bool, T]], timeout: float = 60.0) -> T:
    """Call `probe` until it says done; fail with its last observation at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        done, seen = probe()
        if done:
            return seen
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout:g}s; last seen: {seen!r}")
        time.sleep(0.2)


# -- build and lint (host) ----------------------------------------------------------------


@pytest.fixture(scope="module")
def deb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package: SF_DEB, or this run's build (tests/debbuild.py, shared with test_ansible)."""
    return debbuild.package(tmp_path_factory.mktemp("deb"))


def test_package_name_and_version_follow_the_project(deb: Path) -> None:
    from sglang_farm import __version__

    fields = subprocess.run(
        ["dpkg-deb", "--show", "--showformat=${Package} ${Version} ${Architecture}", str(deb)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    arch = subprocess.run(
        ["dpkg", "--print-architecture"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert fields == ["sglang-farm", __version__, arch]
    assert deb.name == f"sglang-farm_{__version__}_{arch}.deb"


def test_lintian_reports_no_error_and_no_warning(deb: Path) -> None:
    if shutil.which("lintian") is None:
        _skip_or_fail("lintian not found (apt-get install lintian)")
    r = subprocess.run(["lintian", str(deb)], capture_output=True, text=True, timeout=600)
    bad = [ln for ln in r.stdout.splitlines() if ln.startswith(("E:", "W:"))]
    assert bad == [], "lintian:\n" + r.stdout + r.stderr
    assert r.returncode == 0, r.stdout + r.stderr


# -- in the container ---------------------------------------------------------------------


class Box:
    """The container with the steps' shared observations."""

    def __init__(self, c: SystemdContainer, deb: Path) -> None:
        self.c = c
        self.deb = deb
        self.contents: list[str] = []  # paths in the .deb, absolute
        self.preexisting: set[str] = set()  # of those, the ones there before the install
        self.installed_files: list[str] = []  # dpkg -L before remove

    def sh(self, script: str, *, check: bool = True, timeout: float = 120.0) -> str:
        r = self.c.run(["sh", "-c", script], check=check, timeout=timeout)
        return r.stdout

    def existing(self, paths: list[str]) -> set[str]:
        """Which of `paths` exist inside (files, folders or dangling links)."""
        if not paths:
            return set()
        out = self.c.run(
            [
                "sh",
                "-c",
                'for p; do if [ -e "$p" ] || [ -L "$p" ]; then printf "%s\\n" "$p"; fi; done',
                "sh",
                *paths,
            ],
            timeout=60,
        ).stdout
        return set(out.splitlines())

    def main_pids(self) -> dict[str, int]:
        units = ["sglang-farm.service", *(f"sglang@{i}.service" for i in range(WORKERS))]
        out = self.sh(f"systemctl show -p Id -p MainPID {' '.join(units)}")
        pids: dict[str, int] = {}
        # One block per unit, blank-line separated, properties in systemd's own order.
        for block in out.strip().split("\n\n"):
            props = dict(ln.partition("=")[::2] for ln in block.splitlines())
            pids[props["Id"]] = int(props["MainPID"])
        return pids

    def farmctl_json(self, *args: str) -> tuple[int, Any]:
        r = self.c.run(["farmctl", "--json", *args], check=False, timeout=60)
        try:
            return r.returncode, json.loads(r.stdout)
        except json.JSONDecodeError:
            return r.returncode, (r.stdout + r.stderr).strip()

    def sim_processes(self) -> str:
        """Processes of the farm: its code ('[s]' keeps pgrep's own shell out) or its user."""
        return self.sh(
            "{ pgrep -a -f '[s]glang_farm'; pgrep -a -u sglang; } 2>/dev/null | sort -u || true"
        ).strip()

    def http(self, url: str, key: str = "", data: str = "") -> tuple[Any, Any]:
        r = self.c.run(["python3", "-c", _HTTP, url, key, data], check=False, timeout=30)
        try:
            status, body = json.loads(r.stdout)
        except json.JSONDecodeError:
            return f"no answer: {r.stderr.strip()[-300:]}", None
        return status, body

    def state(self, unit: str) -> str:
        return self.sh(f"systemctl is-active {unit} || true").strip()

    def wait_all_ready(self, timeout: float = 90.0) -> dict[int, str]:
        def probe() -> tuple[bool, Any]:
            rc, st = self.farmctl_json("status")
            if rc != 0 or not isinstance(st, dict):
                return False, (rc, st)
            states = {w["id"]: w["state"] for w in st.get("workers", [])}
            return states == dict.fromkeys(range(WORKERS), "ready"), states

        return poll("every worker ready (farmctl status)", probe, timeout)


@pytest.fixture(scope="module")
def box(deb: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Box]:
    sdcontainer.require_or_skip()
    with SystemdContainer() as c:
        b = Box(c, deb)
        stage = tmp_path_factory.mktemp("deb-stage")
        shutil.copy2(deb, stage / deb.name)
        c.copy_in(stage, IN)
        listing = subprocess.run(
            ["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True, check=True
        ).stdout
        names = subprocess.run(
            ["tar", "-tf", "-"], input=listing, capture_output=True, check=True
        ).stdout.decode()
        paths = {posixpath.normpath("/" + n) for n in names.splitlines()}
        b.contents = sorted(paths - {"/"})
        b.preexisting = b.existing(b.contents)
        # A Docker-built host has /usr/sbin/policy-rc.d answering 101 ("no service actions
        # from maintainer scripts"), which deb-systemd-invoke obeys; a GPU host has none.
        # Removed inside the overlay only.
        b.sh("rm -f /usr/sbin/policy-rc.d")
        yield b


@pytest.fixture
def sd_box(box: Box, request: pytest.FixtureRequest) -> Iterator[Box]:
    """The module's container; prints its journal when the test using it fails."""
    failed_before = request.session.testsfailed
    yield box
    if request.session.testsfailed > failed_before:
        print(f"===== journal of container {box.c.name} =====")
        print(box.c.journal(lines=200))


def test_install_starts_nothing_and_enables_nothing(sd_box: Box) -> None:
    from sglang_farm import __version__

    b = sd_box
    b.sh(
        f"DEBIAN_FRONTEND=noninteractive apt-get install -y {IN}/{b.deb.name}",
        timeout=300,
    )
    assert b.sh("dpkg-query -W -f '${Status}' sglang-farm") == "install ok installed"
    # The service's [Install] has only Also=sglang-farm.target: "indirect" = not enabled.
    for unit, expected in (("sglang-farm.service", "indirect"), ("sglang-farm.target", "disabled")):
        state = b.sh(f"systemctl is-enabled {unit} || true").strip()
        assert state == expected, f"{unit} is {state!r} after install"
        active = b.sh(f"systemctl is-active {unit} || true").strip()
        assert active == "inactive", f"{unit} is {active!r} after install"
    assert b.sim_processes() == ""
    # The user and groups, the conffile, the man pages and the completion are in place.
    assert b.sh("id -nu sglang && id -ng sglang && getent group sglang-farm | cut -d: -f1") == (
        "sglang\nsglang\nsglang-farm\n"
    )
    assert b.sh("stat -c '%U %G %a' /var/lib/sglang").strip() == "sglang sglang 750"
    assert b.sh("dpkg-query -W -f '${Conffiles}' sglang-farm").split()[0] == (
        "/etc/sglang-farm/farm.toml"
    )
    for page in ("man8/sglang-farm.8.gz", "man1/farmctl.1.gz", "man5/farm.toml.5.gz"):
        b.sh(f"test -s /usr/share/man/{page}")
    b.sh("grep -q _FARMCTL_COMPLETE /usr/share/bash-completion/completions/farmctl")
    b.sh("test -s /usr/share/sglang-farm/alerts.yml")
    b.sh("test -s /usr/share/sglang-farm/sglang-farm.json")
    # The wrappers run the private venv's code, with its own (compiled) libraries.
    assert b.sh("sglang-farm --version").strip() == f"sglang-farm, version {__version__}"
    where = b.sh(f"{VENV_PY} -I -c 'import pystemd, lxml; print(pystemd.__file__, lxml.__file__)'")
    assert where.count("/usr/lib/sglang-farm/venv/lib/python3.11/site-packages/") == 2, where
    # The shipped example is valid; without a GPU its only problem is gpus = "all" (NVML).
    out = b.sh("sglang-farm check-config --config /etc/sglang-farm/farm.toml 2>&1 || true")
    assert ": OK, " in out or ("1 problem" in out and 'gpus = "all" needs NVML' in out), out


def test_farm_starts_all_workers_and_restarts_only_the_named_one(sd_box: Box) -> None:
    b = sd_box
    b.c.write_file("/etc/sglang-farm/farm.toml", FARM_TOML)
    b.sh("sglang-farm check-config")
    b.sh("systemctl start --no-block sglang-farm")
    b.wait_all_ready()
    poll(
        "sglang-farm.service active (READY=1 sent)",
        lambda: (lambda s: (s == "active", s))(
            b.sh("systemctl is-active sglang-farm.service || true").strip()
        ),
    )
    before = b.main_pids()
    assert all(pid > 0 for pid in before.values()), before
    # Workers run as the package's user, from the package's interpreter.
    users = b.sh(f"ps -o user= -p {before['sglang@0.service']}").strip()
    assert users == "sglang"

    r = b.c.run(["farmctl", "restart", "3", "--timeout", "60"], check=False, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    b.wait_all_ready()
    after = b.main_pids()
    changed = sorted(u for u in before if before[u] != after[u])
    assert changed == ["sglang@3.service"], f"before {before}, after {after}"


def test_exporter_answers_on_its_port(sd_box: Box) -> None:
    fetch = (
        "python3 -c 'import urllib.request, sys; sys.stdout.write(urllib.request.urlopen("
        f'"http://{METRICS}/metrics", timeout=5).read().decode())\''
    )

    def probe() -> tuple[bool, str]:
        body = sd_box.sh(fetch)
        ready = [
            ln
            for ln in body.splitlines()
            if ln.startswith("sglang_farm_worker_state{") and 'state="ready"' in ln
        ]
        return sum(ln.endswith(" 1.0") for ln in ready) == WORKERS, "\n".join(ready) or body

    poll("the exporter shows every worker ready", probe, 30)


def test_gateway_switched_on_in_one_step_routes_to_every_worker(sd_box: Box) -> None:
    b = sd_box
    # The package's venv carries smg, without what only `smg serve` needs (debian/rules);
    # PyYAML is there for huggingface_hub ([model] from the Hub), as pure Python.
    found = b.sh(
        f"{VENV_PY} -I -c 'import importlib.util as u, yaml; "
        'print([m for m in ("smg", "setproctitle", "grpc", "yaml") if u.find_spec(m)], '
        "yaml.__with_libyaml__)'"
    )
    assert found.strip() == "['smg', 'setproctitle', 'yaml'] False", found
    # docs/install.md, "Put the gateway in front": a random key in a root-only file, the
    # [gateway] section, then a restart of the agent (the workers keep serving).
    b.sh(
        f"install -m 600 /dev/null {ADMIN_KEY_FILE} && "
        f"python3 -c 'import secrets; print(secrets.token_hex(32))' > {ADMIN_KEY_FILE}"
    )
    key = b.sh(f"cat {ADMIN_KEY_FILE}").strip()
    b.c.write_file("/etc/sglang-farm/farm.toml", FARM_TOML + GATEWAY_TOML)
    b.sh("sglang-farm check-config")
    b.sh("systemctl restart sglang-farm", timeout=120)
    poll(f"{GATEWAY} active", lambda: (lambda s: (s == "active", s))(b.state(GATEWAY)))
    urls = {f"http://127.0.0.1:{BASE_PORT + i}" for i in range(WORKERS)}

    def routed() -> tuple[bool, Any]:
        status, body = b.http(f"http://{GATEWAY_LISTEN}/workers", key)
        if status != 200 or not isinstance(body, dict):
            return False, (status, body)
        got = {w["url"].rstrip("/"): w["status"] for w in body["workers"]}
        return got == dict.fromkeys(urls, "ready"), got

    poll("every worker ready in the gateway", routed, 60)
    # One URL for users: a chat completion through the gateway, answered by a worker.
    request = json.dumps(
        {
            "model": "sim/Qwen3.6-27B",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
        }
    )
    status, body = b.http(f"http://{GATEWAY_LISTEN}/v1/chat/completions", data=request)
    assert status == 200 and body["choices"], (status, body)
    # The gateway's own user, and its key nowhere in its unit or command line.
    pid = b.sh(f"systemctl show -p MainPID --value {GATEWAY}").strip()
    assert b.sh(f"stat -c %u /proc/{pid}").strip() != "0"
    shown = b.sh(f"systemctl cat {GATEWAY}; systemctl show {GATEWAY}; cat /proc/{pid}/cmdline")
    assert key not in shown


def test_stopping_the_target_leaves_no_worker_process(sd_box: Box) -> None:
    b = sd_box
    b.sh("systemctl stop sglang-farm.target", timeout=120)
    poll("no simulator process left", lambda: (lambda p: (p == "", p))(b.sim_processes()), 30)
    states = b.sh(
        "systemctl show -p ActiveState --value sglang-farm.service "
        + " ".join(f"sglang@{i}.service" for i in range(WORKERS))
    ).split()
    assert set(states) == {"inactive"}, states
    # The gateway is PartOf= the target (systemctl waits only for the target's own job;
    # smg exits after its 5 s propagation window and the 2 s grace it was given).
    poll(
        f"{GATEWAY} stopped with the target",
        lambda: (lambda s: (s == "inactive", s))(b.state(GATEWAY)),
        30,
    )


def test_remove_stops_the_farm_and_keeps_config_and_state(sd_box: Box) -> None:
    b = sd_box
    b.sh("systemctl start --no-block sglang-farm")
    b.wait_all_ready()
    listed = {posixpath.normpath(p) for p in b.sh("dpkg -L sglang-farm").splitlines()}
    b.installed_files = sorted(p for p in listed if p.startswith("/") and p != "/")
    b.sh("DEBIAN_FRONTEND=noninteractive apt-get remove -y sglang-farm", timeout=300)
    poll("no farm process after remove", lambda: (lambda p: (p == "", p))(b.sim_processes()), 30)
    assert b.sh("systemctl is-active sglang-farm.service || true").strip() in ("inactive", "failed")
    poll(
        f"{GATEWAY} stopped by the remove",
        lambda: (lambda s: (s in ("inactive", "failed", "unknown"), s))(b.state(GATEWAY)),
        30,
    )
    b.sh("test -f /etc/sglang-farm/farm.toml && test -d /var/lib/sglang-farm")
    assert b.sh("dpkg-query -W -f '${Status}' sglang-farm") == "deinstall ok config-files"


# A model in the worker user's Hugging Face cache: hours of download, not the package's.
HF_MODEL = "/var/lib/sglang/.cache/huggingface/hub/models--org--m/blobs/weights"


def test_purge_leaves_no_unit_no_process_and_no_file(sd_box: Box) -> None:
    b = sd_box
    b.sh(f"install -d -o sglang -g sglang {posixpath.dirname(HF_MODEL)}")
    b.sh(f"echo weights > {HF_MODEL} && chown sglang:sglang {HF_MODEL}")
    b.sh("DEBIAN_FRONTEND=noninteractive apt-get purge -y sglang-farm", timeout=300)
    assert b.sim_processes() == ""
    # The worker user is kept, and so are its home and the model cache in it.
    assert b.sh("getent passwd sglang | cut -d: -f6").strip() == "/var/lib/sglang"
    assert b.sh(f"cat {HF_MODEL}").strip() == "weights"
    assert b.sh("stat -c '%U %G' /var/lib/sglang").strip() == "sglang sglang"
    ours = sorted(
        {
            *b.contents,
            *b.installed_files,
            "/etc/sglang-farm",
            "/var/lib/sglang-farm",
            "/run/sglang-farm",
            "/usr/lib/sglang-farm",
        }
    )
    extra = b.sh(
        "ls -d /run/systemd/system/sglang* /etc/systemd/system/sglang* "
        "/etc/systemd/system/*/sglang* /var/lib/systemd/deb-systemd-helper-enabled/*sglang* "
        "/var/lib/systemd/deb-systemd-helper-enabled/*/sglang* 2>/dev/null || true"
    ).split()
    left = sorted((b.existing(ours) - b.preexisting) | set(extra))
    assert left == [], "left after purge: " + shlex.join(left)
    units = b.sh(
        # Both exit 1 when nothing matches.
        "systemctl list-units --all --no-legend --plain 'sglang*' || true; "
        "systemctl list-unit-files --no-legend --plain 'sglang*' || true"
    ).strip()
    assert units == "", units
    status = b.sh("dpkg-query -W -f '${Status}' sglang-farm 2>&1 || true")
    assert "no packages found" in status or status.endswith("not-installed"), status
