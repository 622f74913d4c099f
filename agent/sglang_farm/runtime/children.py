"""I/O: the process runtime's children die with the agent, and are on record for the next one.

Two halves, because either alone leaves orphans (the farm's `kill -9` finding, issue 22
item 5: the workers and smg kept running under PID 1, kept their ports, and the next
agent's canary failed on "port in use"):

- **Die with the agent** (`die_with_agent`): each child asks the kernel for SIGKILL when
  its parent goes (`PR_SET_PDEATHSIG`), set in the child just before exec, *after* the
  user switch (a change of credentials clears it), then looks at `getppid()` once more:
  an agent that died before the request was in place would otherwise be missed. The
  signal fires when the *thread* that forked exits, so children are started from the
  event loop's thread, which lives as long as the agent (never from a worker thread).
- **On record** (`ChildRecords`): each child's pid, its start time (`/proc/PID/stat`
  field 22) and the boot it ran in, with what it is (worker N, the gateway), one small
  file each under `<state_dir>/children/`. At start the agent stops what it recorded
  that is still the same process (pid *and* start time *and* boot match, so a reused
  pid is never signalled) and whose agent is gone: a leftover the death signal missed
  (a subreaper in between, a child that changed credentials itself) holds no port when
  the first worker is launched. Stopped, not adopted: adopting needs the child's output
  pipe, which went with the old agent.

The records tell a root agent whom to kill, so they are trusted only in a folder the
agent's user owns that no one else may write (opened without following links); files
likewise. Anything else is refused with a log line saying where and what to do.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import stat
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import structlog

from sglang_farm.host import procfs

log = structlog.get_logger("sglang_farm.runtime.children")

RECORDS_SUBDIR = "children"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_GONE_WAIT_S = 5.0  # a SIGKILLed group is gone in milliseconds; this bounds a stuck one
_MAX_RECORD_BYTES = 4096


def die_with_agent() -> Callable[[], None]:
    """A `preexec_fn` for Popen: the child gets SIGKILL when the agent (this process) dies.

    Built in the parent (ctypes' lookup is not done after the fork). Popen calls it in
    the child after setgroups/setregid/setreuid and before exec, which is where
    PDEATHSIG must be set: a credentials change clears it.
    """
    agent = os.getpid()
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != agent:  # the agent died before the request was in place
            os._exit(1)

    return preexec


def boot_id() -> str:
    """This boot's id: pids and start times mean nothing across a reboot."""
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


@dataclass(frozen=True, slots=True)
class ProcFacts:
    """What /proc says of a live process: its start time, group and parent."""

    start: int  # clock ticks since boot (proc(5) field 22)
    pgrp: int
    ppid: int
    zombie: bool


def proc_facts(pid: int) -> ProcFacts | None:
    """`/proc/PID/stat`'s fields the records need; None when there is no such process."""
    st = procfs.read_stat(pid)
    if st is None:
        return None
    return ProcFacts(st.start, st.pgrp, st.ppid, not st.alive)


@dataclass(frozen=True, slots=True)
class ChildRecord:
    """One child on record: which process it is, what it is, and which agent started it."""

    what: str  # "worker 3", "gateway": for the log
    pid: int
    start: int
    boot: str
    agent_pid: int
    agent_start: int


def is_same(record: ChildRecord, facts: ProcFacts | None, boot: str) -> bool:
    """Pure: the live process `facts` describe is the very one recorded (never a reused pid)."""
    return (
        facts is not None
        and not facts.zombie
        and record.boot == boot
        and facts.start == record.start
    )


def agent_alive(record: ChildRecord, agent_facts: ProcFacts | None, boot: str) -> bool:
    """Pure: the agent that started `record`'s child still runs (the same process)."""
    return (
        agent_facts is not None
        and not agent_facts.zombie
        and record.boot == boot
        and agent_facts.start == record.agent_start
    )


def leftover(
    record: ChildRecord,
    facts: ProcFacts | None,
    agent_facts: ProcFacts | None,
    boot: str,
) -> bool:
    """Pure: `record` names a live process that outlived the agent that started it.

    A child whose recorded agent is still alive (the same process) belongs to that agent:
    a second agent on the same state folder leaves it alone.
    """
    return is_same(record, facts, boot) and not agent_alive(record, agent_facts, boot)


def record_file(what: str) -> str:
    """'worker 3' -> 'worker-3.json'."""
    return what.replace(" ", "-") + ".json"


class UntrustedFolder(Exception):
    """The records' folder (or a record) is not the agent's own: nothing in it is acted on."""


class ChildRecords:
    """The children's records in one folder (`<state_dir>/children`).

    Blocking (file and /proc I/O): call from a thread. Several writers may share the
    folder (the runtime, the gateway's runner), each writing only its own files.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def _open_folder(self, *, create: bool) -> int:
        """The folder's fd, after checking it is ours and no one else may write it."""
        if create:
            # The state folder itself, as `state.save` makes it (its trust is checked
            # where the agent starts); this folder, the agent's alone.
            self.folder.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):
                os.mkdir(self.folder, 0o700)
        fd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            os.close(fd)
            raise UntrustedFolder(
                f"{self.folder} is owned by uid {st.st_uid} with mode "
                f"{stat.S_IMODE(st.st_mode):04o}; the agent trusts its children's records "
                f"only in a folder of its own that no one else may write: remove it (the "
                f"agent makes it again) or `chown {os.geteuid()} {self.folder} && chmod 0700 "
                f"{self.folder}`"
            )
        return fd

    def record(self, what: str, pid: int, start: int) -> None:
        """Put child `pid` (started at `start`, read by the caller while the pid was
        surely its unreaped child) on record as `what`. A failure is logged: the child
        runs anyway."""
        agent = proc_facts(os.getpid())
        if agent is None:
            return
        rec = ChildRecord(what, pid, start, boot_id(), os.getpid(), agent.start)
        name = record_file(what)
        try:
            fd = self._open_folder(create=True)
        except (OSError, UntrustedFolder) as exc:
            log.error("child_record_failed", child=what, pid=pid, error=str(exc))
            return
        try:
            tmp = f".{name}.tmp"
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=fd)
            out = os.open(
                tmp,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                0o600,
                dir_fd=fd,
            )
            with os.fdopen(out, "w") as f:
                f.write(json.dumps(asdict(rec)))
            os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
        except OSError as exc:
            log.error("child_record_failed", child=what, pid=pid, error=str(exc))
        finally:
            os.close(fd)

    def forget(self, what: str, pid: int) -> None:
        """Drop `what`'s record if it still names `pid` (a later start may have replaced it)."""
        try:
            fd = self._open_folder(create=False)
        except (OSError, UntrustedFolder):
            return
        try:
            rec = self._read(fd, record_file(what))
            if rec is not None and rec.pid == pid:
                os.unlink(record_file(what), dir_fd=fd)
        except (OSError, UntrustedFolder):
            pass
        finally:
            os.close(fd)

    @staticmethod
    def _read(fd: int, name: str) -> ChildRecord | None:
        try:
            rfd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
        except FileNotFoundError:
            return None
        with os.fdopen(rfd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
                raise UntrustedFolder(f"{name} is not a file of the agent's own")
            raw = f.read(_MAX_RECORD_BYTES + 1)
        try:
            d = json.loads(raw)
            rec = ChildRecord(
                str(d["what"]),
                int(d["pid"]),
                int(d["start"]),
                str(d["boot"]),
                int(d["agent_pid"]),
                int(d["agent_start"]),
            )
        except (ValueError, KeyError, TypeError):
            return None  # unreadable (a torn write cannot happen: rename): ignored
        return rec if len(raw) <= _MAX_RECORD_BYTES and rec.pid > 1 else None

    def running(self) -> list[ChildRecord]:
        """The recorded children that still run (the same process) under the agent that
        started them (alive): a running farm's own. Read only; an untrusted or absent
        folder, or a record not of the agent's own user, gives nothing. Never raises."""
        try:
            fd = self._open_folder(create=False)
        except (OSError, UntrustedFolder):
            return []
        out: list[ChildRecord] = []
        try:
            boot = boot_id()
            for name in sorted(os.listdir(fd)):
                if not name.endswith(".json") or name.startswith("."):
                    continue
                try:
                    rec = self._read(fd, name)
                except (OSError, UntrustedFolder):
                    continue
                if (
                    rec is not None
                    and is_same(rec, proc_facts(rec.pid), boot)
                    and agent_alive(rec, proc_facts(rec.agent_pid), boot)
                ):
                    out.append(rec)
        except OSError:
            return []
        finally:
            os.close(fd)
        return out

    def stop_leftovers(self) -> list[ChildRecord]:
        """SIGKILL (with its process group) every recorded child that outlived its agent and
        is still the same process; wait for each group to be gone (its ports free). The
        records are dropped then, but for those of an agent that still runs (a second
        agent on this state folder: said in the log). Returns the stopped ones. Never
        raises: an untrusted folder is logged and left alone."""
        try:
            fd = self._open_folder(create=False)
        except FileNotFoundError:
            return []
        except (OSError, UntrustedFolder) as exc:
            log.error("child_records_refused", folder=str(self.folder), error=str(exc))
            return []
        stopped: list[ChildRecord] = []
        try:
            boot = boot_id()
            for name in sorted(os.listdir(fd)):
                if not name.endswith(".json") or name.startswith("."):
                    continue
                try:
                    rec = self._read(fd, name)
                except (OSError, UntrustedFolder) as exc:
                    log.error(
                        "child_record_refused", folder=str(self.folder), file=name, error=str(exc)
                    )
                    continue
                if rec is not None and agent_alive(rec, proc_facts(rec.agent_pid), boot):
                    log.warning(
                        "child_of_a_running_agent",
                        child=rec.what,
                        pid=rec.pid,
                        agent_pid=rec.agent_pid,
                        folder=str(self.folder),
                        hint="another agent runs on this state_dir: stop one of them",
                    )
                    continue  # that agent's, record and all
                if rec is not None and leftover(rec, proc_facts(rec.pid), None, boot):
                    _kill_leftover(rec, boot)
                    stopped.append(rec)
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=fd)
        finally:
            os.close(fd)
        return stopped


