"""I/O: the control socket server (asyncio, Unix stream socket, JSON lines).

It owns the socket file (stale sockets, mode and group), the connections, and
the path of one request: bytes → `codec.decode_request` → `auth.Gate` (the
peer's `SO_PEERCRED` credentials, before anything runs) → `handlers.Handlers`
→ a reply line. It maps what a handler raises to the reply's error code:
`RequestError` carries its own, the agent's `FarmError` is `failed`, anything
else is `internal` (the traceback goes to the log, never to the client).

Robustness: each connection is its own task with an idle timeout and bounded
writes, lines are capped at `codec.MAX_LINE`, and the number of connections is
capped below the descriptor limit; nothing a client sends or fails to read can block
another client. Issue 30, item 10: the cap keeps `ROOT_RESERVE` connections for root
(and the agent's own uid), so a group member holding every slot (1,024 `logs -f`
streams) never makes root's `farmctl status` busy; one such uid holds at most
`1/UID_SHARE` of the cap; and the bytes of unfinished lines held in all connections
together are bounded (`BUFFER_BUDGET`): past it, the non-root connection whose bytes
would overflow it is answered `busy` and closed. The socket is made only in a folder
no other user can write (`securepath`): one that could would let that user swap in its own socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import resource
import socket
import stat
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Final, SupportsIndex

import structlog

from sglang_farm.control import codec
from sglang_farm.control.auth import Gate, Peer, group_gid, peer_of
from sglang_farm.control.codec import ErrorCode, Request, RequestError, RequestId
from sglang_farm.control.farm_api import FarmOps
from sglang_farm.control.handlers import ClientGone, Handlers
from sglang_farm.errors import ControlSocketError, FarmError
from sglang_farm.host import fdbudget
from sglang_farm.host.securepath import folder_problem, make_folders

log = structlog.get_logger("sglang_farm.control")

# A person types a command within seconds; a script sends at once. 30 s frees the
# slot of a client that connected and went away without closing.
IDLE_TIMEOUT: Final = 30.0
# A client that does not read its reply for this long is dropped (its task only).
WRITE_TIMEOUT: Final = 10.0
# listen() queue. asyncio's default (100) makes a burst of non-blocking connects
# fail with EAGAIN; the kernel caps this at net.core.somaxconn.
BACKLOG: Final = 1024
# Connections beyond the cap that only root and the agent's own uid may take.
ROOT_RESERVE: Final = 16
# A uid other than root's (a group member) holds at most max_clients // UID_SHARE.
UID_SHARE: Final = 4
# The bytes of unfinished request lines held by all non-root connections together. A
# farmctl request is well under 1 KiB: 4 MiB is 64 lines at `codec.MAX_LINE` at once.
BUFFER_BUDGET: Final = 4 << 20


class _Budget:
    """The bytes held by every connection's reader; `limit` bounds the non-root ones."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0


class _CountedReader(asyncio.StreamReader):
    """A connection's reader that counts what it holds into the server's `_Budget`.

    A chunk that would take the budget past its limit is dropped and the connection's
    input ends there (`overflowed`), unless the peer is root's (`privileged`, set once
    its credentials are known): root may do anything to the agent anyway, and its
    commands must go through while another user holds the budget.
    """

    def __init__(self, budget: _Budget, limit: int) -> None:
        super().__init__(limit=limit)
        self._budget = budget
        self.held = 0
        self.privileged = False
        self.overflowed = False

    def feed_data(self, data: Iterable[SupportsIndex]) -> None:
        if self.overflowed:
            return
        size = len(data) if isinstance(data, bytes | bytearray | memoryview) else 0
        if not self.privileged and self._budget.used + size > self._budget.limit:
            self.overflowed = True
            self.feed_eof()
            return
        self.held += size
        self._budget.used += size
        super().feed_data(data)

    def _release(self, n: int) -> None:
        n = min(n, self.held)
        self.held -= n
        self._budget.used -= n

    async def line(self) -> bytes:
        """`readuntil(b"\n")`, its bytes given back to the budget (also a last partial
        line's, at EOF)."""
        try:
            data = await self.readuntil(b"\n")
        except asyncio.IncompleteReadError as exc:
            self._release(len(exc.partial))
            raise
        self._release(len(data))
        return data

    async def take(self, n: int) -> bytes:
        data = await self.read(n)
        self._release(len(data))
        return data

    def close(self) -> None:
        """The connection is gone: whatever it still holds goes back to the budget."""
        self._release(self.held)


