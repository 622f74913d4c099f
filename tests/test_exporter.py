"""The exporter's HTTP server on a real socket: /metrics, /sd, /, errors, listen parsing."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry

import asuser
from metrics_fixtures import farm, state
from sglang_farm.farm_view import Phase
from sglang_farm.host.fdbudget import exporter_pending_cap
from sglang_farm.metrics.collectors import MetricsState, build_registry
from sglang_farm.metrics.exporter import (
    MAX_CACHED_FORMATS,
    MAX_CONNECTIONS,
    Exporter,
    sd_targets,
)
from sglang_farm.metrics.exposition import PROMETHEUS_ACCEPT
from sglang_farm.spec import Endpoint

LOOPBACK_ANY_PORT = Endpoint("127.0.0.1", 0)  # port 0: the kernel picks a free one


@pytest.fixture
def exporter() -> Iterator[Exporter]:
    st = state()
    with Exporter(build_registry(lambda: st), lambda: st, LOOPBACK_ANY_PORT) as exp:
        yield exp


def test_metrics_are_served_in_the_prometheus_text_format(exporter: Exporter) -> None:
    r = httpx.get(f"{exporter.url}/metrics", timeout=5)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert 'sglang_farm_worker_state{gpu="0",state="ready",worker="0"} 1.0' in r.text


def test_openmetrics_is_served_when_asked_for(exporter: Exporter) -> None:
    r = httpx.get(
        f"{exporter.url}/metrics",
        headers={"Accept": "application/openmetrics-text; version=1.0.0"},
        timeout=5,
    )
    assert r.headers["content-type"].startswith("application/openmetrics-text")
    assert r.text.endswith("# EOF\n")


def test_sd_lists_ready_workers_own_metrics_targets(exporter: Exporter) -> None:
    r = httpx.get(f"{exporter.url}/sd", timeout=5)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert r.json() == [
        {"targets": ["127.0.0.1:30000"], "labels": {"gpu": "0", "worker": "0", "farm": "lab"}}
    ]


def test_sd_target_groups_follow_the_farm_view() -> None:
    view = farm()
    both = dataclasses.replace(view.workers[1], phase=Phase.READY)
    groups = sd_targets(dataclasses.replace(view, workers=(view.workers[0], both)))
    assert [g["labels"] for g in groups] == [
        {"gpu": "0", "worker": "0", "farm": "lab"},
        {"gpu": "1,2", "worker": "1", "farm": "lab"},
    ]
    assert sd_targets(None) == []


def test_index_and_unknown_paths(exporter: Exporter) -> None:
    index = httpx.get(f"{exporter.url}/", timeout=5)
    assert index.status_code == 200 and 'href="/metrics"' in index.text
    assert httpx.get(f"{exporter.url}/nope", timeout=5).status_code == 404


def test_a_failing_collector_answers_500_and_the_server_keeps_serving() -> None:
    good = state()
    current: list[MetricsState | None] = [None]

    def getter() -> MetricsState:
        st = current[0]
        if st is None:
            raise RuntimeError("bug in the agent")
        return st

    with Exporter(build_registry(getter), lambda: good, LOOPBACK_ANY_PORT) as exp:
        assert httpx.get(f"{exp.url}/metrics", timeout=5).status_code == 500
        current[0] = good
        assert httpx.get(f"{exp.url}/metrics", timeout=5).status_code == 200


def test_concurrent_scrapes_all_succeed(exporter: Exporter) -> None:
    with httpx.Client(timeout=5) as client, ThreadPoolExecutor(8) as pool:

        def scrape(_: int) -> int:
            return client.get(f"{exporter.url}/metrics").status_code

        assert set(pool.map(scrape, range(32))) == {200}


def test_a_taken_port_fails_at_once_naming_the_address() -> None:
    st = state()
    with Exporter(build_registry(lambda: st), lambda: st, LOOPBACK_ANY_PORT) as first:
        taken = f"127.0.0.1:{first.port}"
        with pytest.raises(OSError, match=rf"cannot listen on {taken} for metrics"):
            Exporter(build_registry(lambda: st), lambda: st, Endpoint("127.0.0.1", first.port))


def test_close_frees_the_port() -> None:
    st = state()
    exp = Exporter(build_registry(lambda: st), lambda: st, LOOPBACK_ANY_PORT)
    port = exp.port
    exp.close()
    exp.close()  # twice is fine
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def test_ipv6_loopback_listen() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    st = state()
    try:
        exp = Exporter(build_registry(lambda: st), lambda: st, Endpoint("::1", 0))
    except OSError as exc:
        pytest.skip(f"::1 not bindable here: {exc}")
    with exp:
        assert exp.url.startswith("http://[::1]:")
        assert httpx.get(f"{exp.url}/metrics", timeout=5).status_code == 200


@pytest.mark.parametrize("accept", ["", PROMETHEUS_ACCEPT], ids=["text", "prometheus"])
def test_the_body_is_formatted_once_per_state_and_follows_a_swap(accept: str) -> None:
    calls = 0
    current = state()

    def getter() -> MetricsState:
        nonlocal calls
        calls += 1
        return current

    headers = {"Accept": accept} if accept else {}
    with Exporter(build_registry(getter), getter, LOOPBACK_ANY_PORT) as exp:
        first = httpx.get(f"{exp.url}/metrics", headers=headers, timeout=5).text
        formatted = calls
        for _ in range(3):
            assert httpx.get(f"{exp.url}/metrics", headers=headers, timeout=5).text == first
        assert calls == formatted + 3  # the later scrapes only looked the state up
        current = dataclasses.replace(current, snapshot_at=current.snapshot_at + 100)
        third = httpx.get(f"{exp.url}/metrics", headers=headers, timeout=5).text
        assert third != first and "sglang_farm_snapshot_timestamp_seconds" in third


def test_many_scrapes_keep_one_cached_body_per_format() -> None:
    """A body is kept per format, not per scrape: 300 KB at 64 workers, every 15 s."""
    current = state()
    with Exporter(build_registry(lambda: current), lambda: current, LOOPBACK_ANY_PORT) as exp:
        for accept in [PROMETHEUS_ACCEPT] * 20 + [""] * 5:
            httpx.get(f"{exp.url}/metrics", headers={"Accept": accept}, timeout=5)
        assert len(exp._server.cache[1]) == 2


def test_a_client_naming_ever_new_formats_costs_no_memory() -> None:
    """The OpenMetrics version a client names is echoed into the content type: 50
    versions are 50 formats, and only a few bodies of the current state are kept."""
    current = state()
    with Exporter(build_registry(lambda: current), lambda: current, LOOPBACK_ANY_PORT) as exp:
        for i in range(1, 51):
            accept = f"application/openmetrics-text;version=1.{i}"
            r = httpx.get(f"{exp.url}/metrics", headers={"Accept": accept}, timeout=5)
            assert r.status_code == 200 and f"version=1.{i}" in r.headers["content-type"]
        assert len(exp._server.cache[1]) <= MAX_CACHED_FORMATS


def test_a_version_that_is_not_digits_and_dots_is_not_echoed_into_the_header() -> None:
    """The library echoes the asked-for version into Content-Type: a folded header's
    CR LF, or markup, would go back to the client."""
    current = state()
    with Exporter(build_registry(lambda: current), lambda: current, LOOPBACK_ANY_PORT) as exp:
        with socket.create_connection(("127.0.0.1", exp.port), timeout=5) as s:
            s.sendall(
                b"GET /metrics HTTP/1.0\r\n"
                b"Accept: application/openmetrics-text;version=2.a\r\n\tSet-Cookie: x=1\r\n\r\n"
            )
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = s.recv(65536)
                assert chunk, head
                head += chunk
        headers = head.split(b"\r\n\r\n", 1)[0].decode()
        assert "Set-Cookie" not in headers
        assert "Content-Type: text/plain; version=0.0.4; charset=utf-8" in headers


def test_an_accept_header_the_library_cannot_parse_gets_the_text_format() -> None:
    current = state()
    with Exporter(build_registry(lambda: current), lambda: current, LOOPBACK_ANY_PORT) as exp:
        accept = "application/openmetrics-text;version=1.0.0a"
        r = httpx.get(f"{exp.url}/metrics", headers={"Accept": accept}, timeout=5)
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
        assert "sglang_farm_worker_state{" in r.text


# --- connection limits ------------------------------------------------------------------

_EXPORTER_PROCESS = r"""
import resource, sys
sys.path.insert(0, sys.argv[1])
# As the agent's unit would have it, and under the 300 idle connections the test opens.
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
from metrics_fixtures import state
from sglang_farm.metrics.exporter import Exporter
from sglang_farm.metrics.collectors import build_registry
from sglang_farm.spec import Endpoint
st = state()
exp = Exporter(build_registry(lambda: st), lambda: st, Endpoint("127.0.0.1", 0))
print("PORT", exp.port, flush=True)
sys.stdin.read()  # serve until the test closes our stdin
exp.close()
"""


def _threads_and_fds(pid: int) -> tuple[int, int]:
    return len(os.listdir(f"/proc/{pid}/task")), len(os.listdir(f"/proc/{pid}/fd"))


def _open_idle(port: int, n: int) -> list[socket.socket]:
    """`n` connections that never send a byte, opened one after the other.

    A connect that the server's full backlog leaves hanging is given up after a moment
    (the socket is kept all the same: its SYN is retried by the kernel).
    """
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.settimeout(0.2)
        with contextlib.suppress(OSError):
            s.connect(("127.0.0.1", port))
        socks.append(s)
    return socks


def test_300_idle_connections_pin_no_threads_or_fds_and_a_scrape_still_succeeds() -> None:
    """1,100 idle connections once grew the agent to ~250 threads and its fd limit."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _EXPORTER_PROCESS, str(Path(__file__).parent)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    idle: list[socket.socket] = []
    try:
        line = ""
        while not line.startswith("PORT "):  # after the agent's own log lines
            line = proc.stdout.readline()
            assert line, "the exporter process exited"
        port = int(line.split()[1])
        threads0, fds0 = _threads_and_fds(proc.pid)
        idle = _open_idle(port, 300)
        peak_threads, peak_fds = threads0, fds0
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            threads, fds = _threads_and_fds(proc.pid)
            peak_threads, peak_fds = max(peak_threads, threads), max(peak_fds, fds)
            time.sleep(0.05)
        assert peak_threads <= threads0 + MAX_CONNECTIONS, (threads0, peak_threads)
        pending_cap = exporter_pending_cap(256)  # the process's limit, below
        assert peak_fds <= fds0 + pending_cap + MAX_CONNECTIONS, (fds0, peak_fds)
        # The idle ones stay open on the client side, yet a scrape gets through.
        r = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
        assert r.status_code == 200 and "sglang_farm_worker_state" in r.text
    finally:
        for s in idle:
            s.close()
        proc.stdin.close()
        proc.wait(timeout=10)
        proc.stdout.close()


