"""I/O: the exporter's HTTP server: `/metrics`, `/sd` (Prometheus http_sd_configs) and `/`.

A `ThreadingHTTPServer` in one background thread. Every answer is formatted from
the state the agent already holds (`metrics.MetricsState`), so a request never
waits on a worker, NVML or the agent's event loop.

The default listen address, 127.0.0.1:9840, is set in `spec.MetricsSpec`; see
docs/metrics.md for why that port.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import structlog
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import CollectorRegistry

from sglang_farm.farm_view import FarmView, Phase
from sglang_farm.metrics import MetricsState, gpu_label

log = structlog.get_logger(__name__)


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


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a stuck client never blocks close()
    registry: CollectorRegistry
    state_getter: Callable[[], MetricsState]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cache: dict[object, tuple[MetricsState, bytes]] = {}
        self.cache_lock = threading.Lock()

    def body(self, encoder: Callable[[CollectorRegistry], bytes]) -> bytes:
        """The exposition of the current state, formatted once per state and encoder.

        The state is immutable and swapped whole, so a body formatted for it stays
        true until the next swap; scrapes between swaps cost a dictionary look-up.
        """
        state = self.state_getter()
        with self.cache_lock:
            hit = self.cache.get(encoder)
            if hit is not None and hit[0] is state:
                return hit[1]
        data = encoder(self.registry)
        with self.cache_lock:
            # Keep the state object itself: its id cannot be reused while cached.
            self.cache[encoder] = (state, data)
        return data


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "sglang-farm"
    timeout = 30  # seconds a silent client may hold a handler thread

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        try:
            if path == "/metrics":
                encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
                self._send(200, content_type, self.server.body(encoder))
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
    in a daemon thread until `close()`.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        state_getter: Callable[[], MetricsState],
        listen: str,
    ) -> None:
        host, port = parse_listen(listen)
        cls = _Server6 if ":" in host else _Server
        try:
            server = cls((host, port), _Handler)
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
            target=server.serve_forever,
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
            self._server.shutdown()
            self._thread.join(timeout=5)
        self._server.server_close()

    def __enter__(self) -> Exporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
