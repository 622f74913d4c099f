"""I/O: a small blocking client for the control socket (what farmctl uses).

One connection per call: connect, send one request line, read reply lines until
the final one. Kept to the standard library and `wire` (not `codec`, whose dataclasses
and enums cost more at import than the rest of `farmctl status`) so that farmctl starts fast.
"""

from __future__ import annotations

import itertools
import socket
from collections.abc import Iterator, Mapping
from typing import BinaryIO

from sglang_farm.control import wire
from sglang_farm.control.wire import Reply
from sglang_farm.errors import (
    AgentError,
    AgentUnreachable,
    ProtocolError,
    SocketPermissionDenied,
    UntrustedSocket,
)
from sglang_farm.host.paths import DEFAULT_SOCKET
from sglang_farm.host.securepath import socket_problem

# Read-only answers come from state the agent already holds: seconds are plenty.
DEFAULT_TIMEOUT = 15.0
# stop drains each worker first (at most [gateway] drain_timeout, 60 s by default),
# then waits for the process tree to exit (SIGKILL after restart.stop_timeout,
# 60 s by default).
CHANGE_TIMEOUT = 900.0


class Client:
    """Talks to the agent at `path`. Every method opens its own connection."""

    def __init__(self, path: str = DEFAULT_SOCKET, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.path = path
        self.timeout = timeout
        self._ids = itertools.count(1)

    def call(
        self, cmd: str, args: Mapping[str, object] | None = None, *, timeout: float | None = None
    ) -> object:
        """Send one request; return its `result`. Raises `AgentError` on an error reply."""
        for reply in self.stream(cmd, args, timeout=timeout):
            if reply.final:
                return reply.result
        raise AgentUnreachable(self.path, "the agent closed the connection without a reply")

    def stream(
        self,
        cmd: str,
        args: Mapping[str, object] | None = None,
        *,
        timeout: float | None = None,
    ) -> Iterator[Reply]:
        """Yield every reply line (stream messages, then the final one).

        `timeout` bounds each wait for a line (None: `self.timeout`; 0: no bound).
        Raises `AgentError` for an error reply, `AgentUnreachable` if the
        connection fails or ends before the final reply, and `UntrustedSocket` (before
        connecting) for a socket another user could have put there (`securepath`).
        """
        rid = next(self._ids)
        limit = self.timeout if timeout is None else (timeout or None)
        sock = self._connect()
        try:
            sock.settimeout(limit)
            try:
                sock.sendall(wire.encode_request(rid, cmd, args))
                # Closed explicitly: a socket's fd stays open while a makefile() lives.
                with sock.makefile("rb") as f:
                    yield from self._replies(f)
            except TimeoutError as exc:
                raise AgentUnreachable(
                    self.path, f"no answer within {limit:g} s (the agent may be stuck)"
                ) from exc
            except (ConnectionError, BrokenPipeError) as exc:
                raise AgentUnreachable(self.path, f"connection lost ({exc.strerror})") from exc
        finally:
            sock.close()

    def _replies(self, f: BinaryIO) -> Iterator[Reply]:
        while True:
            line = f.readline()
            if not line:
                raise AgentUnreachable(self.path, "the agent closed the connection before replying")
            try:
                reply = wire.decode_reply(line)
            except ProtocolError as exc:
                raise AgentUnreachable(
                    self.path, f"the agent sent a malformed reply ({exc.message})"
                ) from exc
            if not reply.ok:
                raise AgentError(reply.error_code or "", reply.error_message or "")
            yield reply
            if reply.final:
                return

    def _connect(self) -> socket.socket:
        # Before connecting: a socket another user could have put there gets no request
        # (it would see the command, and its answer would be printed as the agent's).
        problem = socket_problem(self.path)
        if problem is not None:
            raise UntrustedSocket(self.path, problem)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.path)
        except FileNotFoundError as exc:
            sock.close()
            raise AgentUnreachable(self.path, "no socket there") from exc
        except PermissionError as exc:
            sock.close()
            raise SocketPermissionDenied(self.path) from exc
        except ConnectionRefusedError as exc:
            sock.close()
            raise AgentUnreachable(self.path, "nothing listens on the socket") from exc
        except TimeoutError as exc:
            sock.close()
            raise AgentUnreachable(self.path, "the agent does not accept connections") from exc
        except OSError as exc:
            sock.close()
            raise AgentUnreachable(self.path, exc.strerror or str(exc)) from exc
        return sock