def test_a_silent_or_unfinished_request_is_closed_at_the_request_deadline() -> None:
    st = state()
    with Exporter(
        build_registry(lambda: st), lambda: st, LOOPBACK_ANY_PORT, request_timeout=0.3
    ) as exp:
        with socket.create_connection(("127.0.0.1", exp.port), timeout=5) as silent:
            t0 = time.monotonic()
            assert silent.recv(1) == b""  # the server hung up
            assert time.monotonic() - t0 < 3
        with socket.create_connection(("127.0.0.1", exp.port), timeout=5) as slow:
            slow.sendall(b"GET /metrics HTTP/1.1\r\n")  # and never the rest
            t0 = time.monotonic()
            assert slow.recv(65536) == b""  # no answer: dropped at its deadline
            assert time.monotonic() - t0 < 3


class _Gate:
    """A collector that blocks each scrape until the test opens the gate: busy handlers."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.waiting = threading.Semaphore(0)

    def collect(self) -> Iterator[Metric]:
        self.waiting.release()
        self.open.wait(10)
        yield GaugeMetricFamily("gate_open", "whether the test opened the gate", value=1)


def test_requests_over_the_cap_are_shed_at_once_and_their_slots_come_back() -> None:
    st = state()
    gate = _Gate()
    registry = CollectorRegistry()
    registry.register(gate)
    with Exporter(registry, lambda: st, LOOPBACK_ANY_PORT, max_connections=2) as exp:
        with ThreadPoolExecutor(2) as pool:
            # Two requests whose answers are being formatted: each holds a handler.
            held = [pool.submit(httpx.get, f"{exp.url}/metrics", timeout=10) for _ in range(2)]
            for _ in range(2):
                assert gate.waiting.acquire(timeout=5)
            r = httpx.get(f"{exp.url}/", timeout=5)
            assert r.status_code == 503 and r.headers["Retry-After"] == "1"
            gate.open.set()
            assert [f.result().status_code for f in held] == [200, 200]
        assert httpx.get(f"{exp.url}/", timeout=5).status_code == 200


# --- slow clients (issue 22, item 6) ----------------------------------------------------

_DRIBBLER = r"""
import socket, sys, time
port, n, every = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])

