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
another client. The socket is made only in a folder no other user can write
(`securepath`): one that could would let that user swap in its own socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import resource
import socket
import stat
from collections.abc import Mapping
from typing import Final

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


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
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
        await self._conn.reader.read(1)


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

    @property
    def path(self) -> str:
        return self._path

    @property
    def max_clients(self) -> int:
        """Connections held at once; past it a newcomer is answered `busy` and closed."""
        return self._max_clients

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
            self._server = await asyncio.start_unix_server(
                self._on_client, sock=sock, limit=codec.MAX_LINE, backlog=BACKLOG
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
        self._conns.add(task)
        conn = _Conn(reader, writer)
        try:
            if len(self._conns) > self._max_clients:
                await conn.send(
                    codec.encode_error(
                        None, ErrorCode.BUSY, "too many control connections; try again shortly"
                    )
                )
                return
            peer = peer_of(writer.get_extra_info("socket"))
            await self._serve(conn, peer)
        except ClientGone:
            pass
        except asyncio.CancelledError:
            raise
        except Exception:  # task root: one connection's bug must not end the server
            log.exception("control_connection_error")
        finally:
            self._conns.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1.0)

    async def _serve(self, conn: _Conn, peer: Peer) -> None:
        while True:
            try:
                line = await asyncio.wait_for(conn.reader.readuntil(b"\n"), self._idle_timeout)
            except TimeoutError:
                log.debug("control_idle_timeout", pid=peer.pid, uid=peer.uid)
                return
            except asyncio.IncompleteReadError as exc:
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
