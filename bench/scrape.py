"""I/O: `/metrics` latency of a running agent, one fresh connection per scrape (as Prometheus'
HTTP/1.0 exchange with this server is), timed from connect to the last body byte."""

from __future__ import annotations

import http.client
import time

from bench.stats import summary


def scrape_once(host: str, port: int, accept: str = "") -> tuple[float, int]:
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        conn.request("GET", "/metrics", headers={"Accept": accept} if accept else {})
        resp = conn.getresponse()
        body = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"/metrics answered {resp.status}")
    finally:
        conn.close()
    return time.perf_counter() - t0, len(body)


def measure(
    host: str, port: int, reps: int, *, pause: float = 0.0, max_s: float = 1e9, accept: str = ""
) -> dict[str, object]:
    """Latency summary in ms over `reps` scrapes (after 3 warm-up scrapes), and the body size.

    Stops early after `max_s` seconds (a hung worker must still be hung at the end).
    `accept`: the Accept header sent ("": none, the text format).
    """
    for _ in range(3):
        scrape_once(host, port, accept)
    xs: list[float] = []
    size = 0
    end = time.monotonic() + max_s
    for _ in range(reps):
        if time.monotonic() > end:
            break
        dt, size = scrape_once(host, port, accept)
        xs.append(dt)
        if pause:
            time.sleep(pause)
    return {"latency_ms": summary(xs, scale=1000), "body_bytes": size}


def health_lines(host: str, port: int) -> dict[str, object]:
    """From one scrape: how many workers answered their last stats poll, and the probe verdicts."""
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    up = down = stale = 0
    probes: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("sglang_farm_worker_up{"):
            up += line.endswith(" 1.0")
            down += line.endswith(" 0.0")
        elif line.startswith("sglang_farm_worker_stats_stale{") and line.endswith(" 1.0"):
            stale += 1
        elif line.startswith("sglang_farm_probe_success{") or line.startswith(
            "sglang_farm_probe_duration_seconds{"
        ):
            name, _, value = line.rpartition(" ")
            probes[name] = value
    return {"workers_up": up, "workers_down": down, "workers_stale": stale, "probes": probes}
