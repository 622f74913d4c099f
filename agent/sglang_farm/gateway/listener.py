"""I/O: the managed gateway's port is the farm's own smg before its admin key is sent there.

Issue 30, item 3: any local user can bind the managed gateway's port while it is free (the
agent stopped, smg restarting). The farm then sent that stranger its first `GET /workers`
with `Authorization: Bearer <admin key>`, and called the gateway "up". With the key the
stranger could take every worker out of the real gateway later. So every request that
carries a key to a managed gateway goes through `ListenerGuard`:

- before it (`verify`): the kernel's TCP tables are read afresh, and the sockets that a
  connection to the gateway's address could reach must all be held by the gateway's
  own processes (the same owner rule the workers' ports get: `host.portowner`,
  `host.listeners.judge`), the process tree of the child the agent started, or the
  processes of the gateway's systemd unit. Otherwise the request is not sent: a
  `GatewayError` (code NOT_OURS) names the holder, and the gateway counts as down.
  Whoever holds the port may have been sent the key before (by an agent older than
  this check, or unseen, below), so the first time a squat is seen the key is
  replaced too (`on_exposed`). A socket found ours is remembered by its inode (one
  socket for as long as it exists), so a fresh table read, without the walk of
  descriptors, answers the next requests;
- after it (`confirm`): the tables are read again. A listener that was not there before,
  and is not the gateway's own (a restarted smg's new socket), means the port changed
  hands while the request ran (smg gone, a stranger bound it), so the key may have
  reached someone else: `on_exposed` is called, and the agent
  replaces the key (`gateway.adminkey.rotate_admin_key`, then smg's restart: smg reads
  its key only at its start).

What it costs: two reads of the tables' listeners per request (`read_listening`: not the
connections, which make most of a busy host's table; docs/security.md has the figures),
one when requests follow each other (`REUSE_S`).

What is left open (docs/security.md): the two reads bracket the request, so a stranger
who binds the port and leaves again within one request's time (milliseconds), after smg
died and before the farm's connection, goes unseen; one who binds it between the reading
a request was let through on (at most `REUSE_S` old) and its connection gets the key, and
is seen by the read after it (the key is then replaced). The port itself is exclusive: while
smg's socket exists nobody else (but root) can listen there.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from sglang_farm.errors import GatewayError, GatewayErrorCode
from sglang_farm.host.listeners import (
    LISTEN,
    Listener,
    OwnerKind,
    connect_host,
    parse_listeners,
    reaches,
)
from sglang_farm.host.portowner import TABLES, ProcPortOwner

Pids = Callable[[], Awaitable[frozenset[int]]]
_CHUNK = 4096
# A reading this young (the check after one request) answers the check before the next:
# requests that follow each other (a removal's list, DELETE, list) cost one read each.
REUSE_S = 0.05


def read_listening(proc: str = "/proc") -> list[Listener]:
    """The LISTEN sockets of `/proc/net/tcp{,6}`, reading each table only as far as its
    listeners go. The kernel prints a table's listening hash first and its established
    one after it (net/ipv4/tcp_ipv4.c, `tcp_seq_next`: TCP_SEQ_STATE_LISTENING, then
    TCP_SEQ_STATE_ESTABLISHED), and generates the text as it is read: stopping at the
    first row of another state spares the walk of every connection (measured: 0.6 ms
    instead of 27 ms for a 3,516-line table holding 32 listeners)."""
    out: list[Listener] = []
    for table in TABLES:
        rows: list[str] = []
        try:
            with open(f"{proc}/{table}", "rb", buffering=0) as fh:
                rest, header, done = b"", True, False
                while not done:
                    chunk = fh.read(_CHUNK)
                    if not chunk:
                        break
                    *lines, rest = (rest + chunk).split(b"\n")
                    for line in lines:
                        fields = line.split()
                        if header:
                            header = False
                        elif len(fields) > 3 and fields[3].decode("ascii", "replace") != LISTEN:
                            done = True
                            break
                        rows.append(line.decode("ascii", "replace"))
        except OSError:
            continue
        out += parse_listeners("\n".join(rows))
    return out


class ListenerGuard:
    """The owner check of one managed gateway's address (`host:port`)."""

    def __init__(
        self,
        url: str,
        host: str,
        port: int,
        pids: Pids,
        *,
        proc: str = "/proc",
        on_exposed: Callable[[str], None] = lambda _why: None,
    ) -> None:
        self._url = url
        self._host = connect_host(host)
        self._port = port
        self._pids = pids
        self._proc = proc
        self._owner = ProcPortOwner(proc)
        self._verified: frozenset[int] = frozenset()
        self._squatted = False  # another process holds the port (said once per squat)
        self._seen: tuple[float, frozenset[int]] | None = None  # the last reading, when
        self._clock = time.monotonic
        self.on_exposed = on_exposed

    async def _now(self) -> frozenset[int]:
        """The inodes of the listeners a connection to the gateway could reach, read now."""
        listeners = await asyncio.to_thread(read_listening, self._proc)
        now = frozenset(x.inode for x in listeners if reaches(x, self._host, self._port))
        self._seen = (self._clock(), now)
        return now

    async def verify(self) -> frozenset[int]:
        """The gateway's listening sockets, once shown to be its own; else `GatewayError`
        (NOT_OURS naming the holder; UNREACHABLE when nothing listens)."""
        seen = self._seen
        fresh = seen is not None and self._clock() - seen[0] < REUSE_S
        if seen is not None and fresh and seen[1] and seen[1] <= self._verified:
            return seen[1]
        now = await self._now()
        if now and now <= self._verified:
            return now
        verdict = await self._owner.check(self._host, self._port, self._pids, fresh=True)
        if verdict.kind is OwnerKind.OURS:
            self._verified = verdict.inodes
            self._squatted = False
            return verdict.inodes
        self._verified = frozenset()
        if verdict.kind is OwnerKind.NONE:
            raise GatewayError(
                self._url,
                GatewayErrorCode.UNREACHABLE,
                f"nothing listens on port {self._port} yet (the farm's gateway is starting, "
                "or cannot start: its log says why)",
            )
        pid = f" (`kill {verdict.pid}`)" if verdict.pid is not None else ""
        if not self._squatted:
            # This agent sends it nothing, but whoever holds the port may have been sent
            # the key before: by an agent older than this check, or in the moment the two
            # reads around a request cannot see (module docstring). Replaced once per squat.
            self._squatted = True
            self.on_exposed(
                f"port {self._port} is held by {verdict.holder()}, not by the farm's gateway: "
                "an earlier request may have reached it"
            )
        raise GatewayError(
            self._url,
            GatewayErrorCode.NOT_OURS,
            f"port {self._port} is held by {verdict.holder()}, not by the farm's gateway: "
            f"the farm sends it no key and counts the gateway as down; stop that process"
            f"{pid}, and the farm's gateway starts on the port at its next attempt",
        )

    async def confirm(self, before: frozenset[int], what: str) -> None:
        """After a request sent with the key: were the listeners the same throughout?
        A new one that is not the gateway's own (smg restarted by itself or by the agent
        binds a new socket) means the key may have reached another process: `on_exposed`."""
        now = await self._now()
        if now <= before:
            return
        verdict = await self._owner.check(self._host, self._port, self._pids, fresh=True)
        if verdict.kind is OwnerKind.OURS:
            self._verified = verdict.inodes
            return
        self._verified = frozenset()
        self.on_exposed(
            f"port {self._port} changed hands while the farm sent {what} with the admin key "
            f"(listening sockets {sorted(before)} before, {sorted(now)} after)"
        )