def opened():
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(b"GET /metrics HTTP/1.1\r\n")
    return s

socks = [opened() for _ in range(n)]
print("DRIBBLING", flush=True)
line = 0
while True:  # one header line per connection every `every` s; a dropped one comes back
    time.sleep(every)
    line += 1
    for i, s in enumerate(socks):
        try:
            s.sendall(b"X-Slow-%d: 1\r\n" % line)
        except OSError:
            s.close()
            try:
                socks[i] = opened()
            except OSError:
                pass
"""


def test_70_dribbling_clients_of_another_user_leave_every_scrape_answered() -> None:
    """Issue 22 item 6: 70 connections from nobody, each sending one header line every few
    seconds, held every handler (the timeout was per read), so scrapes answered 503.

    The whole request now has a deadline from accept, and a connection still sending its
    headers holds no handler."""
    asuser.require()
    st = state()
    with Exporter(
        build_registry(lambda: st), lambda: st, LOOPBACK_ANY_PORT, request_timeout=1.0
    ) as exp:
        slow = asuser.popen_as_nobody(
            [sys.executable, "-I", "-c", _DRIBBLER, str(exp.port), "70", "0.2"]
        )
        try:
            assert slow.stdout is not None
            assert slow.stdout.readline() == "DRIBBLING\n", slow.communicate(timeout=5)
            statuses = []
            with httpx.Client(timeout=5) as client:
                for _ in range(20):  # across several of the dribblers' deadlines
                    statuses.append(client.get(f"{exp.url}/metrics").status_code)
                    time.sleep(0.15)
            assert statuses == [200] * 20
            assert slow.poll() is None, "the dribbler stopped early"
        finally:
            slow.kill()
            slow.communicate(timeout=10)
