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

What it costs: two table reads per request (measured in docs/security.md: 6 ms a read of
a 1,062-line /proc/net/tcp on a loaded 2-core machine); the farm sends its gateway one
request every 10 s at rest, a few a second while it adds or removes workers.

What is left open (docs/security.md): the two reads bracket the request, so a stranger
who binds the port and leaves again within one request's time (milliseconds), after smg
died and before the farm's connection, goes unseen. The port itself is exclusive: while
smg's socket exists nobody else (but root) can listen there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from sglang_farm.errors import GatewayError, GatewayErrorCode
from sglang_farm.host.listeners import OwnerKind, connect_host, reaches
from sglang_farm.host.portowner import ProcPortOwner, read_listeners

Pids = Callable[[], Awaitable[frozenset[int]]]


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
        self.on_exposed = on_exposed

    async def _now(self) -> frozenset[int]:
        """The inodes of the listeners a connection to the gateway could reach, read now."""
        listeners = await asyncio.to_thread(read_listeners, self._proc)
        return frozenset(x.inode for x in listeners if reaches(x, self._host, self._port))

    async def verify(self) -> frozenset[int]:
        """The gateway's listening sockets, once shown to be its own; else `GatewayError`
        (NOT_OURS naming the holder; UNREACHABLE when nothing listens)."""
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
