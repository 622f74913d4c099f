"""The process runtime with real child processes: stop order, group kills, PID reuse, farm.user."""

from __future__ import annotations

import asyncio
import os
import pwd
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from async_wait import wait_until
from sglang_farm.errors import RuntimeFailure
from sglang_farm.runtime import Exited, LogLine, RuntimeEvent, Started
from sglang_farm.runtime.process import ProcessRuntime, worker_identity
from sglang_farm.sglang.argv import Command
from sglang_farm.spec import FarmSection, FarmSpec

# A worker shaped like SGLang: a main process with a child in its process group (the
# scheduler). On SIGTERM the main drains, then ends its child and exits, as SGLang's
# does (mode "drain"); in mode "stubborn" both ignore SIGTERM. Each records what
# happened, in order, in the log file named by argv[1].
WORKER = r"""
import os, signal, subprocess, sys, time
log, mode = sys.argv[1], sys.argv[2]

def record(what):
    with open(log, "a") as f:
        f.write(what + "\n")

CHILD = '''
import signal, sys, time
def term(*_):
    with open(sys.argv[1], "a") as f:
        f.write("child-term\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN if sys.argv[2] == "stubborn" else term)
while True:
    time.sleep(0.02)
'''
child = subprocess.Popen([sys.executable, "-c", CHILD, log, mode])

def term(*_):
    record("main-term")
    time.sleep(0.3)  # the drain: in-flight requests finish
    record("drain-done")
    child.terminate()
    child.wait()
    record("main-exit")
    sys.exit(0)

signal.signal(signal.SIGTERM, signal.SIG_IGN if mode == "stubborn" else term)
time.sleep(0.2)  # let the child install its handler
print(f"ready child={child.pid}", flush=True)
if mode == "exit":
    sys.exit(3)  # leaves its child behind
while True:
    time.sleep(0.02)
"""


class Recorder:
    def __init__(self) -> None:
        self.events: list[RuntimeEvent] = []

    def __call__(self, event: RuntimeEvent) -> None:
        self.events.append(event)

    def lines(self) -> list[str]:
        return [e.text for e in self.events if isinstance(e, LogLine)]

    def exited(self) -> list[Exited]:
        return [e for e in self.events if isinstance(e, Exited)]

    def pid(self) -> int:
        started = [e.pid for e in self.events if isinstance(e, Started)]
        assert started and started[0] is not None
        return started[0]


