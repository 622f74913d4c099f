"""I/O: who may use the control socket: the peer's credentials and the group database.

Policy (docs/control-protocol.md, "Permissions"):
- the socket file is `0660 root:<group>`; when the group does not exist on this
  host it is `0600` (root only), and the server logs a warning;
- every command is allowed to uid 0, to the agent's own uid, and to members of
  the group (primary gid, or a supplementary member per the group database);
  everyone else gets `forbidden`. The file mode is the first gate, the peer
  credentials (`SO_PEERCRED`, read here) the second: they still hold if someone
  loosens the mode.

The check runs before any command, so before any state change.
"""

from __future__ import annotations

import asyncio
import grp
import os
import pwd
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Protocol

# Group membership looked up per uid at most this often (a usermod -aG takes effect
# within a minute, and a burst of farmctl calls costs one lookup).
MEMBER_CACHE_TTL: Final = 60.0

_PEERCRED = struct.Struct("3i")  # struct ucred {pid_t pid; uid_t uid; gid_t gid;}


@dataclass(frozen=True, slots=True)
class Peer:
    """The process at the other end of a connection, as the kernel saw it at connect()."""

    pid: int
    uid: int
    gid: int


class SocketOptions(Protocol):
    """A connected socket: `socket.socket`, or asyncio's `TransportSocket` wrapping one."""

    def getsockopt(self, level: int, optname: int, buflen: int, /) -> bytes: ...


def peer_of(sock: SocketOptions) -> Peer:
    """The connected peer's credentials (`SO_PEERCRED`). Raises `OSError` on a closed socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    pid, uid, gid = _PEERCRED.unpack(raw)
    return Peer(pid, uid, gid)


def group_gid(name: str | None) -> int | None:
    """The gid of group `name`; None when no group is configured or it does not exist."""
    if name is None:
        return None
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        return None


def uid_in_group(uid: int, gid: int) -> bool:
    """Is `uid` a member of `gid` per the group database (primary or supplementary)?"""
    try:
        pw = pwd.getpwuid(uid)
    except KeyError:
        return False
    if pw.pw_gid == gid:
        return True
    try:
        return gid in os.getgrouplist(pw.pw_name, pw.pw_gid)
    except OSError:
        return False


class Gate:
    """Decides whether a peer may use the control socket, and says why not.

    `gid` is the group whose members may (None: root and the agent's own uid
    only); `group` its name, for messages. `is_member(uid, gid)` consults the
    group database, `clock` (monotonic seconds) ages its cached answers.
    """

    def __init__(
        self,
        gid: int | None,
        group: str | None,
        *,
        own_uid: int | None = None,
        is_member: Callable[[int, int], bool] = uid_in_group,
        clock: Callable[[], float] = time.monotonic,
        ttl: float = MEMBER_CACHE_TTL,
    ) -> None:
        self.gid = gid
        self.group = group
        self._own_uid = os.geteuid() if own_uid is None else own_uid
        self._is_member = is_member
        self._clock = clock
        self._ttl = ttl
        self._member_cache: dict[int, tuple[bool, float]] = {}

    async def allows(self, peer: Peer) -> bool:
        """May `peer` run commands? Looks the group database up at most once per `ttl`."""
        if peer.uid in (0, self._own_uid):
            return True
        if self.gid is None:
            return False
        if peer.gid == self.gid:
            return True
        now = self._clock()
        cached = self._member_cache.get(peer.uid)
        if cached is None or now - cached[1] > self._ttl:
            # The group database may be remote (LDAP/sssd): never look it up on the loop.
            member = await asyncio.to_thread(self._is_member, peer.uid, self.gid)
            cached = (member, now)
            self._member_cache[peer.uid] = cached
        return cached[0]

    def refusal(self, peer: Peer) -> str:
        """The `forbidden` message: who may use the socket, and what to do about it."""
        if self.gid is None:
            return (
                f"uid {peer.uid} may not use the control socket: it is root-only because "
                f"the group {self.group or '(none configured)'} does not exist; "
                "run farmctl as root (sudo farmctl ...)"
            )
        return (
            f"uid {peer.uid} may not use the control socket: only root and members of "
            f"the group {self.group} may; ask an admin to run "
            f"'usermod -aG {self.group} <user>' or use sudo"
        )
