"""Local HTTP servers for the probe tests: one with a handler, and one whose body never
ends (what a client that reads on would hang on).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@contextmanager
def serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """A local threaded HTTP server with `handler`, for the test's duration; its base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@dataclass
class Sent:
    """What an `endless_body_server` saw: body bytes written, and answers whose client
    hung up (closed the connection) rather than reading on."""

    body_bytes: int = 0
    hung_up: int = 0

    def wait_hung_up(self, answers: int = 1, within_s: float = 10.0) -> bool:
        """Whether `answers` clients hung up within `within_s` (a bound that only catches
        a client that never stops reading)."""
        end = time.monotonic() + within_s
        while self.hung_up < answers and time.monotonic() < end:
            time.sleep(0.01)
        return self.hung_up >= answers


@contextmanager
def endless_body_server(
    *,
    status: int = 200,
    chunk: bytes = b"x" * 65536,
    interval_s: float = 0.01,
    not_found: tuple[str, ...] = (),
    sent: Sent | None = None,
) -> Iterator[str]:
    """An HTTP server whose every answer is `status` followed by a body that never ends
    (but 404 for the paths in `not_found`).

    Throttled (one `chunk` per `interval_s`) so that a client that reads it all grows
    by megabytes in the test's time, not gigabytes. Yields the base URL; counts into
    `sent`, when given, what it wrote and which clients hung up.
    """
    counter = sent if sent is not None else Sent()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            if self.path in not_found:
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(status)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            try:
                while True:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                    counter.body_bytes += len(chunk)
                    time.sleep(interval_s)
            except OSError:
                counter.hung_up += 1
                return  # the client hung up: what a bounded reader does

        def log_message(self, format: str, *args: object) -> None:  # `format`: stdlib's name
            return None

    with serving(Handler) as url:
        yield url
