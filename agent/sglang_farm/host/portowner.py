"""I/O: which process holds the socket listening on a worker's port, read from `/proc`.

The readiness rule (docs/security.md): a worker is ready only when the socket listening
on its port belongs to its own process tree. This module reads the kernel's TCP tables
(`/proc/net/tcp`, `/proc/net/tcp6`) for LISTEN sockets, finds the processes holding them
(`/proc/PID/fd/* -> socket:[inode]`), first among the worker's own processes (a few),
and only for a socket none of them holds among all processes (to name the squatter).

What it costs: a verified listener is remembered by its inode (one socket, for as long
as it exists), so a liveness beat of a worker whose listener did not change reads the
listeners and nothing else; the fd walk runs at readiness and when the listener changes.
The listeners come from a sock_diag dump of LISTEN sockets (`host.sockdiag`: 0.1 ms for
both families), not from the tables, which make the kernel print every connection of
the host (13 ms of CPU with 1,700 TIME-WAIT connections: about 1 % of a core of an idle
agent, issue 32, 4.8); the tables remain the fallback where the kernel has no sock_diag
(or a sandbox forbids it). One reading serves every worker's check for `TABLE_TTL_S`: at
most one a second however many workers beat.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import socket
import time
from collections.abc import Awaitable, Callable, Hashable, Iterable
from typing import Protocol

from sglang_farm.host import procfs, sockdiag
from sglang_farm.host.listeners import (
    Listener,
    OwnerKind,
    Ownership,
    judge,
    parse_listeners,
    reaches,
)

TABLES = ("net/tcp", "net/tcp6")  # under /proc; tcp6 is absent where IPv6 is disabled
# How long one reading of the tables answers checks. A listener appears in it at most this
# late; the port is exclusive (another user cannot share it with the worker's socket), so
# a reading this old cannot show the worker's socket while a squatter holds the port.
TABLE_TTL_S = 1.0


class PortOwner(Protocol):
    """The seam the liveness watcher asks: whose are the listeners on `host:port`?"""

    async def check(
        self,
        host: str,
        port: int,
        ours: Callable[[], Awaitable[frozenset[int]]],
        *,
        fresh: bool = False,
        whose: Hashable = None,
    ) -> Ownership:
        """`ours`: the worker's own pids (asked only when a listener must be traced).
        `fresh`: read the tables now and trust no earlier verdict (readiness, launch: the
        port may have changed hands since, as when a restarted worker's old socket
        closed and a squatter bound the port); liveness beats may use a recent reading.
        `whose`: who `ours` stands for (a worker id): a verdict remembered for one is
        never another's (a reload may give a worker the port another still listens on)."""
        ...


def read_listeners(proc: str = "/proc") -> list[Listener]:
    """Every LISTEN TCP socket of the agent's network namespace (IPv4 and IPv6)."""
    out: list[Listener] = []
    for table in TABLES:
        try:
            with open(f"{proc}/{table}") as fh:
                text = fh.read()
        except OSError:
            continue
        out += parse_listeners(text)
    return out


_DIAG_BUFFER = 1 << 16  # the kernel fills at most this much of a dump per recv
_DIAG_TIMEOUT_S = 2.0  # a dump of the listening hash takes microseconds: a bound, not a wait


def diag_listeners() -> list[Listener]:
    """Every LISTEN TCP socket of the agent's network namespace, from sock_diag (the set
    `read_listeners` reads from the tables). OSError where there is no sock_diag."""
    out: list[Listener] = []
    with socket.socket(
        socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, sockdiag.NETLINK_SOCK_DIAG
    ) as s:
        s.settimeout(_DIAG_TIMEOUT_S)
        for seq, family in enumerate(sockdiag.FAMILIES, 1):
            s.sendall(sockdiag.dump_request(family, seq))
            done = False
            while not done:
                data = s.recv(_DIAG_BUFFER)
                if not data:
                    raise OSError("sock_diag: the dump ended without NLMSG_DONE")
                found, done = sockdiag.parse_reply(data)
                out += found
    return out


def kernel_listeners(
    proc: str = "/proc", *, diag: Callable[[], list[Listener]] = diag_listeners
) -> list[Listener]:
    """Every LISTEN TCP socket: from sock_diag (`diag`) for the agent's own `/proc`, else
    (or where sock_diag fails) from the tables under `proc`."""
    if proc == "/proc":
        try:
            return diag()
        except OSError:
            pass  # no sock_diag here (an old kernel, a sandbox): the tables say the same
    return read_listeners(proc)


def socket_inodes(pid: int, proc: str = "/proc") -> set[int]:
    """The socket inodes process `pid` has open; empty if it is gone or unreadable."""
    fd_dir = f"{proc}/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return set()
    out: set[int] = set()
    for fd in fds:
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:[") and target.endswith("]"):
            try:
                out.add(int(target[8:-1]))
            except ValueError:
                continue
    return out


def holders_of(
    inodes: Iterable[int], pids: Iterable[int] | None = None, proc: str = "/proc"
) -> dict[int, frozenset[int]]:
    """For each of `inodes`, the pids (of `pids`, or of every process) holding it."""
    wanted = set(inodes)
    found: dict[int, set[int]] = {}
    if not wanted:
        return {}
    for pid in procfs.pids(proc) if pids is None else pids:
        for inode in socket_inodes(pid, proc) & wanted:
            found.setdefault(inode, set()).add(pid)
    return {i: frozenset(p) for i, p in found.items()}


