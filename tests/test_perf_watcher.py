"""Structural: the process runtime watches N workers' exits without a thread per worker.

Issue 17: the agent had one child-watcher thread per worker process (68 threads at 64
workers). Exits are now watched by the event loop (pidfds, or a timer where pidfds are
missing); these tests count the threads and check that exit statuses stay exact.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from sglang_farm.runtime import Exited, RuntimeEvent
from sglang_farm.runtime.process import ProcessRuntime
from sglang_farm.sglang.argv import Command

N = 24

# Exits with the code given as argv[1] once the file argv[2] exists ("-" waits for a signal).
CHILD = r"""
import os, sys, time
code, gate = sys.argv[1], sys.argv[2]
print("up", flush=True)
while not os.path.exists(gate):
    time.sleep(0.02)
if code != "-":
    sys.exit(int(code))
time.sleep(60)
"""


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


async def _run_many(gate: str) -> tuple[int, int, dict[int, int | None]]:
    """Start N workers, count threads while they run, let them end: (before, during, statuses)."""
    events: list[RuntimeEvent] = []
    rt = ProcessRuntime(events.append)
    before = os_threads()
    try:
        for w in range(N):
            code = "-" if w % 3 == 0 else str(w % 7)
            argv = (sys.executable, "-c", CHILD, code, gate)
            await rt.start(w, Command(argv=argv, env=()))
        end = time.monotonic() + 30
        while sum(1 for e in events if getattr(e, "text", None) == "up") < N:
            assert time.monotonic() < end, "workers did not come up"
            await asyncio.sleep(0.05)
        during = os_threads()
        for w in range(0, N, 3):  # the "-" ones: killed by a signal
            os.kill(rt._procs[w].pid, signal.SIGKILL)
        await asyncio.to_thread(Path(gate).touch)
        end = time.monotonic() + 30
        while len([e for e in events if isinstance(e, Exited)]) < N:
            assert time.monotonic() < end, "exits not seen"
            await asyncio.sleep(0.05)
    finally:
        await rt.close()
    statuses = {e.worker: e.status for e in events if isinstance(e, Exited)}
    return before, during, statuses


def _expected() -> dict[int, int | None]:
    return {w: (-signal.SIGKILL if w % 3 == 0 else w % 7) for w in range(N)}


async def test_n_workers_add_no_watcher_threads_and_exit_statuses_are_exact(
    tmp_path: object,
) -> None:
    before, during, statuses = await _run_many(f"{tmp_path}/gate")
    # asyncio's default executor may have started a thread or two for the /proc walk
    # after an exit (`_wait_group_gone`); never one per worker.
    assert during <= before + 2, (before, during, threading.enumerate())
    assert statuses == _expected()


async def test_without_pidfds_exits_are_still_seen_exactly_and_without_threads(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_pidfd(pid: int, flags: int = 0) -> int:
        raise OSError(38, "Function not implemented")  # ENOSYS: a kernel before 5.3

    monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    before, during, statuses = await _run_many(f"{tmp_path}/gate")
    assert during <= before + 2, (before, during, threading.enumerate())
    assert statuses == _expected()
