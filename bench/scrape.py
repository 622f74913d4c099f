"""I/O: `/metrics` latency of a running agent, one fresh connection per scrape (as Prometheus'
HTTP/1.0 exchange with this server is), timed from connect to the last body byte."""

from __future__ import annotations

import http.client
import time

from bench.stats import summary


def scrape_once(host: str, port: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        body = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"/metrics answered {resp.status}")
    finally:
        conn.close()
    return time.perf_counter() - t0, len(body)


def measure(host: str, port: int, reps: int, *, pause: float = 0.0) -> dict[str, object]:
    """Latency summary in ms over `reps` scrapes (after 10 warm-up scrapes), and the body size."""
    for _ in range(10):
        scrape_once(host, port)
    xs: list[float] = []
    size = 0
    for _ in range(reps):
        dt, size = scrape_once(host, port)
        xs.append(dt)
        if pause:
            time.sleep(pause)
    return {"latency_ms": summary(xs, scale=1000), "body_bytes": size}