class _Conn:
    def __init__(self, reader: _CountedReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def send(self, data: bytes) -> None:
        if self.writer.is_closing():
            raise ClientGone
        try:
            self.writer.write(data)
            await asyncio.wait_for(self.writer.drain(), WRITE_TIMEOUT)
        except (ConnectionError, TimeoutError, OSError) as exc:
            raise ClientGone from exc


class _RequestChannel:
    """`handlers.Channel`: one connection, bound to the id of the request it serves."""

    def __init__(self, conn: _Conn, rid: RequestId) -> None:
        self._conn = conn
        self._rid = rid

    async def stream(self, kind: str, payload: Mapping[str, object]) -> None:
        await self._conn.send(codec.encode_stream(self._rid, kind, payload))

    async def hangup(self) -> None:
        # EOF (b"") or any byte: either way the client is done with this stream.
        await self._conn.reader.take(1)


class ControlServer:
    """The control socket. `await start()` binds and listens; `await close()` stops and unlinks."""

    def __init__(
        self,
        ops: FarmOps,
        path: str,
        group: str | None,
        *,
        version: str,
        idle_timeout: float = IDLE_TIMEOUT,
        max_clients: int | None = None,  # None: from the descriptor limit (`_client_cap`)
        root_reserve: int = ROOT_RESERVE,
        buffer_budget: int = BUFFER_BUDGET,
    ) -> None:
        self._path = path
        self._group = group
        self._idle_timeout = idle_timeout
        self._max_clients = max_clients if max_clients is not None else _client_cap()
        # Root-only until start() has resolved the group.
        self._gate = Gate(None, group)
        self._handlers = Handlers(ops, version=version)
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self._root_reserve = root_reserve
        self._own_uid = os.geteuid()
        self._by_uid: Counter[int] = Counter()  # connections held, per non-root uid
        self._budget = _Budget(buffer_budget)

    @property
    def path(self) -> str:
        return self._path

    @property
    def max_clients(self) -> int:
        """Connections held at once; past it a newcomer is answered `busy` and closed
        (root and the agent's own uid: past it and `ROOT_RESERVE` more)."""
        return self._max_clients

    @property
    def buffered_bytes(self) -> int:
        """The bytes of unfinished request lines held now, in all connections."""
        return self._budget.used

    @property
    def group_gid(self) -> int | None:
        """The gid whose members may use the socket; None when root-only."""
        return self._gate.gid

    # --- lifecycle ---------------------------------------------------------------

    async def start(self) -> None:
        """Create the socket and listen. Raises `ControlSocketError` if a live agent holds it."""
        gid = self._resolve_group()
        self._gate = Gate(gid, self._group)
        sock = await self._bind()
        mode = 0o660 if gid is not None else 0o600
        try:
            # Ownership and mode are set before listen(): until then a connect()
            # is refused, so no client ever meets the socket with the wrong mode.
            if gid is not None:
                os.chown(self._path, -1, gid)
            os.chmod(self._path, mode)
            loop = asyncio.get_running_loop()
            self._server = await loop.create_unix_server(
                lambda: asyncio.StreamReaderProtocol(
                    _CountedReader(self._budget, codec.MAX_LINE), self._on_client
                ),
                sock=sock,
                backlog=BACKLOG,
            )
        except BaseException:
            sock.close()
            with contextlib.suppress(OSError):
                os.unlink(self._path)
            raise
        log.info(
            "control_listening",
            path=self._path,
            mode=oct(mode),
            group=self._group,
            max_clients=self._max_clients,
        )

    def _resolve_group(self) -> int | None:
        gid = group_gid(self._group)
        if gid is None and self._group is not None:
            # Decision: a missing group is not fatal (the agent must still run and be
            # reachable by root), but the socket is then root-only, never wider. Only
            # under the process runtime: under systemd the agent refuses such a config
            # (`accounts`), its unit naming the group. Said once, at info: a farm run by
            # hand as root (the demo) needs no group, and nothing is wrong.
            log.info(
                "control_socket_root_only",
                group=self._group,
                path=self._path,
                mode="0600",
                note=f"group {self._group} does not exist: only root may use farmctl; to let "
                f"others, groupadd --system {self._group} and restart the agent",
            )
        return gid

    async def _bind(self) -> socket.socket:
        parent = os.path.dirname(self._path) or "."
        make_folders(parent)
        # Never in a folder another user could write: it could swap in its own socket,
        # and root's farmctl would talk to it (issue 22, item 11).
        problem = folder_problem(parent, "the control socket's folder", "[control] socket")
        if problem is not None:
            raise ControlSocketError(problem)
        self._clear_stale()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(self._path)
        except OSError as exc:
            sock.close()
            raise ControlSocketError(
                f"cannot create the control socket at {self._path}: {exc.strerror}; "
                "check that its directory exists and is writable by the agent"
            ) from exc
        sock.setblocking(False)
        return sock

    def _clear_stale(self) -> None:
        """Remove a socket file left by a dead agent; refuse a path someone listens on.

        Only a refused connection (nothing listens on that socket) counts as stale.
        An AF_UNIX connect() completes or fails at once (connect(2)); no answer is
        ever awaited, so a slow or silent listener is never taken for a dead one,
        and a full listen queue (EAGAIN) means a live listener that is busy.
        """
        try:
            st = os.lstat(self._path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise ControlSocketError(
                f"{self._path} exists and is not a socket; move it away or set "
                "[control].socket to another path"
            )
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.setblocking(False)
            try:
                probe.connect(self._path)
            except OSError as exc:
                err = exc.errno if exc.errno is not None else errno.EIO
            else:
                err = 0
        if err == errno.ENOENT:
            return  # gone since the lstat: nothing to clear
        if err == errno.ECONNREFUSED:
            # Nobody listens: the file is left over from an agent that died.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path)
            log.info("control_stale_socket_removed", path=self._path)
            return
        if err == 0:
            raise ControlSocketError(
                f"another agent is already listening on {self._path}; stop it first "
                "(systemctl stop sglang-farm) or set [control].socket to another path"
            )
        if err == errno.EAGAIN:
            raise ControlSocketError(
                f"another process is listening on {self._path} but its connection queue "
                "is full; stop it first (systemctl stop sglang-farm) or set "
                "[control].socket to another path"
            )
        raise ControlSocketError(
            f"cannot probe {self._path}: {os.strerror(err)}; remove it if no agent uses it, "
            "or set [control].socket to another path"
        )

    async def close(self) -> None:
        """Stop listening, end every connection, and remove the socket file."""
        if self._server is not None:
            self._server.close()
        for t in list(self._conns):
            t.cancel()
        if self._conns:
            await asyncio.gather(*self._conns, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path)
            log.info("control_closed", path=self._path)

    # --- connections -------------------------------------------------------------

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        assert isinstance(reader, _CountedReader)  # made by start()'s protocol factory
        self._conns.add(task)
        conn = _Conn(reader, writer)
        counted: int | None = None
        try:
            try:
                peer = peer_of(writer.get_extra_info("socket"))
            except OSError:
                return  # gone before its credentials could be read
            reader.privileged = peer.uid in (0, self._own_uid)
            if not reader.privileged:
                counted = peer.uid
                self._by_uid[peer.uid] += 1
            busy = self._busy(peer, reader.privileged)
            if busy is not None:
                # Not logged: a line per refused connection would be a flood of its own.
                await conn.send(codec.encode_error(None, ErrorCode.BUSY, busy))
                return
            await self._serve(conn, peer)
        except ClientGone:
            pass
        except asyncio.CancelledError:
            raise
        except Exception:  # task root: one connection's bug must not end the server
            log.exception("control_connection_error")
        finally:
            self._conns.discard(task)
            if counted is not None:
                self._by_uid[counted] -= 1
                if self._by_uid[counted] <= 0:
                    del self._by_uid[counted]
            reader.close()
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1.0)

    def _busy(self, peer: Peer, privileged: bool) -> str | None:
        """Why this new connection is refused (counted already), or None."""
        held = len(self._conns)
        if privileged:
            if held > self._max_clients + self._root_reserve:
                return "too many control connections; try again shortly"
            return None
        if held > self._max_clients:
            return "too many control connections; try again shortly"
        share = max(1, self._max_clients // UID_SHARE)
        if self._by_uid[peer.uid] > share:
            return (
                f"uid {peer.uid} holds {share} control connections already (its share of "
                f"{self._max_clients}); close some (farmctl logs -f, wait-ready) and retry"
            )
        return None

    async def _serve(self, conn: _Conn, peer: Peer) -> None:
        while True:
            try:
                line = await asyncio.wait_for(conn.reader.line(), self._idle_timeout)
            except TimeoutError:
                log.debug("control_idle_timeout", pid=peer.pid, uid=peer.uid)
                return
            except asyncio.IncompleteReadError as exc:
                if conn.reader.overflowed:  # not logged either (a flood of its own)
                    await conn.send(
                        codec.encode_error(
                            None,
                            ErrorCode.BUSY,
                            "the control socket holds too many unfinished requests "
                            f"({self._budget.limit} bytes in all); connection closed, "
                            "try again shortly",
                        )
                    )
                    return
                # EOF: a last request without its newline is still served.
                if exc.partial.strip():
                    await self._handle_line(conn, exc.partial, peer)
                return
            except asyncio.LimitOverrunError:
                await conn.send(
                    codec.encode_error(
                        None,
                        ErrorCode.BAD_REQUEST,
                        f"request longer than {codec.MAX_LINE} bytes; connection closed",
                    )
                )
                return
            except (ConnectionError, OSError):
                return
            if not line.strip():
                continue
            await self._handle_line(conn, line, peer)

    async def _handle_line(self, conn: _Conn, line: bytes, peer: Peer) -> None:
        try:
            req = codec.decode_request(line)
        except RequestError as exc:
            await conn.send(codec.encode_error(exc.request_id, exc.error_code, exc.message))
            return
        try:
            if not await self._gate.allows(peer):
                log.warning(
                    "control_forbidden", cmd=str(req.cmd), uid=peer.uid, gid=peer.gid, pid=peer.pid
                )
                raise RequestError(ErrorCode.FORBIDDEN, self._gate.refusal(peer), req.id)
            if req.changes_state:
                log.info(
                    "control_command",
                    cmd=str(req.cmd),
                    args=_args_log(req),
                    request_id=req.id,
                    uid=peer.uid,
                    pid=peer.pid,
                )
            result = await self._handlers.handle(req, _RequestChannel(conn, req.id))
            await conn.send(codec.encode_ok(req.id, result))
        except RequestError as exc:
            await conn.send(codec.encode_error(req.id, exc.error_code, exc.message))
        except ClientGone:
            raise
        except FarmError as exc:
            log.warning(
                "control_command_failed", cmd=str(req.cmd), request_id=req.id, error=str(exc)
            )
            await conn.send(codec.encode_error(req.id, ErrorCode.FAILED, str(exc)))
        except asyncio.CancelledError:
            raise
        except Exception:  # task root for one request: log it, answer `internal`, keep serving
            log.exception("control_internal_error", cmd=str(req.cmd), request_id=req.id)
            await conn.send(
                codec.encode_error(
                    req.id,
                    ErrorCode.INTERNAL,
                    f"internal error while running {req.cmd} (request id {req.id}); "
                    "see the agent's log: journalctl -u sglang-farm",
                )
            )


def _client_cap() -> int:
    """The default cap: `fdbudget.control_client_cap` of this process's soft descriptor limit.

    1,024 under the unit's LimitNOFILE=65536 (far above any real use), an eighth of a
    smaller limit: a flood of idle connections gets `busy` at once and never drives
    accept() into EMFILE, where the next farmctl would wait unanswered (issue 22, item 13).
    """
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return fdbudget.control_client_cap(fdbudget.usable(soft, resource.RLIM_INFINITY))


def _args_log(req: Request) -> dict[str, object]:
    """The request's arguments, for the log line of a state change."""
    a = req.args
    return {k: getattr(a, k) for k in getattr(a, "__slots__", ())}
