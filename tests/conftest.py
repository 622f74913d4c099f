"""Shared pytest options and fixtures; the order modules run in; a note on long silences.

The fixtures two or more test modules use are defined here (at the end), pytest gives
them to every module; a test module imports no fixture and no other test module
(test_test_tree.py holds it).

`./scripts/test` runs the suite on several pytest-xdist workers, a whole module per
worker (`--dist loadfile --no-loadscopereorder`: module fixtures such as one systemd
container, one farm or one .deb are set up once and their steps stay in file order).
The run then lasts as long as its longest lane, so the modules that take longest run
first (`LONGEST_FIRST`) and the many quick ones fill the other workers around them.

A long test (the .deb's build, the soak) prints nothing for minutes; when no test has
finished for `QUIET_S` seconds (SF_QUIET_S overrides; 0: never), a line names what is
still running and for how long.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from asuser import shared_folder
from farmproc import tmpdir
from sdcontainer import SystemdContainer, booted
from simproc import StartSim, started_sims

# The slowest modules, slowest first (measured: `pytest --durations=80` on the 2-core CI
# machine; the .deb's first build compiles pystemd and lxml). Only the order changes: a
# module not named runs after these, in file order.
LONGEST_FIRST = (
    "test_deb.py",
    "test_ansible.py",
    "test_soak.py",
    "test_readme_walkthrough.py",
    "test_systemd_farm.py",
    "test_gateway_trust.py",
    "test_sim.py",
    "test_frontdoor.py",
    "test_port_squat.py",
    "test_farm_process.py",
    "test_systemd_squat.py",
    "test_systemd_staging.py",
    "test_liveness_e2e.py",
    "test_gateway_multi_e2e.py",  # two smg and two farms: ~35 s alone
    "test_gateway_routing_smg.py",  # four smg, two with a filled simulator: ~20 s alone
    "test_systemd_runtime.py",
    "test_exporter_farm.py",
    "test_gateway_child.py",
    "test_exporter.py",
    "test_canary_e2e.py",
    "test_units.py",
    "test_systemd_gateway_key.py",
)
QUIET_S = float(os.environ.get("SF_QUIET_S", "30"))
# What a module's long silence is, said beside its tests in the "still running" lines.
LONG_STEPS = {
    "tests/test_deb.py": "building the .deb first: pystemd and lxml compile, minutes when pip's"
    " cache is cold",
    "tests/test_ansible.py": "the first test waits for the run's one .deb build"
    " (tests/debbuild.py); the playbook runs take minutes",
    "tests/test_soak.py": "the chaos soak runs 2 minutes",
}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden",
        action="store_true",
        default=False,
        help="rewrite the golden files under tests/golden/ from the current output",
    )


@pytest.fixture
def update_golden(request: pytest.FixtureRequest) -> bool:
    """True when the run was started with `--update-golden`."""
    return bool(request.config.getoption("--update-golden"))


def _rank(item: pytest.Item) -> int:
    name = item.path.name
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest modules first; a stable sort keeps each module's own order."""
    items.sort(key=_rank)


class StillRunning:
    """Writes, after `quiet_s` without a finished test, which tests run and since when.

    It writes to a copy of the terminal's descriptor taken at start: while a test runs,
    pytest's capture has the descriptor 1 itself.
    """

    def __init__(self, fd: int, quiet_s: float) -> None:
        self.fd = fd
        self.quiet_s = quiet_s
        self.started = time.monotonic()
        self.last = self.started
        self.running: dict[str, float] = {}
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="still-running", daemon=True)

    def start(self, nodeid: str) -> None:
        with self.lock:
            self.running[nodeid] = time.monotonic()

    def finish(self, nodeid: str) -> None:
        with self.lock:
            self.running.pop(nodeid, None)
            self.last = time.monotonic()

    def _watch(self) -> None:
        while not self.done.wait(1.0):
            now = time.monotonic()
            with self.lock:
                if now - self.last < self.quiet_s or not self.running:
                    continue
                self.last = now
                tests = sorted(self.running.items(), key=lambda kv: kv[1])
            lines = [f"\n[{_mmss(now - self.started)}] no test finished for {self.quiet_s:g} s;"]
            for nodeid, t0 in tests:
                step = LONG_STEPS.get(nodeid.split("::")[0])
                why = f" ({step})" if step else ""
                lines.append(f"  still running ({_mmss(now - t0)}): {nodeid}{why}")
            os.write(self.fd, ("\n".join(lines) + "\n").encode())


def _mmss(seconds: float) -> str:
    return f"{int(seconds) // 60}m{int(seconds) % 60:02d}s"


_still: StillRunning | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _still
    worker = hasattr(config, "workerinput")  # a pytest-xdist worker: its controller reports
    if worker or config.getoption("collectonly") or QUIET_S <= 0:
        return
    _still = StillRunning(os.dup(1), QUIET_S)
    _still.thread.start()


def pytest_unconfigure(config: pytest.Config) -> None:
    global _still
    if _still is not None:
        _still.done.set()
        _still.thread.join()
        os.close(_still.fd)
        _still = None


def pytest_runtest_logstart(nodeid: str) -> None:
    if _still is not None:
        _still.start(nodeid)


def pytest_runtest_logfinish(nodeid: str) -> None:
    if _still is not None:
        _still.finish(nodeid)


@pytest.fixture
def sockets() -> Iterator[list[socket.socket]]:
    """Sockets a test opens (listeners it holds), closed after it."""
    held: list[socket.socket] = []
    yield held
    for s in held:
        s.close()


# -- the fixtures test modules share (a module imports no fixture: test_test_tree.py) ------


@pytest.fixture
def tmp(tmp_path: Path) -> Iterator[Path]:
    """The farm's folder (state, control socket) for a test on the harness's virtual clock
    (agent_harness.py): pytest's `tmp_path`, kept after the run for a look at a failure.
    Its path is long: nothing binds a socket in it there."""
    yield tmp_path


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """The folder of a farm run as real processes (farmproc.py): short (`tmpdir`), since
    the agent binds its control socket in it and an AF_UNIX path must stay under 107
    bytes (pytest's `tmp_path` can be longer); removed afterwards."""
    d = tmpdir()
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A root-owned folder anyone may write, as /tmp is (asuser.shared_folder), for the
    trust tests that play another local user."""
    with shared_folder() as d:
        yield d


@pytest.fixture
def sims() -> Iterator[StartSim]:
    """Start a simulator process with these flags (simproc.Sim); each is killed at teardown."""
    with started_sims() as start:
        yield start


@pytest.fixture(scope="module")
def sd_container() -> Iterator[SystemdContainer]:
    """One booted systemd container per test module (booting costs seconds; sdcontainer.py)."""
    with booted() as c:
        yield c


@pytest.fixture
def sd(
    sd_container: SystemdContainer, request: pytest.FixtureRequest
) -> Iterator[SystemdContainer]:
    """The module's container; prints its journal when the test using it fails."""
    failed_before = request.session.testsfailed
    yield sd_container
    # The call phase's report is logged before teardown runs, so a failure is counted by now.
    if request.session.testsfailed > failed_before:
        print(f"===== journal of container {sd_container.name} =====")
        print(sd_container.journal(lines=150))
