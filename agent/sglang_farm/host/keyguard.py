"""I/O: a worker's API key goes only to the worker's own listener (docs/security.md).

The agent runs as root and sends `Authorization: Bearer <[sglang] api_key>` to workers'
ports: the canary's paired probes and scrapes, the metrics pollers. A worker's port is
free while the worker is down, and any local user may bind it then; without a check that
user would be sent the key. So every sender of a worker's key asks `KeyGuard.refusal`
first, under the readiness rule (`host.portowner`, `host.listeners.judge`): the sockets a
connection to the port could reach must all be held by the worker's own processes (its
unit's cgroup, or the process tree the agent started).

Refused, the request is not sent at all (not sent without the key): whatever answers on
a port that is not the worker's is no figure of the worker, and a forged `/metrics` or
probe answer would sway a canary's verdict. Nothing listening is refused too: the request
could only fail, and a stranger binding the port meanwhile would get the key.

What it costs: the port owner's reading (a sock_diag dump, shared by every check for
`portowner.TABLE_TTL_S`) and, for a listener already found the worker's, nothing else: a
verified socket is remembered by its inode. The descriptors are walked only when the
listener changes. What is left open: a stranger who binds the port between the reading a
request was let through on (at most `TABLE_TTL_S` old) and the connection; the port is
exclusive, so that needs the worker's socket gone within that second.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

import structlog

from sglang_farm.host.listeners import OwnerKind, connect_host
from sglang_farm.host.portowner import PortOwner, ProcPortOwner

log = structlog.get_logger("sglang_farm.keyguard")

Pids = Callable[[int], Awaitable[frozenset[int]]]


class KeyGuard:
    """Says, per request, whether a worker's key may go to `url` (the worker's port)."""

    def __init__(
        self,
        pids: Pids,
        owner: PortOwner | None = None,
        *,
        gpu: Callable[[int], object] = lambda _w: None,
    ) -> None:
        """`pids`: a worker's own processes (`Runtime.worker_pids`); `owner`: the agent's
        port owner (its inode cache shared with the liveness watcher); `gpu`: a worker's
        GPU(s), for the warning."""
        self._pids = pids
        self._owner: PortOwner = owner or ProcPortOwner()
        self._gpu = gpu
        self._said: dict[int, tuple[object, ...]] = {}  # worker -> the refusal last warned

    async def refusal(self, worker: int, url: str) -> str | None:
        """None when the listener on `url`'s port is the worker's own; else why the farm
        sends it nothing (the request must not be sent). Warns once per foreign holder."""
        try:
            parts = urlsplit(url)
            hostname, port = parts.hostname, parts.port
        except ValueError as exc:  # a port out of range or not a number
            return f"{url}: no port to check the listener of ({exc}): nothing sent"
        if hostname is None or port is None:
            return f"{url}: no host and port to check the listener of"
        host = connect_host(hostname)
        try:
            own = await self._owner.check(host, port, lambda: self._pids(worker), whose=worker)
        except Exception as exc:  # an unreadable /proc proves nothing: nothing is sent
            return f"port {port}: its listener could not be read ({exc!r}): no key sent"
        if own.kind is OwnerKind.OURS:
            self._said.pop(worker, None)
            return None
        if own.kind is OwnerKind.NONE:
            return f"nothing listens on port {port}: the request is not sent"
        why = (
            f"port {port} is held by {own.holder()}, not by worker {worker}: the farm sends "
            "it no request and no API key"
        )
        said = (own.kind, own.pid, own.uid, own.inodes)
        if self._said.get(worker) != said:
            self._said[worker] = said
            kill = f"; stop that process (`kill {own.pid}`)" if own.pid is not None else ""
            log.warning(
                "worker_key_withheld",
                worker=worker,
                gpu=self._gpu(worker),
                port=port,
                owner_uid=own.uid,
                owner_pid=own.pid,
                why=why + kill,
            )
        return why
