"""I/O: the exporter's HTTP server: `/metrics`, `/sd` (Prometheus http_sd_configs) and `/`.

One background thread accepts connections and waits, with a selector, for each to send
its request; only then does a handler thread take it. So connections are bounded in what
they can hold: at most `MAX_PENDING` silent ones (the oldest is dropped for a newcomer,
and each is dropped after `idle_timeout`), at most `MAX_CONNECTIONS` handler threads (a
request past the cap is answered 503 at once), and a handler gives up on a client silent
for `idle_timeout`. The agent's fds (its unit's `LimitNOFILE=`) stay well clear of
these bounds, so no client can starve the health probes of descriptors.

Every answer is formatted from the state the agent already holds
(`metrics.MetricsState`), so a request never waits on a worker, NVML or the agent's
event loop.

The default listen address, 127.0.0.1:9840, is set in `spec.MetricsSpec`; see
docs/metrics.md for why that port.
"""

from __future__ import annotations

import errno
import json
import selectors
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any
from urllib.parse import urlsplit

import structlog
from prometheus_client.registry import CollectorRegistry

from sglang_farm import exposition
from sglang_farm.farm_view import FarmView, Phase
from sglang_farm.metrics import MetricsState, gpu_label

log = structlog.get_logger(__name__)

MAX_CONNECTIONS = 64  # requests served at once (a thread each); more are answered 503
MAX_PENDING = 64  # accepted connections waiting for their request (no thread, one fd each)
IDLE_TIMEOUT_S = 10.0  # a client silent this long is dropped (Prometheus sends at once)
MAX_CACHED_FORMATS = 4  # bodies kept for the current state (text and OpenMetrics in use)

_BUSY = (
    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
    b"Retry-After: 1\r\nContent-Length: 41\r\nConnection: close\r\n\r\n"
    b"too many connections; try again shortly\r\n"
)


def parse_listen(listen: str) -> tuple[str, int]:
    """("host", port) from "host:port", "[v6]:port" or ":port" (all interfaces).

    Raises ValueError with a message that names the accepted forms.
    """
    host, sep, port_s = listen.rpartition(":")
    if not sep or not port_s.isdigit() or not 0 <= int(port_s) <= 65535:
        raise ValueError(
            f"metrics listen address {listen!r}: expected HOST:PORT with a port in 0..65535, "
            "e.g. '127.0.0.1:9840', '[::1]:9840' or ':9840'"
        )
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host or "0.0.0.0", int(port_s)


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


class _Server(HTTPServer):
    """Binds and formats bodies; `serve` runs the bounded accept loop described above."""

    request_queue_size = 128  # a burst of connects waits in the backlog, not in SYN retries
    registry: CollectorRegistry
    state_getter: Callable[[], MetricsState]

    def __init__(
        self, *args: Any, max_connections: int, idle_timeout: float, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        # The current state's bodies, by content type (`body`).
        self.cache: tuple[MetricsState | None, dict[str, bytes]] = (None, {})
        self.cache_lock = threading.Lock()
        self.idle_timeout = idle_timeout
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
        """Accept, hold silent connections in a selector, hand talking ones to handlers."""
        self.socket.setblocking(False)
        pending: dict[socket.socket, tuple[Any, float]] = {}  # oldest first
        with selectors.DefaultSelector() as sel:
            sel.register(self.socket, selectors.EVENT_READ)
            try:
                while not self._stopping.is_set():
                    for key, _ in sel.select(poll_interval):
                        if key.fileobj is self.socket:
                            self._accept(sel, pending)
                        else:
                            conn = key.fileobj
                            assert isinstance(conn, socket.socket)
                            sel.unregister(conn)
                            self._dispatch(conn, pending.pop(conn)[0])
                    limit = time.monotonic() - self.idle_timeout
                    for conn, (_, since) in list(pending.items()):
                        if since < limit:
                            self._drop(sel, pending, conn)
            finally:
                for conn in list(pending):
                    self._drop(sel, pending, conn)

    def stop(self) -> None:
        self._stopping.set()

    def _accept(
        self, sel: selectors.BaseSelector, pending: dict[socket.socket, tuple[Any, float]]
    ) -> None:
        for _ in range(MAX_PENDING):  # drain a burst, but come back to the talking ones
            try:
                conn, addr = self.socket.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE) and pending:
                    # Out of fds: the oldest silent client gives its up.
                    self._drop(sel, pending, next(iter(pending)))
                    continue
                log.warning("metrics_accept_failed", error=str(exc))
                time.sleep(0.05)  # the listening socket stays readable: no busy loop
                return
            if len(pending) >= MAX_PENDING:
                self._drop(sel, pending, next(iter(pending)))
            conn.setblocking(False)
            sel.register(conn, selectors.EVENT_READ)
            pending[conn] = (addr, time.monotonic())

    @staticmethod
    def _drop(
        sel: selectors.BaseSelector,
        pending: dict[socket.socket, tuple[Any, float]],
        conn: socket.socket,
    ) -> None:
        sel.unregister(conn)
        del pending[conn]
        conn.close()

    def _dispatch(self, conn: socket.socket, addr: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self._shed(conn)
            return
        try:
            threading.Thread(
                target=self._handle, args=(conn, addr), name="sglang-farm-metrics-req", daemon=True
            ).start()
        except RuntimeError:  # no thread to be had: shed it like any request past the cap
            self._slots.release()
            self._shed(conn)

    def _shed(self, conn: socket.socket) -> None:
        """503 without a thread: read what the client sent (so closing sends no RST), answer."""
        try:
            conn.recv(65536)
            conn.send(_BUSY)
        except OSError:
            pass  # a client that went away needs no answer
        finally:
            conn.close()

    def _handle(self, conn: socket.socket, addr: Any) -> None:
        try:
            conn.setblocking(True)  # the handler sets its own timeout
            self.finish_request(conn, addr)
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
    server: _Server
    server_version = "sglang-farm"

    def setup(self) -> None:
        super().setup()
        # Seconds a stalled client may hold this handler (and its thread).
        self.connection.settimeout(self.server.idle_timeout)

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
    """Serves `registry` and `/sd` on `listen` ("host:port"; port 0 picks a free one).

    Binds in the constructor, so a taken port fails at once with OSError; serves
    in a daemon thread until `close()`. At most `max_connections` requests are served
    at once; a client silent for `idle_timeout` seconds is dropped.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        state_getter: Callable[[], MetricsState],
        listen: str,
        *,
        max_connections: int = MAX_CONNECTIONS,
        idle_timeout: float = IDLE_TIMEOUT_S,
    ) -> None:
        host, port = parse_listen(listen)
        cls = _Server6 if ":" in host else _Server
        try:
            server = cls(
                (host, port),
                _Handler,
                max_connections=max_connections,
                idle_timeout=idle_timeout,
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
