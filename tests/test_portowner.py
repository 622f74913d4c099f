"""Whose socket listens on a port, read from the real /proc (portowner), and a worker's own pids."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from asuser import popen_as_nobody, require
from sglang_farm.host.listeners import OwnerKind, Ownership
from sglang_farm.host.portowner import ProcPortOwner, tree_pids
from sglang_farm.runtime.unit_procs import cgroup_pids, unit_cgroup, unit_pids

LISTENER = (
    "import socket, sys, time\n"
    "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
    "print(s.getsockname()[1], flush=True)\n"
    "time.sleep(60)\n"
)


@pytest.fixture
def listening() -> Iterator[socket.socket]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    with s:
        yield s


def _check(owner: ProcPortOwner, port: int, ours: frozenset[int], asked: list[int]) -> Ownership:
    async def pids() -> frozenset[int]:
        asked.append(1)
        return ours

    return asyncio.run(owner.check("127.0.0.1", port, pids))


def test_a_listener_of_the_workers_own_pid_is_ours_and_remembered(
    listening: socket.socket,
) -> None:
    port = listening.getsockname()[1]
    owner = ProcPortOwner()
    asked: list[int] = []
    first = _check(owner, port, frozenset({os.getpid()}), asked)
    assert first.kind is OwnerKind.OURS
    # The same socket again: no fd walk, the worker's pids are not even asked for.
    again = _check(owner, port, frozenset({os.getpid()}), asked)
    assert again.kind is OwnerKind.OURS
    assert asked == [1]


def test_a_listener_of_another_process_is_foreign_and_named(listening: socket.socket) -> None:
    port = listening.getsockname()[1]
    v = _check(ProcPortOwner(), port, frozenset({1}), [])
    assert v.kind is OwnerKind.FOREIGN
    assert v.pid == os.getpid()
    assert v.holder() == f"PID {os.getpid()} (user root)"


def test_nothing_listening_is_none() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, never listening: the port is known free of listeners
        port = s.getsockname()[1]
        v = _check(ProcPortOwner(), port, frozenset({os.getpid()}), [])
    assert v.kind is OwnerKind.NONE


def test_a_squatter_run_as_nobody_is_named_with_its_pid_and_user() -> None:
    require()
    proc = popen_as_nobody([sys.executable, "-I", "-c", LISTENER])
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        v = _check(ProcPortOwner(), port, frozenset({os.getpid()}), [])
        assert v.kind is OwnerKind.FOREIGN
        assert v.holder() == f"PID {proc.pid} (user nobody)"
    finally:
        proc.kill()
        proc.communicate(timeout=10)


def test_tree_pids_has_the_session_and_descendants_not_the_agent() -> None:
    # A session leader (as the process runtime starts a worker) with a child of its own.
    code = (
        "import subprocess, sys, time\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(c.pid, flush=True); time.sleep(60)\n"
    )
    leader = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert leader.stdout is not None
        child = int(leader.stdout.readline())
        pids = tree_pids(leader.pid)
        assert {leader.pid, child} <= pids
        assert os.getpid() not in pids
    finally:
        os.killpg(leader.pid, 9)
        leader.communicate(timeout=10)


def test_unit_cgroup_is_the_main_pids_cgroup_only_when_it_is_the_units(tmp_path: Path) -> None:
    (tmp_path / "42").mkdir()
    cg = "0::/system.slice/system-sglang.slice/sglang@3.service\n"
    (tmp_path / "42" / "cgroup").write_text(cg)
    assert unit_cgroup(42, "sglang@3.service", str(tmp_path)) == cg.strip()
    assert unit_cgroup(42, "sglang@4.service", str(tmp_path)) is None
    assert unit_cgroup(43, "sglang@3.service", str(tmp_path)) is None  # gone


def _procs(tmp: Path, cgroups: dict[int, str]) -> str:
    for pid, text in cgroups.items():
        (tmp / "proc" / str(pid)).mkdir(parents=True)
        (tmp / "proc" / str(pid) / "cgroup").write_text(text)
    return str(tmp / "proc")


def test_unit_pids_reads_the_units_cgroup_and_those_below(tmp_path: Path) -> None:
    proc = _procs(tmp_path, {10: "0::/system.slice/sglang@3.service\n"})
    unit = tmp_path / "cg" / "system.slice" / "sglang@3.service"
    (unit / "sub").mkdir(parents=True)
    (unit / "cgroup.procs").write_text("10\n11\n")
    (unit / "sub" / "cgroup.procs").write_text("12\n")
    assert unit_pids(10, "sglang@3.service", proc, str(tmp_path / "cg")) == {10, 11, 12}
    assert cgroup_pids("/system.slice/sglang@3.service", str(tmp_path / "cg")) == {10, 11, 12}


def test_unit_pids_on_a_hybrid_host_without_the_tree_mounted_compares_cgroups(
    tmp_path: Path,
) -> None:
    unit = "1:name=systemd:/system.slice/sglang@3.service"
    proc = _procs(
        tmp_path,
        {
            10: f"2:cpu:/\n{unit}\n0::/\n",
            11: f"2:cpu:/\n{unit}\n0::/\n",
            12: "2:cpu:/\n1:name=systemd:/system.slice/sglang@4.service\n0::/\n",
            13: "2:cpu:/\n1:name=systemd:/user.slice/user-65534.slice/session-3.scope\n",
        },
    )
    assert unit_pids(10, "sglang@3.service", proc, str(tmp_path / "none")) == {10, 11}


def test_a_fresh_check_sees_a_squatter_the_cached_reading_predates() -> None:
    """The merged farm called a squatter's 200 ready: the worker's old listener, verified
    ours, was still in a table read < 1 s before (the worker had just been restarted), so
    the readiness check answered "ours" for a port the squatter now held. A readiness
    check reads the tables afresh and trusts no earlier verdict."""
    require()
    owner = ProcPortOwner(clock=lambda: 0.0)  # every reading is "still fresh"
    old = socket.socket()
    old.bind(("127.0.0.1", 0))
    old.listen()
    port = old.getsockname()[1]
    me = frozenset({os.getpid()})
    assert _check(owner, port, me, []).kind is OwnerKind.OURS
    old.close()  # the worker is restarted; a squatter takes the port while it loads
    bind = f"s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('127.0.0.1', {port}))"
    code = LISTENER.replace("s.bind(('127.0.0.1', 0))", bind)
    with popen_as_nobody([sys.executable, "-I", "-c", code]) as squat:
        try:
            assert squat.stdout is not None and squat.stdout.readline().strip() == str(port)

            async def pids() -> frozenset[int]:
                return me

            # What the readiness check saw before: the cached reading, the verdict kept.
            assert _check(owner, port, me, []).kind is OwnerKind.OURS
            fresh = asyncio.run(owner.check("127.0.0.1", port, pids, fresh=True))
            want = (OwnerKind.FOREIGN, squat.pid, "nobody")
            assert (fresh.kind, fresh.pid, fresh.user) == want
        finally:
            squat.kill()


def test_the_beats_of_eight_workers_share_one_reading_of_the_listeners() -> None:
    """Issue 32, 4.8: one reading of the kernel's listeners per beat for every worker
    (`TABLE_TTL_S`), never one per worker; a readiness check (`fresh`) reads anew."""
    from sglang_farm.host.listeners import Listener
    from sglang_farm.host.portowner import TABLE_TTL_S

    now = [0.0]
    reads: list[float] = []
    mine = frozenset({os.getpid()})
    lo = ipaddress.IPv4Address("127.0.0.1")
    table = [Listener(lo, 30000 + w, os.geteuid(), 9000 + w) for w in range(8)]

    def read(proc: str) -> list[Listener]:
        reads.append(now[0])
        return table

    owner = ProcPortOwner(clock=lambda: now[0], read=read)

    async def ours() -> frozenset[int]:
        return mine

    async def beat(fresh: bool = False) -> list[Ownership]:
        return [await owner.check("127.0.0.1", 30000 + w, ours, fresh=fresh) for w in range(8)]

    async def scenario() -> None:
        # The first beat traces each socket (held by no process, owned by this test's
        # user: the worker's own), and the eight checks are answered from one reading.
        assert {v.kind for v in await beat()} == {OwnerKind.OURS}
        assert reads == [0.0]
        now[0] = TABLE_TTL_S / 2
        await beat()
        assert reads == [0.0]
        now[0] = TABLE_TTL_S
        await beat()
        assert reads == [0.0, TABLE_TTL_S]
        await beat(fresh=True)  # readiness: every check reads anew
        assert len(reads) == 2 + 8

    asyncio.run(scenario())


def test_a_listener_verified_as_one_workers_is_traced_again_for_another_worker(
    listening: socket.socket,
) -> None:
    """Review of issue 32: the cache of verified listeners was keyed by port alone, so a
    socket verified as worker 0's answered "ours" when worker 1 (after a reload gave it
    worker 0's port while worker 0 still listened there) asked: worker 1's API key would
    have gone to worker 0's process. A verdict holds for the worker it was traced for."""
    port = listening.getsockname()[1]
    owner = ProcPortOwner(clock=lambda: 0.0)  # every reading is "still fresh"

    async def mine() -> frozenset[int]:
        return frozenset({os.getpid()})

    async def another() -> frozenset[int]:
        return frozenset({1})

    first = asyncio.run(owner.check("127.0.0.1", port, mine, whose=0))
    assert first.kind is OwnerKind.OURS
    other = asyncio.run(owner.check("127.0.0.1", port, another, whose=1))
    assert (other.kind, other.pid) == (OwnerKind.FOREIGN, os.getpid())
    # Worker 0's own verdict is still remembered.
    assert asyncio.run(owner.check("127.0.0.1", port, another, whose=0)).kind is OwnerKind.OURS