def tree_pids(leader: int, proc: str = "/proc") -> frozenset[int]:
    """`leader` and every live process in its session or process group, or descended from it.

    The process runtime starts each worker as a session leader (its pid names the group
    and the session), and no other user's process can join either; descendants that left
    both (a daemonizing child) are still found through their parents while those live.
    """
    parents: dict[int, int] = {}
    out = {leader}
    for st in procfs.all_stats(proc):
        if not st.alive:
            continue
        parents[st.pid] = st.ppid
        if leader in (st.pgrp, st.session):
            out.add(st.pid)
    for pid in parents:
        seen: set[int] = set()
        cur = pid
        while cur in parents and cur not in seen and cur not in out:
            seen.add(cur)
            cur = parents[cur]
        if cur in out:
            out |= seen
    return frozenset(out)


def held_by(host: str, port: int, pids: frozenset[int], proc: str = "/proc") -> bool:
    """Whether every socket listening where a bind of `host:port` collides is held by
    `pids` (a worker's own processes), by the readiness rule (`listeners.judge`): the
    doctor's port check, where a port its own running worker holds is no conflict.

    A wildcard `host` (the NCCL port's `0.0.0.0`) collides with every listener on the
    port, each judged on its own address. False when nothing is seen listening (the bind
    failed on something else) or `pids` is empty. Blocking: reads /proc.
    """
    if not pids:
        return False
    wildcard = host in ("0.0.0.0", "::", "")
    there = [
        lst
        for lst in read_listeners(proc)
        if lst.port == port and (wildcard or reaches(lst, host, port))
    ]
    if not there:
        return False
    inodes = {lst.inode for lst in there}
    mine = frozenset(holders_of(inodes, pids, proc))
    rest = inodes - mine
    others = holders_of(rest, None, proc) if rest else {}
    uids = frozenset(
        u for u in (_process_uid(p, proc, default=None) for p in pids) if u is not None
    )
    return all(
        judge(
            [lst],
            str(lst.address) if wildcard else host,
            port,
            ours=mine,
            holders=others,
            our_uids=uids,
        ).kind
        is OwnerKind.OURS
        for lst in there
    )


def user_name(uid: int | None) -> str | None:
    if uid is None:
        return None
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


class ProcPortOwner:
    """`PortOwner` over `/proc`; remembers the listeners it found to be a worker's own."""

    def __init__(
        self,
        proc: str = "/proc",
        *,
        clock: Callable[[], float] = time.monotonic,
        read: Callable[[str], list[Listener]] = kernel_listeners,
    ) -> None:
        """`read`: every listener (`kernel_listeners`; a test counts its calls)."""
        self._proc = proc
        self._clock = clock
        self._read = read
        # (port, whose) -> the inodes found to be whose's own
        self._verified: dict[tuple[int, Hashable], frozenset[int]] = {}
        self._table: tuple[float, list[Listener]] | None = None

    async def _listeners(self, *, fresh: bool = False) -> list[Listener]:
        now = self._clock()
        if not fresh and self._table is not None and now - self._table[0] < TABLE_TTL_S:
            return self._table[1]
        listeners = await asyncio.to_thread(self._read, self._proc)
        self._table = (now, listeners)
        return listeners

    async def check(
        self,
        host: str,
        port: int,
        ours: Callable[[], Awaitable[frozenset[int]]],
        *,
        fresh: bool = False,
        whose: Hashable = None,
    ) -> Ownership:
        # Reads of /proc: in a thread, never on the event loop.
        key = (port, whose)
        if fresh:
            self._verified.pop(key, None)
        listeners = await self._listeners(fresh=fresh)
        there = [lst for lst in listeners if reaches(lst, host, port)]
        inodes = frozenset(lst.inode for lst in there)
        if not there:
            return Ownership(OwnerKind.NONE, port)
        if inodes <= self._verified.get(key, frozenset()):
            # The same sockets as last verified: an inode names one socket while it exists.
            return Ownership(OwnerKind.OURS, port, inodes=inodes)
        pids = await ours()
        verdict = await asyncio.to_thread(self._trace, there, host, port, pids)
        if verdict.kind is OwnerKind.OURS:
            self._verified[key] = verdict.inodes
        else:
            self._verified.pop(key, None)
        return verdict

    def _trace(
        self, there: list[Listener], host: str, port: int, pids: frozenset[int]
    ) -> Ownership:
        inodes = {lst.inode for lst in there}
        mine = set(holders_of(inodes, pids, self._proc))
        rest = inodes - mine
        others = holders_of(rest, None, self._proc) if rest else {}
        uids = frozenset(
            u for u in (_process_uid(p, self._proc, default=None) for p in pids) if u is not None
        )
        verdict = judge(there, host, port, ours=frozenset(mine), holders=others, our_uids=uids)
        if verdict.kind in (OwnerKind.FOREIGN, OwnerKind.UNSEEN):
            uid = verdict.uid
            if verdict.pid is not None:
                uid = _process_uid(verdict.pid, self._proc, default=uid)
            leads = () if verdict.pid is not None or uid is None else self._of_user(uid)
            return Ownership(
                verdict.kind, port, verdict.pid, uid, user_name(uid), verdict.inodes, leads
            )
        return verdict

    def _of_user(self, uid: int) -> tuple[int, ...]:
        """The processes running as `uid` (their status is readable without privileges,
        their descriptors are not): where an unseen socket of that user must be."""
        pids = procfs.pids(self._proc)
        return tuple(sorted(p for p in pids if _process_uid(p, self._proc, default=None) == uid))


def _process_uid(pid: int, proc: str, *, default: int | None) -> int | None:
    """The effective uid of `pid` (`/proc/PID/status`, readable without privileges), the
    owner of the sockets it creates; else `default`."""
    try:
        with open(f"{proc}/{pid}/status") as fh:
            for line in fh:
                if line.startswith("Uid:"):
                    return int(line.split()[2])
    except (OSError, ValueError, IndexError):
        pass
    return default
