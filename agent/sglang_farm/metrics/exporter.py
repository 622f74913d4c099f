"""I/O: the exporter's HTTP server: `/metrics`, `/sd` (Prometheus http_sd_configs) and `/`.

One background thread accepts connections and reads, with a selector, each one's request
up to its blank line; only a complete request is handed to a handler thread. So what a
client can hold is bounded whatever it sends:

- a connection still sending its request holds no thread, one fd and at most
  `MAX_REQUEST_BYTES`; it must finish within `request_timeout` of its accept (a deadline
  for the whole request, not per read: a client sending one header line every few seconds
  is dropped at the deadline all the same, issue 22 item 6);
- at most `max_pending` such connections (by default `fdbudget.exporter_pending_cap` of the
  agent's descriptor limit, far above 64): past it the oldest is dropped for the newcomer,
  and a well-behaved client (Prometheus sends its request at once) is never the oldest;
- at most `max_connections` handler threads, each bounded by `write_timeout` for the whole
  answer; a complete request past the cap is answered 503 at once.

Every answer is formatted from the state the agent already holds
(`metrics.MetricsState`), so a request never waits on a worker, NVML or the agent's
event loop.

The default listen address, 127.0.0.1:9840, is set in `spec.MetricsSpec`; see
docs/metrics.md for why that port.
"""

from __future__ import annotations

import errno
import io
import json
import resource
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any
from urllib.parse import urlsplit

import structlog
from prometheus_client.registry import CollectorRegistry

from sglang_farm.farm_view import FarmView, Phase
from sglang_farm.host import fdbudget
from sglang_farm.metrics import exposition
from sglang_farm.metrics.collectors import MetricsState, gpu_label
from sglang_farm.spec import Endpoint

log = structlog.get_logger(__name__)

MAX_CONNECTIONS = 64  # requests served at once (a thread each); more are answered 503
# From accept to the request's blank line. Prometheus sends its request at once; a
# person's curl too. A client slower than this is dropped, however it dribbles.
REQUEST_TIMEOUT_S = 5.0
# The whole answer's send (a /metrics body is tens of KiB; loopback takes it at once).
WRITE_TIMEOUT_S = 10.0
# A request's line and headers: Prometheus sends under 1 KiB; more is not a scrape.
MAX_REQUEST_BYTES = 8192
MAX_CACHED_FORMATS = 4  # bodies kept for the current state (text and OpenMetrics in use)

_BUSY = (
    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
    b"Retry-After: 1\r\nContent-Length: 41\r\nConnection: close\r\n\r\n"
    b"too many connections; try again shortly\r\n"
)


def sd_targets(farm: FarmView | None) -> list[dict[str, object]]:
    """Prometheus HTTP SD groups: one per READY worker, its own `/metrics` target.

    Labels `gpu` and `worker` match the exporter's, so SGLang's `sglang:` series
    (whose labels are identical across workers of one model) join with ours.
    """
    if farm is None:
        return []
    groups: list[dict[str, object]] = []
    for w in farm.workers:
        if w.phase is not Phase.READY:
            continue
        netloc = urlsplit(w.base_url).netloc or w.base_url
        groups.append(
            {
                "targets": [netloc],
                "labels": {"gpu": gpu_label(w.gpus), "worker": str(w.id), "farm": farm.name},
            }
        )
    return groups


_INDEX = """<!doctype html>
<html><head><title>sglang-farm exporter</title></head><body>
<h1>sglang-farm exporter</h1>
<ul>
<li><a href="/metrics">/metrics</a>: the farm's metrics (Prometheus text)</li>
<li><a href="/sd">/sd</a>: ready workers' own /metrics targets (Prometheus http_sd_configs)</li>
</ul>
</body></html>
"""


@dataclass(slots=True)
class _Pending:
    """A connection still sending its request: who, its deadline, what it sent so far."""

    addr: Any
    deadline: float
    data: bytearray = field(default_factory=bytearray)


def _request_end(data: bytearray, since: int) -> bool:
    """Whether the request's blank line has arrived (looked for from `since`, minus 3)."""
    start = max(0, since - 3)
    return data.find(b"\r\n\r\n", start) >= 0 or data.find(b"\n\n", start) >= 0


