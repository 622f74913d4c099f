"""I/O: workers as plain child processes, for hosts and containers without systemd, and the demo.

Each worker runs in its own session (so its process group holds SGLang's scheduler and
detokenizer children, and SGLang's optional `killpg` cannot reach the agent). A stop
signals the whole group: SIGTERM, then SIGKILL after the deadline, since SGLang's drain
has no upper bound. When the main process exits on its own, whatever it left in its group
is killed too: orphaned schedulers otherwise keep holding GPU memory (sglang#23627).
Output (stdout and stderr, merged) is kept in a ring buffer per worker and emitted line
by line for the classifier.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections import deque
from collections.abc import Mapping

import structlog

from sglang_farm.errors import RuntimeFailure
from sglang_farm.runtime import Emit, Exited, LogLine, Running, Started
from sglang_farm.sglang_argv import Command
from sglang_farm.spec import FarmSpec, FlagValue

log = structlog.get_logger("sglang_farm.runtime.process")

_GROUP_GONE_WAIT = 5.0  # seconds to wait for a SIGKILLed group to disappear
# Longest output line kept whole (asyncio's default is 64 KiB; SGLang can log whole prompts).
_LINE_LIMIT = 1 << 20


def _killpg(pgid: int, sig: signal.Signals) -> bool:
    """Signal a process group; False if it no longer exists."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


def _group_alive(pgid: int) -> bool:
    """True while a live (non-zombie) process is in the group.

    Zombies count as gone: orphans are reaped by PID 1 or a subreaper, sometimes late,
    and a zombie holds no memory, GPU context or port.
    """
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        # fields[0] = state, fields[2] = pgrp (proc(5))
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            return True
    return False


async def _wait_group_gone(pgid: int, deadline: float) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline
    while loop.time() < end:
        # A /proc walk: in a thread, not on the event loop.
        if not await asyncio.to_thread(_group_alive, pgid):
            return True
        await asyncio.sleep(0.05)
    return False


class ProcessRuntime:
    """Runtime over child processes. Workers die with the agent (see `close`)."""

    name = "process"
    workers_outlive_agent = False  # children of the agent: `close` kills what is left

    def __init__(self, emit: Emit, *, log_lines: int = 5000) -> None:
        self._emit = emit
        self._log_lines = log_lines
        self._procs: dict[int, asyncio.subprocess.Process] = {}
        self._readers: dict[int, asyncio.Task[None]] = {}
        self._logs: dict[int, deque[str]] = {}

    async def start(self, worker: int, command: Command) -> None:
        if worker in self._procs:
            raise RuntimeFailure(
                f"worker {worker} is already running (pid {self._procs[worker].pid})"
            )
        env = {**os.environ, **command.env_dict}
        try:
            proc = await asyncio.create_subprocess_exec(
                *command.argv,
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
                limit=_LINE_LIMIT,
            )
        except OSError as exc:
            raise RuntimeFailure(f"cannot run {command.argv[0]}: {exc.strerror}") from exc
        self._procs[worker] = proc
        self._watch_main(proc.pid)
        self._logs.setdefault(worker, deque(maxlen=self._log_lines))
        self._emit(Started(worker, proc.pid))
        self._readers[worker] = asyncio.create_task(self._follow(worker, proc))

    def _watch_main(self, pid: int) -> None:
        """Kill the group the moment the main process exits.

        asyncio's `wait()` only returns once the output pipe closes, and SGLang's children
        (which inherit the pipe) can outlive the main process: without this, a SIGKILLed
        worker would be noticed only when its orphans die, if ever. A pidfd becomes readable
        when the process exits.
        """
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            return  # kernel without pidfd: the group is killed once the pipe closes
        loop = asyncio.get_running_loop()

        def exited() -> None:
            loop.remove_reader(pidfd)
            os.close(pidfd)
            _killpg(pid, signal.SIGKILL)

        loop.add_reader(pidfd, exited)

    async def _follow(self, worker: int, proc: asyncio.subprocess.Process) -> None:
        buf = self._logs[worker]
        assert proc.stdout is not None
        while True:
            try:
                raw = await proc.stdout.readline()
            except ValueError:  # a line over the limit: asyncio dropped it; keep reading
                raw = (
                    f"[sglang-farm: a line longer than {_LINE_LIMIT} bytes was dropped]\n".encode()
                )
            if not raw:
                break
            text = raw.decode("utf-8", "replace").rstrip("\r\n")
            buf.append(text)
            self._emit(LogLine(worker, text))
        status = await proc.wait()
        # The main process is gone; its group may still hold children (the scheduler): kill them.
        if _killpg(proc.pid, signal.SIGKILL):
            await _wait_group_gone(proc.pid, _GROUP_GONE_WAIT)
        self._procs.pop(worker, None)
        self._emit(Exited(worker, proc.pid, status))

    async def stop(self, worker: int, timeout: float) -> None:
        proc = self._procs.get(worker)
        reader = self._readers.get(worker)
        if proc is None or reader is None:
            return
        _killpg(proc.pid, signal.SIGTERM)
        # As systemd does: a stopped (SIGSTOP, hung) process must run to act on SIGTERM.
        _killpg(proc.pid, signal.SIGCONT)
        try:
            await asyncio.wait_for(asyncio.shield(proc.wait()), timeout)
        except TimeoutError:
            log.warning("worker_stop_timeout", worker=worker, pid=proc.pid, after_s=timeout)
            _killpg(proc.pid, signal.SIGKILL)
        await asyncio.shield(reader)

    async def prepare(
        self, spec: FarmSpec, flags_by_worker: Mapping[int, Mapping[str, FlagValue]]
    ) -> None:
        """Nothing to install: `start` is given the whole command line."""

    async def confirm_ready(self, worker: int) -> bool:
        return True  # no second opinion: /health answering is the whole readiness rule

    def exit_pending(self, worker: int) -> bool:
        return False  # output and exit come from the same child: never out of order

    async def adopt(self) -> Mapping[int, Running]:
        return {}  # children do not outlive the agent

    def log_tail(self, worker: int, lines: int) -> list[str]:
        buf = self._logs.get(worker)
        if not buf:
            return []
        return list(buf)[-lines:] if lines > 0 else []

    async def close(self) -> None:
        """Kill every worker that is left (the agent is going away; so do its children)."""
        for worker, proc in list(self._procs.items()):
            _killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._readers[worker]), _GROUP_GONE_WAIT)
