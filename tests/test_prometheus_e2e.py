"""A real Prometheus scrapes a real exporter (hand-built state) and discovers workers through /sd.

Every series the exporter serves must reach Prometheus's TSDB, family by family;
the worker found through http_sd must be scraped with the exporter's gpu/worker
labels; and Prometheus must load the shipped alert rules.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import threading
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from metrics_fixtures import gateway_state
from promproc import SGLANG_TEXT, _query, _start_prometheus, _wait_for
from sglang_farm.metrics.collectors import MetricsState, build_registry
from sglang_farm.metrics.exporter import Exporter
from sglang_farm.spec import Endpoint

pytestmark = pytest.mark.slow

ALERTS = Path(__file__).resolve().parent.parent / "etc" / "prometheus" / "alerts.yml"


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