class _Server(HTTPServer):
    """Binds and formats bodies; `serve` runs the bounded accept loop described above."""

    request_queue_size = 128  # a burst of connects waits in the backlog, not in SYN retries
    registry: CollectorRegistry
    state_getter: Callable[[], MetricsState]

    def __init__(
        self,
        *args: Any,
        max_connections: int,
        max_pending: int,
        request_timeout: float,
        write_timeout: float,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        # The current state's bodies, by content type (`body`).
        self.cache: tuple[MetricsState | None, dict[str, bytes]] = (None, {})
        self.cache_lock = threading.Lock()
        self.max_pending = max_pending
        self.request_timeout = request_timeout
        self.write_timeout = write_timeout
        self._slots = threading.BoundedSemaphore(max_connections)
        self._stopping = threading.Event()

    def body(self, fmt: exposition.Format) -> bytes:
        """The exposition of the current state, formatted once per state and format.

        The state is immutable and swapped whole, so a body formatted for it stays
        true until the next swap; scrapes between swaps cost a dictionary look-up.
        Only the current state's bodies are kept, at most `MAX_CACHED_FORMATS` of them:
        a client naming ever new formats (an OpenMetrics version is echoed into the
        content type) costs a format each time, never memory.
        """
        state = self.state_getter()
        with self.cache_lock:
            cached_for, bodies = self.cache
            if cached_for is state and fmt.content_type in bodies:
                return bodies[fmt.content_type]
        data = fmt.encode(self.registry)
        with self.cache_lock:
            if self.state_getter() is not state:
                return data  # swapped meanwhile: a body for a past state is not kept
            cached_for, bodies = self.cache
            if cached_for is not state:
                # Keeps the state object itself: its id cannot be reused while cached.
                self.cache = (state, {})
            elif len(bodies) >= MAX_CACHED_FORMATS:
                del bodies[next(iter(bodies))]  # the oldest: Prometheus' stays in use
            self.cache[1][fmt.content_type] = data
        return data

    # ---- the accept loop (the serving thread) ----------------------------------------

    def serve(self, poll_interval: float) -> None:
        """Accept, read requests in a selector, hand complete ones to handlers.

        `pending` is in accept order, so deadlines (accept + `request_timeout`) are in
        order too: the expired ones are at its front.
        """
        self.socket.setblocking(False)
        pending: dict[socket.socket, _Pending] = {}
        with selectors.DefaultSelector() as sel:
            sel.register(self.socket, selectors.EVENT_READ)
            try:
                while not self._stopping.is_set():
                    wait = poll_interval
                    if pending:
                        first = next(iter(pending.values()))
                        wait = max(0.0, min(wait, first.deadline - time.monotonic()))
                    for key, _ in sel.select(wait):
                        if key.fileobj is self.socket:
                            self._accept(sel, pending)
                        else:
                            conn = key.fileobj
                            assert isinstance(conn, socket.socket)
                            if conn in pending:  # not dropped by an accept this round
                                self._read(sel, pending, conn)
                    now = time.monotonic()
                    for conn, p in list(pending.items()):
                        if p.deadline > now:
                            break
                        self._drop(sel, pending, conn)
            finally:
                for conn in list(pending):
                    self._drop(sel, pending, conn)

    def stop(self) -> None:
        self._stopping.set()

    def _accept(self, sel: selectors.BaseSelector, pending: dict[socket.socket, _Pending]) -> None:
        for _ in range(64):  # drain a burst, but come back to the talking ones
            try:
                conn, addr = self.socket.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE) and pending:
                    # Out of fds: the oldest unfinished request gives its up.
                    self._drop(sel, pending, next(iter(pending)))
                    continue
                log.warning("metrics_accept_failed", error=str(exc))
                time.sleep(0.05)  # the listening socket stays readable: no busy loop
                return
            if len(pending) >= self.max_pending:
                self._drop(sel, pending, next(iter(pending)))
            conn.setblocking(False)
            sel.register(conn, selectors.EVENT_READ)
            pending[conn] = _Pending(addr, time.monotonic() + self.request_timeout)

    def _read(
        self,
        sel: selectors.BaseSelector,
        pending: dict[socket.socket, _Pending],
        conn: socket.socket,
    ) -> None:
        """Take what the client sent; a complete request goes to a handler."""
        p = pending[conn]
        try:
            chunk = conn.recv(MAX_REQUEST_BYTES + 1 - len(p.data))
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:  # the client hung up (or reset) before its request was complete
            self._drop(sel, pending, conn)
            return
        since = len(p.data)
        p.data += chunk
        if _request_end(p.data, since):
            sel.unregister(conn)
            del pending[conn]
            self._dispatch(conn, p.addr, bytes(p.data))
        elif len(p.data) > MAX_REQUEST_BYTES:
            self._drop(sel, pending, conn)  # not a scrape: no answer owed

    @staticmethod
    def _drop(
        sel: selectors.BaseSelector,
        pending: dict[socket.socket, _Pending],
        conn: socket.socket,
    ) -> None:
        sel.unregister(conn)
        del pending[conn]
        conn.close()

    def _dispatch(self, conn: socket.socket, addr: Any, request: bytes) -> None:
        if not self._slots.acquire(blocking=False):
            self._shed(conn)
            return
        try:
            threading.Thread(
                target=self._handle,
                args=(conn, addr, request),
                name="sglang-farm-metrics-req",
                daemon=True,
            ).start()
        except RuntimeError:  # no thread to be had: shed it like any request past the cap
            self._slots.release()
            self._shed(conn)

    @staticmethod
    def _shed(conn: socket.socket) -> None:
        """503 without a thread (its request was read, so closing sends no RST)."""
        try:
            conn.send(_BUSY)  # small: fits the empty send buffer of a new connection
        except OSError:
            pass  # a client that went away needs no answer
        finally:
            conn.close()

    def _handle(self, conn: socket.socket, addr: Any, request: bytes) -> None:
        try:
            # Blocking, bounded: since 3.5 a timeout bounds a whole sendall(), not one send.
            conn.settimeout(self.write_timeout)
            _Handler(conn, addr, self, request)
        except OSError:
            pass  # the client hung up or stalled: nothing to answer
        except Exception:  # task root of one connection: log it, keep serving
            log.exception("metrics_connection_failed")
        finally:
            self.shutdown_request(conn)
            self._slots.release()


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    """One request, already read whole by the accept loop (`request`); answers it."""

    server: _Server
    server_version = "sglang-farm"

    def __init__(self, conn: socket.socket, addr: Any, server: _Server, request: bytes) -> None:
        self._request_bytes = request
        super().__init__(conn, addr, server)  # runs setup, handle, finish

    def setup(self) -> None:
        super().setup()
        # The request was read by the accept loop: parse it from memory, never the socket.
        self.rfile = io.BytesIO(self._request_bytes)

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        try:
            if path == "/metrics":
                fmt = exposition.choose(self.headers.get("Accept", ""))
                self._send(200, fmt.content_type, self.server.body(fmt))
            elif path == "/sd":
                body = json.dumps(sd_targets(self.server.state_getter().farm)).encode()
                self._send(200, "application/json", body)
            elif path in ("/", "/index.html"):
                self._send(200, "text/html; charset=utf-8", _INDEX.encode())
            else:
                self._send(404, "text/plain; charset=utf-8", b"not found; try /metrics or /sd\n")
        except Exception:  # task root of one request: log it, answer 500, keep serving
            log.exception("metrics_request_failed", path=path)
            self._send(500, "text/plain; charset=utf-8", b"internal error; see the agent's log\n")

    def _send(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # `format`: the stdlib name
        return None  # one line per scrape on stderr is noise; errors are logged above


class Exporter:
    """Serves `registry` and `/sd` on `listen` (port 0 picks a free one).

    Binds in the constructor, so a taken port fails at once with OSError; serves
    in a daemon thread until `close()`. At most `max_connections` requests are served
    at once; a client whose request is not complete `request_timeout` seconds after its
    connection was accepted is dropped; at most `max_pending` such connections are held
    (None: `fdbudget.exporter_pending_cap` of the process's soft descriptor limit now).
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        state_getter: Callable[[], MetricsState],
        listen: Endpoint,
        *,
        max_connections: int = MAX_CONNECTIONS,
        max_pending: int | None = None,
        request_timeout: float = REQUEST_TIMEOUT_S,
        write_timeout: float = WRITE_TIMEOUT_S,
    ) -> None:
        host, port = listen.host, listen.port
        cls = _Server6 if ":" in host else _Server
        if max_pending is None:
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            max_pending = fdbudget.exporter_pending_cap(
                fdbudget.usable(soft, resource.RLIM_INFINITY)
            )
        try:
            server = cls(
                (host, port),
                _Handler,
                max_connections=max_connections,
                max_pending=max_pending,
                request_timeout=request_timeout,
                write_timeout=write_timeout,
            )
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"cannot listen on {listen} for metrics: {exc.strerror}; "
                "set [metrics] listen to a free address (or stop what holds the port)",
            ) from exc
        server.registry = registry
        server.state_getter = state_getter
        self._server = server
        self._thread = threading.Thread(
            # poll_interval bounds how long close() waits for the serving loop to notice.
            target=server.serve,
            args=(0.1,),
            name="sglang-farm-metrics",
            daemon=True,
        )
        self._thread.start()
        log.info("metrics_listening", address=f"{self.host}:{self.port}")

    @property
    def host(self) -> str:
        return str(self._server.server_address[0])

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def close(self) -> None:
        """Stop serving and free the port. Safe to call twice."""
        if self._thread.is_alive():
            self._server.stop()
            self._thread.join(timeout=5)
        self._server.server_close()

    def __enter__(self) -> Exporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
