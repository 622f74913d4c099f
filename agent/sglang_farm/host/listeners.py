"""Pure: who listens on a worker's port, from the kernel's TCP tables, and whether it is the worker.

A worker is ready only when the socket listening on its port belongs to its own process
tree: whatever answers `/health` on the port is otherwise trusted with users' requests,
and SGLang binds its port only after loading the model (minutes), so any local user can
bind it first (docs/security.md). The I/O shell (`portowner`) reads `/proc/net/tcp` and
`/proc/net/tcp6`, finds which processes hold the listening sockets (`/proc/PID/fd`), and
this module parses the tables and judges the result.

`/proc/net/tcp` rows (proc_net_tcp(5), the kernel's `tcp4_seq_show`):

    sl  local_address rem_address   st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode ...
     0: 0100007F:7531 00000000:0000 0A 00000000:00000000 00:00000000 00000000 0   0       41562 ...

The address is the kernel's 32-bit words printed with `%08X` in host byte order (so
127.0.0.1 reads `0100007F` on a little-endian host), the port is plain hex, state `0A`
is TCP_LISTEN, `uid` is the socket's owner and `inode` names the socket
(`/proc/PID/fd/N -> socket:[inode]`).
"""

from __future__ import annotations

import ipaddress
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

LISTEN = "0A"  # TCP_LISTEN in include/net/tcp_states.h, as /proc/net/tcp prints it

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True, slots=True)
class Listener:
    """One listening TCP socket: its local address and port, owner uid and inode."""

    address: IPAddress
    port: int
    uid: int
    inode: int


def _address(hexaddr: str, byteorder: Literal["little", "big"]) -> IPAddress:
    raw = bytes.fromhex(hexaddr)
    # Each 32-bit word was printed as a host-order integer: undo that per word.
    words = [raw[i : i + 4] for i in range(0, len(raw), 4)]
    packed = b"".join(w[::-1] if byteorder == "little" else w for w in words)
    return ipaddress.IPv4Address(packed) if len(packed) == 4 else ipaddress.IPv6Address(packed)


def parse_listeners(
    text: str, *, byteorder: Literal["little", "big"] = sys.byteorder
) -> list[Listener]:
    """The LISTEN sockets of one `/proc/net/tcp` or `/proc/net/tcp6` text.

    The header and rows that do not parse (a truncated read, a future column layout) are
    skipped, never raised on: a row not understood is a listener not seen, and an unseen
    listener never makes a worker ready (`judge`).
    """
    out: list[Listener] = []
    for line in text.splitlines():
        f = line.split()
        if len(f) < 10 or f[3] != LISTEN or not f[0].endswith(":"):
            continue
        local = f[1]
        addr, sep, port = local.rpartition(":")
        try:
            if not sep or len(addr) not in (8, 32):
                continue
            inode = int(f[9])
            if inode == 0:
                continue  # no socket inode (a socket being torn down): nothing to trace
            out.append(Listener(_address(addr, byteorder), int(port, 16), int(f[7]), inode))
        except ValueError:
            continue
    return out


def reaches(listener: Listener, host: str, port: int) -> bool:
    """Would a connection to `host:port` (the worker's address) land on `listener`?

    A wildcard listener (0.0.0.0, or :: which also takes IPv4 unless IPV6_V6ONLY, which
    the table does not show) takes every address of its port. A `host` that is not an IP
    literal (a name) could resolve to any address: every listener on the port counts.
    """
    if listener.port != port:
        return False
    try:
        target = ipaddress.ip_address(host)
    except ValueError:
        return True
    addr = listener.address
    if addr.is_unspecified:
        return addr.version == 6 or target.version == 4
    if addr == target:
        return True
    mapped = addr.ipv4_mapped if isinstance(addr, ipaddress.IPv6Address) else None
    return mapped is not None and mapped == target


def connect_host(host: str) -> str:
    """The address the agent reaches a worker configured on `host` at (as `base_url`):
    a wildcard is reached on loopback."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


class OwnerKind(StrEnum):
    OURS = "ours"  # every listener on the address is the worker's own
    NONE = "none"  # nothing listens there (yet: SGLang binds after loading)
    FOREIGN = "foreign"  # another process, or another user's socket, holds a listener
    UNSEEN = "unseen"  # a listener no visible process holds: not proven the worker's


@dataclass(frozen=True, slots=True)
class Ownership:
    """The verdict on the listeners of one worker's address.

    For FOREIGN and UNSEEN: `pid` (when a holder was seen) and `uid` of the listener that
    is not the worker's; `user` is filled in by the I/O shell (a passwd lookup).
    `inodes`: the listeners judged (the I/O shell remembers those found OURS).
    """

    kind: OwnerKind
    port: int
    pid: int | None = None
    uid: int | None = None
    user: str | None = None
    inodes: frozenset[int] = frozenset()
    # No holder seen: the processes of the socket's user, the operator's lead (I/O fills).
    candidates: tuple[int, ...] = ()

    def holder(self) -> str:
        """ "PID 4242 (user nobody)", or what is known when no holder could be seen."""
        who = self.user if self.user is not None else f"uid {self.uid}"
        if self.pid is not None:
            return f"PID {self.pid} (user {who})"
        if not self.candidates:
            return f"a process of user {who} (the agent cannot see which)"
        shown = ", ".join(str(p) for p in self.candidates[:_SHOWN])
        more = ", ..." if len(self.candidates) > _SHOWN else ""
        return (
            f"a process of user {who} (the agent cannot see which; that user runs "
            f"PID {shown}{more})"
        )


_SHOWN = 5  # candidate pids named in a summary


def judge(
    listeners: Iterable[Listener],
    host: str,
    port: int,
    *,
    ours: frozenset[int],
    holders: Mapping[int, frozenset[int]],
    our_uids: frozenset[int] = frozenset(),
) -> Ownership:
    """Whose are the listeners a connection to `host:port` could reach?

    `ours`: the socket inodes held by the worker's own processes. `holders`: for the
    other inodes, the pids found holding them (absent or empty: none found). `our_uids`:
    the users the worker's processes run as.

    A socket no process can be seen holding (an agent without CAP_SYS_PTRACE, as the
    hardened systemd unit runs, sees no other user's descriptors) is judged by its
    owner: another user's is FOREIGN; the worker's own user's counts as the worker's
    (only that user, or root, could have bound it); with no worker process to compare
    with, UNSEEN. A foreign holder wins over an unseen one, which wins over ours: a
    socket sharing the address (SO_REUSEPORT) with anyone else gets part of the traffic.
    """
    mine = [lst for lst in listeners if reaches(lst, host, port)]
    inodes = frozenset(lst.inode for lst in mine)
    if not mine:
        return Ownership(OwnerKind.NONE, port)
    unseen: Listener | None = None
    for lst in sorted(mine, key=lambda x: x.inode):
        if lst.inode in ours:
            continue
        pids = holders.get(lst.inode, frozenset())
        if pids:
            return Ownership(OwnerKind.FOREIGN, port, min(pids), lst.uid, inodes=inodes)
        if lst.uid in our_uids:
            continue
        if our_uids:
            return Ownership(OwnerKind.FOREIGN, port, None, lst.uid, inodes=inodes)
        unseen = unseen or lst
    if unseen is not None:
        return Ownership(OwnerKind.UNSEEN, port, None, unseen.uid, inodes=inodes)
    return Ownership(OwnerKind.OURS, port, inodes=inodes)
