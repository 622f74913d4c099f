"""A real Prometheus scrapes a real exporter (hand-built state) and discovers workers through /sd.

Every series the exporter serves must reach Prometheus's TSDB, family by family;
the worker found through http_sd must be scraped with the exporter's gpu/worker
labels; and Prometheus must load the shipped alert rules.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from metrics_fixtures import gateway_state
from sglang_farm.metrics.collectors import MetricsState, build_registry
from sglang_farm.metrics.exporter import Exporter
from sglang_farm.spec import Endpoint

pytestmark = pytest.mark.slow

ALERTS = Path(__file__).resolve().parent.parent / "etc" / "prometheus" / "alerts.yml"
SGLANG_TEXT = (
    b"# HELP sglang:num_running_reqs The number of running requests.\n"
    b"# TYPE sglang:num_running_reqs gauge\n"
    b'sglang:num_running_reqs{engine_type="unified",model_name="qwen3-8b",'
    b'moe_ep_rank="0",pp_rank="0",tp_rank="0"} 3.0\n'
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def sglang_worker() -> Iterator[str]:
    """A worker's own /metrics endpoint (what http_sd points Prometheus at)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(SGLANG_TEXT)))
            self.end_headers()
            self.wfile.write(SGLANG_TEXT)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _start_prometheus(tmp: Path, config: str) -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("prometheus") or "/usr/bin/prometheus"
    if not Path(binary).exists():
        pytest.skip("prometheus not installed (Debian package 'prometheus'); CI installs it")
    (tmp / "prometheus.yml").write_text(config)
    # Prometheus cannot listen on port 0 and report it back: pick a free port, retry if raced.
    for _ in range(3):
        port = _free_port()
        with (tmp / "prometheus.log").open("ab") as log:  # the child keeps its own copy of the fd
            proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={tmp / 'prometheus.yml'}",
                    f"--storage.tsdb.path={tmp / 'data'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                    "--log.level=warn",
                ],
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                    return proc, url
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        proc.kill()
        proc.wait()
    pytest.fail(f"prometheus did not start; its log:\n{(tmp / 'prometheus.log').read_text()}")


def _wait_for(what: str, probe: Callable[[], tuple[bool, Any]], timeout: float = 45.0) -> Any:
    """Poll `probe` until it says done; fail with its last observation."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        done, last = probe()
        if done:
            return last
        time.sleep(0.5)
    pytest.fail(f"timed out waiting for {what}; last observation:\n{last}")


def _query(client: httpx.Client, q: str) -> list[dict[str, Any]]:
    r = client.get("/api/v1/query", params={"query": q})
    r.raise_for_status()
    result: list[dict[str, Any]] = r.json()["data"]["result"]
    return result


def test_prometheus_scrapes_every_family_and_discovers_ready_workers(
    tmp_path: Path, sglang_worker: str
) -> None:
    base = gateway_state()
    view = base.farm
    assert view is not None
    worker0 = dataclasses.replace(view.workers[0], base_url=sglang_worker)
    st: MetricsState = dataclasses.replace(
        base, farm=dataclasses.replace(view, workers=(worker0, *view.workers[1:]))
    )
    # What Prometheus must end up holding: series per sample name, from our own exposition.
    expected: Counter[str] = Counter()
    for fam in text_string_to_metric_families(generate_latest(build_registry(lambda: st)).decode()):
        expected.update(s.name for s in fam.samples)

    with Exporter(build_registry(lambda: st), lambda: st, Endpoint("127.0.0.1", 0)) as exp:
        target = f"127.0.0.1:{exp.port}"
        config = json.dumps(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": [str(ALERTS)],
                "scrape_configs": [
                    {"job_name": "sglang-farm", "static_configs": [{"targets": [target]}]},
                    {
                        "job_name": "sglang",
                        "http_sd_configs": [
                            {"url": f"http://{target}/sd", "refresh_interval": "1s"}
                        ],
                    },
                ],
            }
        )
        proc, url = _start_prometheus(tmp_path, config)
        try:
            with httpx.Client(base_url=url, timeout=5) as client:

                def families() -> tuple[bool, Any]:
                    rows = _query(
                        client,
                        'count by (__name__) ({job="sglang-farm", __name__=~"sglang_farm_.+"})',
                    )
                    got = {r["metric"]["__name__"]: int(r["value"][1]) for r in rows}
                    return got == dict(expected), {
                        "missing or wrong": {
                            k: (v, got.get(k)) for k, v in expected.items() if got.get(k) != v
                        },
                        "unexpected": sorted(set(got) - set(expected)),
                    }

                _wait_for("every exported series in Prometheus", families)

                def discovered() -> tuple[bool, Any]:
                    rows = _query(client, 'up{job="sglang"}')
                    labels = [
                        {k: r["metric"].get(k) for k in ("gpu", "worker", "farm")} for r in rows
                    ]
                    ok = labels == [{"gpu": "0", "worker": "0", "farm": "lab"}] and all(
                        r["value"][1] == "1" for r in rows
                    )
                    return ok, rows

                _wait_for("the READY worker discovered through /sd and scraped", discovered)

                # SGLang's own series carry the farm's labels, so they join with ours.
                joined = _query(
                    client,
                    'sglang:num_running_reqs{job="sglang"} '
                    "* on (worker) group_left sglang_farm_worker_running_requests * 0 + 1",
                )
                assert [r["metric"]["worker"] for r in joined] == ["0"], joined

                groups = client.get("/api/v1/rules").json()["data"]["groups"]
                names = {r["name"] for g in groups for r in g["rules"]}
                assert "SglangFarmWorkerDown" in names and "SglangFarmAgentStuck" in names
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
