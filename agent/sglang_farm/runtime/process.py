"""I/O: workers as plain child processes, for hosts and containers without systemd, and the demo.

Each worker runs in its own session (so its process group holds SGLang's scheduler and
detokenizer children, and SGLang's optional `killpg` cannot reach the agent).

A stop sends SIGTERM to the main process only, as systemd's `KillMode=mixed` does: SGLang's
main process drains and then stops its own children, while a SIGTERM to the whole group
would stop the scheduler first and cut the drain short. At the deadline the whole group
gets SIGKILL, since SGLang's drain has no upper bound. When the main process exits, on
its own or not, whatever it left in its group is killed too: orphaned schedulers
otherwise keep holding GPU memory (sglang#23627).

The group is signalled by its number, which is the main process's pid: safe only while
that pid is still ours. So the runtime reaps its children itself (not asyncio's child
watcher), and only after it is done signalling the group: until then the main process is
at worst a zombie, whose pid (and group number) no other process can be given.

Run by root, workers run as `[farm] user` and `[farm] group` (with the user's
supplementary groups, HOME, USER and LOGNAME), as the worker unit's `User=` does under
systemd. Run by anyone else, they run as the agent's own user (nothing to drop), and the
agent says so once if `[farm] user` names someone else.

Children die with the agent (`PR_SET_PDEATHSIG`, set after the user switch) and are on
record in `<state_dir>/children`: a new agent stops what an old one left before it
launches anything (`adopt`), so a leftover never holds a worker's port (runtime/children).
Children are started from the event loop's thread, which lives as long as the agent:
the death signal follows the thread that forked.

Output (stdout and stderr, merged) is kept in a ring buffer per worker and emitted line
by line for the classifier.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import os
import pwd
import signal
import subprocess
from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import structlog

from sglang_farm.errors import RuntimeFailure
from sglang_farm.host import procfs
from sglang_farm.host.portowner import tree_pids
from sglang_farm.runtime import Emit, Exited, LogLine, Running, Started
from sglang_farm.runtime.children import ChildRecords, die_with_agent, proc_facts
from sglang_farm.sglang.argv import API_KEY_ENV, Command
from sglang_farm.spec import FarmSpec

log = structlog.get_logger("sglang_farm.runtime.process")

_GROUP_GONE_WAIT = 5.0  # seconds to wait for a SIGKILLed group to disappear
# Longest output line kept whole (asyncio's default is 64 KiB; SGLang can log whole prompts).
_LINE_LIMIT = 1 << 20


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a worker runs as when the agent is root."""

    user: str
    uid: int
    gid: int
    groups: tuple[int, ...]  # supplementary groups, as initgroups(3) would set them
    home: str


def worker_identity(user: str, group: str, *, euid: int) -> Identity | None:
    """The identity workers run as; None: as the agent itself.

    Only root can switch users: for any other `euid` workers run as the agent (None).
    Root with `user` "root" also gets None. Raises RuntimeFailure, saying what to do,
    for a user or group this host does not know.
    """
    if euid != 0:
        return None
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        raise RuntimeFailure(
            f"[farm] user {user!r} does not exist on this host; the process runtime runs "
            "workers as that user when the agent runs as root: create it "
            f"(`useradd --system {user}`) or set [farm] user and group to an existing "
            'user ("root" to run workers as root)'
        ) from None
    try:
        gid = grp.getgrnam(group).gr_gid
    except KeyError:
        raise RuntimeFailure(
            f"[farm] group {group!r} does not exist on this host; create it "
            f"(`groupadd --system {group}`) or set [farm] user and group to an existing "
            "user and group"
        ) from None
    if pw.pw_uid == 0 and gid == 0:
        return None
    groups = tuple(sorted({gid, *os.getgrouplist(user, gid)}))
    return Identity(user, pw.pw_uid, gid, groups, pw.pw_dir)


# Without pidfds, how often a child's exit is looked for (a syscall per child per tick).
_EXIT_POLL_S = 0.05


def _exit_future(pid: int) -> asyncio.Future[None]:
    """Done when process `pid` (our child) has exited, without reaping it. No thread.

    A pidfd (Linux 5.3+) turns readable on exit: it is watched by the event loop itself,
    so N workers cost N descriptors and no thread (there was one waiting thread per worker
    before: 68 threads at 64 workers). Without pidfds (an older kernel, a seccomp filter)
    the loop looks every `_EXIT_POLL_S` with `waitid(WNOHANG | WNOWAIT)`, which leaves the
    zombie in place as well. Either way the exit status is read once, by the reaper.
    """
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        _poll_exit(loop, pid, fut)
        return fut

    def readable() -> None:
        loop.remove_reader(pidfd)
        os.close(pidfd)
        if not fut.done():
            fut.set_result(None)

    loop.add_reader(pidfd, readable)
    return fut