def proc_state(pid: int) -> str | None:
    """The process's state letter (R, S, T, Z, ...), or None once it is reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2]


def alive(pid: int) -> bool:
    return proc_state(pid) not in (None, "Z", "X")


async def start_worker(tmp_path: Path, mode: str) -> tuple[ProcessRuntime, Recorder, Path, int]:
    rec = Recorder()
    rt = ProcessRuntime(rec)
    log = tmp_path / "order.log"
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    await rt.start(0, Command(argv=(sys.executable, str(script), str(log), mode), env=()))
    await wait_until(lambda: any(line.startswith("ready") for line in rec.lines()))
    child = int(next(x for x in rec.lines() if x.startswith("ready")).split("=")[1])
    return rt, rec, log, child


async def test_stop_terminates_the_main_process_only_so_it_drains_before_its_children_stop(
    tmp_path: Path,
) -> None:
    rt, rec, log, child = await start_worker(tmp_path, "drain")
    try:
        await rt.stop(0, 10)
    finally:
        await rt.close()
    # SGLang's scheduler is stopped by its main process after the drain, not beside it.
    assert log.read_text().split() == ["main-term", "drain-done", "child-term", "main-exit"]
    assert [e.status for e in rec.exited()] == [0]
    assert not alive(child)


async def test_stop_kills_the_whole_group_at_the_deadline(tmp_path: Path) -> None:
    rt, rec, log, child = await start_worker(tmp_path, "stubborn")
    main = rec.pid()
    t0 = time.monotonic()
    try:
        await rt.stop(0, 0.5)
    finally:
        await rt.close()
    assert time.monotonic() - t0 < 5
    assert [e.status for e in rec.exited()] == [-signal.SIGKILL]
    assert not alive(main) and not alive(child)
    assert not log.exists()  # neither drained: they were killed


async def test_stop_continues_a_stopped_worker_so_that_it_drains(tmp_path: Path) -> None:
    rt, rec, log, _ = await start_worker(tmp_path, "drain")
    os.kill(rec.pid(), signal.SIGSTOP)  # hung, as a SIGSTOPped worker is
    await wait_until(lambda: proc_state(rec.pid()) == "T")
    t0 = time.monotonic()
    try:
        await rt.stop(0, 10)
    finally:
        await rt.close()
    assert time.monotonic() - t0 < 5  # drained, not killed at the deadline
    assert log.read_text().split() == ["main-term", "drain-done", "child-term", "main-exit"]
    assert [e.status for e in rec.exited()] == [0]


async def test_a_main_process_that_exits_on_its_own_takes_its_orphans_with_it(
    tmp_path: Path,
) -> None:
    rt, rec, _, child = await start_worker(tmp_path, "exit")
    try:
        await wait_until(lambda: bool(rec.exited()))
    finally:
        await rt.close()
    assert [e.status for e in rec.exited()] == [3]
    assert not alive(child)  # orphaned schedulers would keep holding GPU memory


def _set_next_pid(pid: int) -> None:
    Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))


def _hold_the_loop_until_exit_then_take_the_pid(
    pid: int,
) -> tuple[bool, subprocess.Popen[bytes] | None]:
    """Called from the test's coroutine: blocks the event loop until `pid` exits.

    Returns whether the pid was still pinned (a zombie, not reaped behind the runtime's
    back) and a session leader started with that pid if it was free (else any pid).
    """
    end = time.monotonic() + 10
    while proc_state(pid) not in (None, "Z") and time.monotonic() < end:
        time.sleep(0.01)
    pinned = proc_state(pid) == "Z"
    for _ in range(20):  # other processes on the host may take the number first
        _set_next_pid(pid)
        decoy = subprocess.Popen(["sleep", "30"], start_new_session=True)
        if decoy.pid == pid or pinned:
            return pinned, decoy
        decoy.kill()
        decoy.wait()
    return pinned, None


async def test_a_process_that_reuses_a_dead_workers_pid_is_never_signalled() -> None:
    """The group is signalled by number only while its leader is unreaped (its pid pinned).

    The event loop is held (as a busy agent's can be) while the worker exits; then an
    unrelated session leader is started with the dead worker's number, if that number
    is free to take. It must survive the agent noticing the exit.
    """
    if not os.access("/proc/sys/kernel/ns_last_pid", os.W_OK):
        pytest.skip("needs to choose the next PID (/proc/sys/kernel/ns_last_pid, as root)")
    rec = Recorder()
    rt = ProcessRuntime(rec)
    await rt.start(0, Command(argv=(sys.executable, "-c", "import time; time.sleep(0.3)"), env=()))
    pid = rec.pid()
    decoy: subprocess.Popen[bytes] | None = None
    try:
        pinned, decoy = _hold_the_loop_until_exit_then_take_the_pid(pid)
        if decoy is None:
            pytest.skip("could not start a process with the freed PID (the host is busy)")
        assert pinned or decoy.pid == pid
        await wait_until(lambda: bool(rec.exited()))
        await asyncio.sleep(0.3)
        assert decoy.poll() is None, "the agent killed an unrelated process that reused the PID"
        assert [e.status for e in rec.exited()] == [0]
    finally:
        if decoy is not None:
            decoy.kill()
            decoy.wait()
        await rt.close()


# --- farm.user ---------------------------------------------------------------------


def _spec(user: str, group: str) -> FarmSpec:
    return FarmSpec(source="test", farm=FarmSection(user=user, group=group), workers=())


def test_a_root_agent_resolves_the_worker_user_with_its_groups_and_home() -> None:
    nobody = pwd.getpwnam("nobody")
    who = worker_identity("nobody", "nogroup", euid=0)
    assert who is not None
    assert (who.uid, who.gid, who.home) == (nobody.pw_uid, 65534, nobody.pw_dir)
    assert who.gid in who.groups


def test_a_root_agent_with_user_root_runs_workers_as_itself() -> None:
    assert worker_identity("root", "root", euid=0) is None


@pytest.mark.parametrize(
    ("user", "group", "what"),
    [("no-such-user-xyz", "nogroup", "user"), ("nobody", "no-such-group-xyz", "group")],
)
def test_an_unknown_worker_user_or_group_is_refused_naming_it_and_the_fix(
    user: str, group: str, what: str
) -> None:
    with pytest.raises(RuntimeFailure) as err:
        worker_identity(user, group, euid=0)
    msg = str(err.value)
    assert f"[farm] {what}" in msg and (user if what == "user" else group) in msg
    assert "create" in msg and "set [farm] user" in msg


def test_an_unprivileged_agent_runs_workers_as_itself() -> None:
    assert worker_identity("nobody", "nogroup", euid=12345) is None


async def test_an_unprivileged_agent_says_at_prepare_that_farm_user_is_not_applied(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 12345)
    rt = ProcessRuntime(Recorder())
    with capture_logs() as logs:
        await rt.prepare(_spec("sglang", "sglang"), {})
        await rt.prepare(_spec("sglang", "sglang"), {})  # said once, not at every launch
    warnings = [e for e in logs if e["event"] == "worker_user_not_applied"]
    assert len(warnings) == 1 and warnings[0]["user"] == "sglang"


async def test_a_root_agent_refuses_at_prepare_a_worker_user_that_does_not_exist() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    rt = ProcessRuntime(Recorder())
    with pytest.raises(RuntimeFailure, match="no-such-user-xyz"):
        await rt.prepare(_spec("no-such-user-xyz", "nogroup"), {})


async def test_a_root_agent_runs_workers_as_the_farm_user() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: only root can run workers as another user")
    rec = Recorder()
    rt = ProcessRuntime(rec)
    await rt.prepare(_spec("nobody", "nogroup"), {})
    shell = 'echo "uid=$(id -u) gid=$(id -g) groups=$(id -G) home=$HOME user=$USER"'
    await rt.start(0, Command(argv=("/bin/sh", "-c", shell), env=()))
    try:
        await wait_until(lambda: bool(rec.exited()))
    finally:
        await rt.close()
    nobody = pwd.getpwnam("nobody")
    assert rec.lines() == [
        f"uid={nobody.pw_uid} gid=65534 groups=65534 home={nobody.pw_dir} user=nobody"
    ]


@pytest.mark.skipif(
    not os.path.exists("/usr/bin/python3"), reason="no system Python that nobody may run"
)
async def test_a_worker_run_as_the_farm_user_still_dies_with_the_agent() -> None:
    """PR_SET_PDEATHSIG is cleared by a change of credentials: it must be set after the
    switch to [farm] user, or a `kill -9` of the agent leaves the worker running."""
    if os.geteuid() != 0:
        pytest.skip("needs root: only root can run workers as another user")
    rec = Recorder()
    rt = ProcessRuntime(rec)
    await rt.prepare(_spec("nobody", "nogroup"), {})
    code = (
        "import ctypes, os; sig = ctypes.c_int(); "
        "ctypes.CDLL(None).prctl(2, ctypes.byref(sig), 0, 0, 0); "  # PR_GET_PDEATHSIG
        "print(f'uid={os.getuid()} pdeathsig={sig.value}')"
    )
    # The system interpreter: nobody may not enter the test venv (under /root on CI).
    await rt.start(0, Command(argv=("/usr/bin/python3", "-I", "-c", code), env=()))
    try:
        await wait_until(lambda: bool(rec.exited()))
    finally:
        await rt.close()
    assert rec.lines() == [f"uid={pwd.getpwnam('nobody').pw_uid} pdeathsig={int(signal.SIGKILL)}"]
