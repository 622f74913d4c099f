"""I/O: the control socket server (asyncio, Unix stream socket, JSON lines).

It decodes requests (`codec`), checks the peer's credentials (`SO_PEERCRED`),
serializes state changes per worker, and dispatches to the agent's `FarmOps`.
It never calls a worker, NVML or systemd itself: everything it reads comes from
`ops.view()` / `ops.gpu_memory()`, which never block.

Who may do what (docs/control-protocol.md, "Permissions"):
- the socket file is `0660 root:<group>`; when the group does not exist on this
  host it is `0600` (root only) and a warning is logged;
- every command is allowed to uid 0, to the agent's own uid, and to members of
  the group (primary gid, or a supplementary member per the group database);
  everyone else gets `forbidden`. The file mode is the first gate, the peer
  credentials the second (they still hold if someone loosens the mode).

Robustness: each connection is its own task with an idle timeout and bounded
writes, lines are capped at `codec.MAX_LINE`, and the number of connections is
capped; nothing a client sends or fails to read can block another client.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import grp
import os
import pwd
import socket
import stat
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Final

import structlog

from sglang_farm.control import codec
from sglang_farm.control.codec import Command, ErrorCode, Request, RequestError
from sglang_farm.errors import FarmError
from sglang_farm.ops import FarmOps
from sglang_farm.views import FarmView, Phase, WorkerView

log = structlog.get_logger("sglang_farm.control")

# A person types a command within seconds; a script sends at once. 30 s frees the
# slot of a client that connected and went away without closing.
IDLE_TIMEOUT: Final = 30.0
# A client that does not read its reply for this long is dropped (its task only).
WRITE_TIMEOUT: Final = 10.0
# Far above any real use (a few operators, a router polling endpoints); bounds fds.
MAX_CLIENTS: Final = 1024
# listen() queue. asyncio's default (100) makes a burst of non-blocking connects
# fail with EAGAIN; the kernel caps this at net.core.somaxconn.
BACKLOG: Final = 1024
# How often `wait-ready` looks at the view for a new phase: view() is a pointer read.
WAIT_POLL: Final = 0.1

# Group membership looked up per uid at most this often (a usermod -aG takes effect
# within a minute, and a burst of farmctl calls costs one lookup).
MEMBER_CACHE_TTL: Final = 60.0

_PEERCRED = struct.Struct("3i")  # struct ucred {pid_t pid; uid_t uid; gid_t gid;}


class ControlSocketError(FarmError):
    """The control socket could not be created (path in use by a live agent, not a socket...)."""


@dataclass(frozen=True, slots=True)
class Peer:
    pid: int
    uid: int
    gid: int


class _Closed(Exception):
    """The client went away or stopped reading; end its connection quietly."""


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def send(self, data: bytes) -> None:
        if self.writer.is_closing():
            raise _Closed
        try:
            self.writer.write(data)
            await asyncio.wait_for(self.writer.drain(), WRITE_TIMEOUT)
        except (ConnectionError, TimeoutError, OSError) as exc:
            raise _Closed from exc


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
        max_clients: int = MAX_CLIENTS,
    ) -> None:
        self._ops = ops
        self._path = path
        self._group = group
        self._version = version
        self._idle_timeout = idle_timeout
        self._max_clients = max_clients
        self._gid: int | None = None
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self._worker_locks: dict[int, asyncio.Lock] = {}
        self._reload_lock = asyncio.Lock()
        self._member_cache: dict[int, tuple[bool, float]] = {}
        self._handlers: dict[Command, Callable[[_Conn, Request, Peer], Awaitable[None]]] = {
            Command.STATUS: self._status,
            Command.VERSION: self._version_cmd,
            Command.ENDPOINTS: self._endpoints,
            Command.WHY: self._why,
            Command.LOGS: self._logs,
            Command.WAIT_READY: self._wait_ready,
            Command.START: self._start,
            Command.STOP: self._stop,
            Command.RESTART: self._restart,
            Command.RESET_OOM: self._reset_oom,
            Command.RELOAD: self._reload,
        }

    @property
    def path(self) -> str:
        return self._path

    @property
    def group_gid(self) -> int | None:
        """The gid whose members may use the socket; None when root-only."""
        return self._gid

    # --- lifecycle ---------------------------------------------------------------

    async def start(self) -> None:
        """Create the socket and listen. Raises `ControlSocketError` if a live agent holds it."""
        self._gid = self._resolve_group()
        sock = await self._bind()
        mode = 0o660 if self._gid is not None else 0o600
        try:
            # Ownership and mode are set before listen(): until then a connect()
            # is refused, so no client ever meets the socket with the wrong mode.
            if self._gid is not None:
                os.chown(self._path, -1, self._gid)
            os.chmod(self._path, mode)
            self._server = await asyncio.start_unix_server(
                self._on_client, sock=sock, limit=codec.MAX_LINE, backlog=BACKLOG
            )
        except BaseException:
            sock.close()
            with contextlib.suppress(OSError):
                os.unlink(self._path)
            raise
        log.info("control_listening", path=self._path, mode=oct(mode), group=self._group)

    def _resolve_group(self) -> int | None:
        if self._group is None:
            return None
        try:
            return grp.getgrnam(self._group).gr_gid
        except KeyError:
            # Decision: a missing group is not fatal (the agent must still run and be
            # reachable by root), but the socket is then root-only, never wider.
            log.warning(
                "control_group_missing",
                group=self._group,
                path=self._path,
                mode="0600",
                hint=f"create it (groupadd --system {self._group}) and restart sglang-farm",
            )
            return None

    async def _bind(self) -> socket.socket:
        parent = os.path.dirname(self._path) or "."
        os.makedirs(parent, mode=0o755, exist_ok=True)
        await self._clear_stale()
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

    async def _clear_stale(self) -> None:
        try:
            st = os.lstat(self._path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise ControlSocketError(
                f"{self._path} exists and is not a socket; move it away or set "
                "[control].socket to another path"
            )
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.setblocking(False)
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(loop.sock_connect(probe, self._path), 2.0)
        except (ConnectionRefusedError, FileNotFoundError, TimeoutError):
            # Nobody listens: the file is left over from an agent that died.
            log.info("control_stale_socket_removed", path=self._path)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path)
            return
        except OSError as exc:
            if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._path)
                return
            raise ControlSocketError(f"cannot probe {self._path}: {exc.strerror}") from exc
        finally:
            probe.close()
        raise ControlSocketError(
            f"another agent is already listening on {self._path}; stop it first "
            "(systemctl stop sglang-farm) or set [control].socket to another path"
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
            peer = _peer_of(writer)
            await self._serve(conn, peer)
        except _Closed:
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
            if not await self._allowed(peer):
                log.warning(
                    "control_forbidden", cmd=str(req.cmd), uid=peer.uid, gid=peer.gid, pid=peer.pid
                )
                raise RequestError(ErrorCode.FORBIDDEN, self._who_may(peer), req.id)
            if req.changes_state:
                log.info(
                    "control_command",
                    cmd=str(req.cmd),
                    args=_args_log(req),
                    request_id=req.id,
                    uid=peer.uid,
                    pid=peer.pid,
                )
            await self._handlers[req.cmd](conn, req, peer)
        except RequestError as exc:
            await conn.send(codec.encode_error(req.id, exc.error_code, exc.message))
        except _Closed:
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

    # --- permissions -------------------------------------------------------------

    async def _allowed(self, peer: Peer) -> bool:
        if peer.uid in (0, os.geteuid()):
            return True
        if self._gid is None:
            return False
        if peer.gid == self._gid:
            return True
        now = time.monotonic()
        cached = self._member_cache.get(peer.uid)
        if cached is None or now - cached[1] > MEMBER_CACHE_TTL:
            # The group database may be remote (LDAP/sssd): never look it up on the loop.
            member = await asyncio.to_thread(_uid_in_group, peer.uid, self._gid)
            cached = (member, now)
            self._member_cache[peer.uid] = cached
        return cached[0]

    def _who_may(self, peer: Peer) -> str:
        if self._gid is None:
            return (
                f"uid {peer.uid} may not use the control socket: it is root-only because "
                f"the group {self._group or '(none configured)'} does not exist; "
                "run farmctl as root (sudo farmctl ...)"
            )
        return (
            f"uid {peer.uid} may not use the control socket: only root and members of "
            f"the group {self._group} may; ask an admin to run "
            f"'usermod -aG {self._group} <user>' or use sudo"
        )

    # --- helpers -----------------------------------------------------------------

    def _view(self) -> FarmView:
        return self._ops.view()

    def _known(self, view: FarmView, worker: int, rid: codec.RequestId) -> WorkerView:
        try:
            return view.worker(worker)
        except KeyError:
            ids = [w.id for w in view.workers]
            raise RequestError(
                ErrorCode.UNKNOWN_WORKER,
                f"no worker {worker}; workers are {codec.describe_ids(ids)}",
                rid,
            ) from None

    def _targets(self, req: Request) -> list[int]:
        assert isinstance(req.args, codec.TargetArgs)
        view = self._view()
        if req.args.worker == "all":
            return [w.id for w in view.workers]
        return [self._known(view, req.args.worker, req.id).id]

    @contextlib.asynccontextmanager
    async def _locked(self, ids: Sequence[int], req: Request) -> AsyncIterator[None]:
        """Hold every named worker's lock, or answer `busy` without waiting."""
        locks = [self._worker_locks.setdefault(i, asyncio.Lock()) for i in sorted(set(ids))]
        busy = [i for i, lk in zip(sorted(set(ids)), locks, strict=True) if lk.locked()]
        if busy:
            raise RequestError(
                ErrorCode.BUSY,
                f"worker {codec.describe_ids(busy)} is busy with another state change; "
                "wait for it to finish (farmctl status) and try again",
                req.id,
            )
        # No await between the check and the acquisitions: nothing can slip in.
        for lk in locks:
            await lk.acquire()
        try:
            yield
        finally:
            for lk in locks:
                lk.release()

    # --- read-only commands ------------------------------------------------------

    async def _status(self, conn: _Conn, req: Request, peer: Peer) -> None:
        result = codec.status_result(
            self._view(),
            self._ops.gpu_memory(),
            version=self._version,
            now=time.time(),
            queues=self._ops.queue_depths(),
        )
        await conn.send(codec.encode_ok(req.id, result))

    async def _version_cmd(self, conn: _Conn, req: Request, peer: Peer) -> None:
        await conn.send(codec.encode_ok(req.id, codec.version_result(self._version)))

    async def _endpoints(self, conn: _Conn, req: Request, peer: Peer) -> None:
        await conn.send(codec.encode_ok(req.id, codec.endpoints_result(self._view())))

    async def _why(self, conn: _Conn, req: Request, peer: Peer) -> None:
        assert isinstance(req.args, codec.WorkerArgs)
        w = self._known(self._view(), req.args.worker, req.id)
        await conn.send(codec.encode_ok(req.id, codec.why_result(w)))

    async def _logs(self, conn: _Conn, req: Request, peer: Peer) -> None:
        a = req.args
        assert isinstance(a, codec.LogsArgs)
        self._known(self._view(), a.worker, req.id)
        tail = list(await self._ops.logs(a.worker, a.lines)) if a.lines else []
        if not a.follow:
            await conn.send(codec.encode_ok(req.id, {"worker": a.worker, "lines": tail}))
            return
        for ln in tail:
            await conn.send(codec.encode_stream(req.id, "line", {"line": ln}))
        # Follow until the client hangs up (seen as EOF on its side of the socket)
        # or the log source ends; a quiet worker must not hold a dead connection.
        eof = asyncio.ensure_future(conn.reader.read(1))
        source = self._ops.follow_logs(a.worker)
        try:
            while True:
                nxt = asyncio.ensure_future(anext(source))
                done, _ = await asyncio.wait({nxt, eof}, return_when=asyncio.FIRST_COMPLETED)
                if nxt not in done:
                    nxt.cancel()
                    with contextlib.suppress(BaseException):
                        await nxt
                    raise _Closed
                try:
                    ln = nxt.result()
                except StopAsyncIteration:
                    break
                await conn.send(codec.encode_stream(req.id, "line", {"line": ln}))
        finally:
            eof.cancel()
            with contextlib.suppress(BaseException):
                await eof
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
        await conn.send(codec.encode_ok(req.id, {"worker": a.worker, "ended": True}))

    async def _wait_ready(self, conn: _Conn, req: Request, peer: Peer) -> None:
        """Stream phase changes until ready/failed (entered at or after `after`) or timeout.

        Polls `view()` (a reference read): the progress lines need every phase, and
        `after` must skip a ready phase that predates the restart the client just issued.
        """
        a = req.args
        assert isinstance(a, codec.WaitArgs)
        self._known(self._view(), a.worker, req.id)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        last: tuple[Phase, float] | None = None
        while True:
            w = self._known(self._view(), a.worker, req.id)
            elapsed = loop.time() - t0
            if (w.phase, w.since) != last:
                last = (w.phase, w.since)
                await conn.send(
                    codec.encode_stream(req.id, "phase", codec.phase_payload(w, elapsed))
                )
            settled = w.phase in (Phase.READY, Phase.FAILED) and w.since >= a.after
            if settled or elapsed >= a.timeout:
                result = codec.worker_result(w)
                result["ready"] = w.phase is Phase.READY and settled
                result["timed_out"] = not settled
                result["waited_s"] = round(elapsed, 3)
                await conn.send(codec.encode_ok(req.id, result))
                return
            await asyncio.sleep(min(WAIT_POLL, max(a.timeout - elapsed, 0.0)))

    # --- state-changing commands -------------------------------------------------

    async def _start(self, conn: _Conn, req: Request, peer: Peer) -> None:
        await self._change(conn, req, self._ops.start)

    async def _stop(self, conn: _Conn, req: Request, peer: Peer) -> None:
        await self._change(conn, req, self._ops.stop)

    async def _restart(self, conn: _Conn, req: Request, peer: Peer) -> None:
        await self._change(conn, req, self._ops.restart)

    async def _change(
        self, conn: _Conn, req: Request, op: Callable[[Sequence[int]], Awaitable[None]]
    ) -> None:
        ids = self._targets(req)
        async with self._locked(ids, req):
            # Taken before the call: every phase the agent enters for this request
            # has `since >= issued_at`, which `wait-ready after=` relies on.
            issued_at = time.time()
            await op(ids)
        await conn.send(codec.encode_ok(req.id, {"workers": ids, "issued_at": issued_at}))

    async def _reset_oom(self, conn: _Conn, req: Request, peer: Peer) -> None:
        assert isinstance(req.args, codec.WorkerArgs)
        w = self._known(self._view(), req.args.worker, req.id)
        async with self._locked([w.id], req):
            self._ops.reset_oom(w.id)
        await conn.send(codec.encode_ok(req.id, {"worker": w.id, "oom_step": 0}))

    async def _reload(self, conn: _Conn, req: Request, peer: Peer) -> None:
        if self._reload_lock.locked():
            raise RequestError(
                ErrorCode.BUSY, "a reload is already in progress; wait for it and retry", req.id
            )
        async with self._reload_lock:
            r = await self._ops.reload()
        log.info(
            "control_reload_done",
            request_id=req.id,
            applied=r.applied,
            problems=len(r.problems),
            restarted=list(r.restarted),
        )
        await conn.send(codec.encode_ok(req.id, codec.reload_result(r)))


def _peer_of(writer: asyncio.StreamWriter) -> Peer:
    sock = writer.get_extra_info("socket")
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    pid, uid, gid = _PEERCRED.unpack(raw)
    return Peer(pid, uid, gid)


def _uid_in_group(uid: int, gid: int) -> bool:
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


def _args_log(req: Request) -> dict[str, object]:
    a = req.args
    return {k: getattr(a, k) for k in getattr(a, "__slots__", ())}