def _poll_exit(loop: asyncio.AbstractEventLoop, pid: int, fut: asyncio.Future[None]) -> None:
    if fut.done():
        return
    try:
        exited = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # already reaped elsewhere: gone all the same
        exited = True
    if exited:
        fut.set_result(None)
    else:
        loop.call_later(_EXIT_POLL_S, _poll_exit, loop, pid, fut)


@dataclass(eq=False, slots=True)
class _Child:
    """One worker's main process, from its start until it is reaped."""

    popen: subprocess.Popen[bytes]
    exited: asyncio.Future[None]  # the main process exited (a zombie until reaped)
    transport: asyncio.ReadTransport
    reader: asyncio.StreamReader
    follow: asyncio.Task[None] | None = None
    reaped: bool = False  # once True, the pid (and the group's number) may be anyone's

    @property
    def pid(self) -> int:
        return self.popen.pid

    def signal_main(self, sig: signal.Signals) -> None:
        """Signal the main process only; nothing once it is reaped."""
        if not self.reaped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def signal_group(self, sig: signal.Signals) -> bool:
        """Signal the whole group, while its number is still ours; False if it is gone."""
        if self.reaped:
            return False
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            return False
        return True


def _group_alive(pgid: int) -> bool:
    """True while a live (non-zombie) process is in the group.

    Zombies count as gone: orphans are reaped by PID 1 or a subreaper, sometimes late,
    and a zombie holds no memory, GPU context or port.
    """
    return any(st.pgrp == pgid and st.alive for st in procfs.all_stats())


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

    def __init__(
        self, emit: Emit, *, log_lines: int = 5000, records: ChildRecords | None = None
    ) -> None:
        self._emit = emit
        self._records = records  # None: children not on record (tests of the runtime alone)
        self._log_lines = log_lines
        self._procs: dict[int, _Child] = {}
        self._logs: dict[int, deque[str]] = {}
        self._identity: Identity | None = None
        self._said_user: str | None = None

    async def start(self, worker: int, command: Command) -> None:
        if worker in self._procs:
            raise RuntimeFailure(
                f"worker {worker} is already running (pid {self._procs[worker].pid})"
            )
        who = self._identity
        env = dict(os.environ)
        if who is not None:
            env.update(HOME=who.home, USER=who.user, LOGNAME=who.user)
        env.update(command.env_dict)
        # The API key never goes on a command line (every local user can read those):
        # the worker's launcher takes it from here and removes it (sglang.argv).
        env.pop(API_KEY_ENV, None)
        if command.api_key is not None:
            env[API_KEY_ENV] = command.api_key
        try:
            # Not asyncio's subprocesses: their child watcher reaps the main process behind
            # our back, and the group's number with it (see the module docstring).
            # Blocking for the fork and exec only, as asyncio's own subprocesses are.
            popen = subprocess.Popen(  # noqa: ASYNC220
                command.argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd="/" if who is not None else None,  # as systemd's default
                user=who.uid if who is not None else None,
                group=who.gid if who is not None else None,
                extra_groups=list(who.groups) if who is not None else None,
                # After the user switch, before exec: see runtime/children.
                preexec_fn=die_with_agent(),
            )
        except OSError as exc:
            raise RuntimeFailure(f"cannot run {command.argv[0]}: {exc.strerror}") from exc
        assert popen.stdout is not None
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=_LINE_LIMIT)
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), popen.stdout
        )
        child = _Child(popen, _exit_future(popen.pid), transport, reader)
        self._procs[worker] = child
        self._logs.setdefault(worker, deque(maxlen=self._log_lines))
        self._emit(Started(worker, popen.pid))
        # Read now, while the pid is surely this child (not reaped before `_follow` does).
        facts = proc_facts(popen.pid) if self._records is not None else None
        child.follow = asyncio.create_task(self._follow(worker, child))
        if self._records is not None and facts is not None:
            await asyncio.to_thread(
                self._records.record, f"worker {worker}", popen.pid, facts.start
            )

    async def _read(self, worker: int, reader: asyncio.StreamReader) -> None:
        buf = self._logs[worker]
        while True:
            try:
                raw = await reader.readline()
            except ValueError:  # a line over the limit: asyncio dropped it; keep reading
                raw = (
                    f"[sglang-farm: a line longer than {_LINE_LIMIT} bytes was dropped]\n".encode()
                )
            if not raw:
                return
            text = raw.decode("utf-8", "replace").rstrip("\r\n")
            buf.append(text)
            self._emit(LogLine(worker, text))

    async def _follow(self, worker: int, child: _Child) -> None:
        reading = asyncio.create_task(self._read(worker, child.reader))
        try:
            await child.exited
            # The main process is gone (a zombie: the group's number is still ours). Its
            # group may still hold children (the scheduler): kill them.
            if child.signal_group(signal.SIGKILL):
                await _wait_group_gone(child.pid, _GROUP_GONE_WAIT)
            # The output ends when the last holder of the pipe is gone; one that left the
            # group could hold it forever, so the wait is bounded.
            try:
                await asyncio.wait_for(asyncio.shield(reading), _GROUP_GONE_WAIT)
            except TimeoutError:
                child.transport.close()
                await reading
        finally:
            child.transport.close()
            status = self._reap(child)
            self._procs.pop(worker, None)
        if self._records is not None:  # a record left behind is harmless: pid and start differ
            await asyncio.to_thread(self._records.forget, f"worker {worker}", child.pid)
        self._emit(Exited(worker, child.pid, status))

    @staticmethod
    def _reap(child: _Child) -> int | None:
        """Collect the main process's exit status; from here on its pid is not ours."""
        try:
            _, raw = os.waitpid(child.pid, 0)
        except ChildProcessError:  # reaped elsewhere (SIGCHLD ignored): status unknown
            status = None
        else:
            status = os.waitstatus_to_exitcode(raw)
        child.reaped = True
        child.popen.returncode = status if status is not None else -1  # Popen: not running
        return status

    async def stop(self, worker: int, timeout: float) -> None:
        child = self._procs.get(worker)
        if child is None or child.follow is None:
            return
        if not child.exited.done():
            child.signal_main(signal.SIGTERM)  # the main process drains, then stops its children
            # As systemd does: a stopped (SIGSTOP, hung) process must run to act on SIGTERM.
            child.signal_group(signal.SIGCONT)
            try:
                await asyncio.wait_for(asyncio.shield(child.exited), timeout)
            except TimeoutError:
                log.warning("worker_stop_timeout", worker=worker, pid=child.pid, after_s=timeout)
                child.signal_group(signal.SIGKILL)
        await asyncio.shield(child.follow)

    async def prepare(self, spec: FarmSpec, commands: Mapping[int, Command]) -> frozenset[int]:
        """Nothing to install (`start` is given the whole command line); settle who the
        workers run as. Raises RuntimeFailure for an unknown `[farm] user` or group. No
        secret outlives a worker here (its environment is given at start): none changed."""
        euid = os.geteuid()
        self._identity = worker_identity(spec.farm.user, spec.farm.group, euid=euid)
        if euid == 0 or self._said_user == spec.farm.user:
            return frozenset()
        self._said_user = spec.farm.user
        try:
            me = pwd.getpwuid(euid).pw_name
        except KeyError:  # a uid without a passwd entry (some containers)
            me = str(euid)
        if spec.farm.user != me:
            log.warning(
                "worker_user_not_applied",
                user=spec.farm.user,
                running_as=me,
                why="only an agent run as root can run workers as another user",
            )
        return frozenset()

    async def confirm_ready(self, worker: int) -> bool:
        return True  # no second opinion: /health answering is the whole readiness rule

    def exit_pending(self, worker: int) -> bool:
        return False  # output and exit come from the same child: never out of order

    async def worker_pids(self, worker: int) -> frozenset[int]:
        child = self._procs.get(worker)
        if child is None or child.exited.done():
            return frozenset()
        # The main process is a session leader: its pid names the session and the group.
        return await asyncio.to_thread(tree_pids, child.pid)

    async def adopt(self, configured: Collection[int] | None = None) -> Mapping[int, Running]:
        """Nothing is adopted (a leftover's output pipe went with its agent): what an
        earlier agent left running (on record, the same process) is stopped instead, with
        its group, before any launch, so its ports are free."""
        if self._records is not None:
            for rec in await asyncio.to_thread(self._records.stop_leftovers):
                wid = rec.what.removeprefix("worker ")
                fields = {"worker": int(wid)} if wid.isdigit() else {}
                log.warning(
                    "leftover_stopped",
                    child=rec.what,
                    pid=rec.pid,
                    **fields,
                    why="still running from an agent that is gone (killed without a stop)",
                )
        return {}

    def log_tail(self, worker: int, lines: int) -> list[str]:
        buf = self._logs.get(worker)
        if not buf:
            return []
        return list(buf)[-lines:] if lines > 0 else []

    async def close(self) -> None:
        """Kill every worker that is left (the agent is going away; so do its children)."""
        for child in list(self._procs.values()):
            child.signal_group(signal.SIGKILL)
            if child.follow is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.shield(child.follow), _GROUP_GONE_WAIT)