def _kill_leftover(rec: ChildRecord, boot: str) -> None:
    """SIGKILL the recorded process and, as it leads its own group (each child is started
    in a session of its own), the group: SGLang's scheduler children hold the GPU.

    The process is pinned by a pidfd before its start time is checked once more, so the
    signal cannot reach a process that took its pid in between; while the leader lives,
    no other group can have its number.
    """
    pidfd: int | None
    try:
        pidfd = os.pidfd_open(rec.pid)
    except ProcessLookupError:
        return  # gone since it was looked at
    except OSError:
        pidfd = None  # no pidfds here (an old kernel, a seccomp filter): the pid alone
    try:
        facts = proc_facts(rec.pid)
        if facts is None or not is_same(rec, facts, boot):
            return
        with contextlib.suppress(ProcessLookupError):
            if facts.pgrp == rec.pid:
                os.killpg(rec.pid, signal.SIGKILL)
            if pidfd is not None:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            else:
                os.kill(rec.pid, signal.SIGKILL)
    finally:
        if pidfd is not None:
            os.close(pidfd)
    end = time.monotonic() + _GONE_WAIT_S
    while time.monotonic() < end and (
        is_same(rec, proc_facts(rec.pid), boot) or _group_alive(rec.pid)
    ):
        time.sleep(0.02)


def _group_alive(pgid: int) -> bool:
    """True while a live (non-zombie) process is in group `pgid`."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            facts = proc_facts(int(entry))
            if facts is not None and facts.pgrp == pgid and not facts.zombie:
                return True
    return False
