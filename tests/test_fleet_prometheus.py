"""The fleet's Prometheus config (etc/prometheus/fleet.yml): promtool accepts it, and a real
Prometheus run on it scrapes two hosts' agents (file_sd) and their workers (each farm's /sd)
with a `host` label on every series, which the dashboard's host variable selects.

The two "hosts" are two loopback addresses, 127.0.0.1 and 127.0.0.2, each with an exporter
(hand-built state) and one worker endpoint listening on that address only.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from metrics_fixtures import gateway_state
from promproc import SGLANG_TEXT, _query, _start_prometheus, _wait_for
from sglang_farm.metrics.collectors import MetricsState, build_registry
from sglang_farm.metrics.exporter import Exporter
from sglang_farm.spec import Endpoint

PROM = Path(__file__).resolve().parent.parent / "etc" / "prometheus"
FLEET = PROM / "fleet.yml"
TARGETS = PROM / "sglang-farm-targets.json"
TEMPLATE = PROM.parent.parent / "deploy" / "ansible" / "templates" / "sglang-farm-targets.json.j2"
DASHBOARD = PROM.parent / "grafana" / "sglang-farm.json"
HOSTS = ("127.0.0.1", "127.0.0.2")


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not installed (Debian package 'prometheus'); CI installs it")
    return path


def test_promtool_accepts_the_fleet_config_its_targets_file_and_rules() -> None:
    r = subprocess.run(
        [_promtool(), "check", "config", str(FLEET)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    # promtool follows the config's paths: the rules file and the file_sd targets file.
    assert "alerts.yml" in r.stdout and "SUCCESS" in r.stdout


def test_every_target_of_the_example_and_the_template_has_a_host_label() -> None:
    groups = json.loads(TARGETS.read_text())
    assert len(groups) >= 2
    for g in groups:
        assert g["labels"]["host"] == g["targets"][0].rsplit(":", 1)[0], g


def test_the_ansible_template_writes_the_example_targets_file() -> None:
    import jinja2  # the test extra has it (ansible-core renders the same templates)

    # As Ansible's template module renders: trim_blocks on, an undefined variable an error.
    env = jinja2.Environment(trim_blocks=True, undefined=jinja2.StrictUndefined)
    template = env.from_string(TEMPLATE.read_text())
    inventory = ["gpu-host-1", "gpu-host-2"]
    out = template.render(
        groups={"sglang_farm": inventory}, hostvars={h: {"rack": "r01"} for h in inventory}
    )
    assert json.loads(out) == json.loads(TARGETS.read_text())
    # No rack, another metrics port: no rack label, that port.
    out = template.render(
        groups={"sglang_farm": ["h"]}, hostvars={"h": {"sglang_farm_metrics_port": 9999}}
    )
    assert json.loads(out) == [{"targets": ["h:9999"], "labels": {"host": "h"}}]


@contextmanager
def _worker_on(address: str) -> Iterator[int]:
    """A worker's /metrics endpoint listening on `address` only; yields its port."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(SGLANG_TEXT)))
            self.end_headers()
            self.wfile.write(SGLANG_TEXT)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer((address, 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


def _host_state(port: int) -> MetricsState:
    """The fixture farm, its worker 0 on `port`, named as the agent reaches it (loopback)."""
    base = gateway_state()
    view = base.farm
    assert view is not None
    w0 = dataclasses.replace(view.workers[0], base_url=f"http://127.0.0.1:{port}")
    return dataclasses.replace(
        base, farm=dataclasses.replace(view, workers=(w0, *view.workers[1:]))
    )


def _panel(title: str) -> str:
    """The one query of the dashboard's panel titled `title`."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    (panel,) = (p for p in panels if p["title"] == title)
    (target,) = panel["targets"]
    return str(target["expr"])


def _getter(st: MetricsState) -> Callable[[], MetricsState]:
    return lambda: st


def _fleet_config(tmp: Path, agents: dict[str, int]) -> str:
    """fleet.yml as shipped, pointed at this test's hosts (its own text, a few values swapped)."""
    text = FLEET.read_text()
    swaps = {
        "scrape_interval: 15s": "scrape_interval: 1s",
        "evaluation_interval: 15s": "evaluation_interval: 1s",
        "refresh_interval: 30s": "refresh_interval: 1s",
        "refresh_interval: 1m": "refresh_interval: 1s",
        "  - alerts.yml\n": f"  - {PROM / 'alerts.yml'}\n",
        "- sglang-farm-targets.json\n": f"- {tmp / 'targets.json'}\n",
        "http://gpu-host-1:9840/sd": f"http://{HOSTS[0]}:{agents[HOSTS[0]]}/sd",
        "http://gpu-host-2:9840/sd": f"http://{HOSTS[1]}:{agents[HOSTS[1]]}/sd",
    }
    for old, new in swaps.items():
        assert old in text, f"fleet.yml no longer holds {old!r}: update this test"
        text = text.replace(old, new)
    # The targets file as the Ansible template writes it; the second host's label left
    # out: fleet.yml takes it from the address.
    (tmp / "targets.json").write_text(
        json.dumps(
            [
                {"targets": [f"{HOSTS[0]}:{agents[HOSTS[0]]}"], "labels": {"host": HOSTS[0]}},
                {"targets": [f"{HOSTS[1]}:{agents[HOSTS[1]]}"]},
            ]
        )
    )
    return text


@pytest.mark.slow
def test_prometheus_on_the_fleet_config_labels_every_series_with_its_host(tmp_path: Path) -> None:
    with ExitStack() as stack:
        agents: dict[str, int] = {}
        worker_ports: dict[str, int] = {}
        for host in HOSTS:
            port = stack.enter_context(_worker_on(host))
            st = _getter(_host_state(port))
            exp = stack.enter_context(Exporter(build_registry(st), st, Endpoint(host, 0)))
            agents[host], worker_ports[host] = exp.port, port
        proc, url = _start_prometheus(tmp_path, _fleet_config(tmp_path, agents))
        try:
            with httpx.Client(base_url=url, timeout=5) as client:

                def agents_by_host() -> tuple[bool, Any]:
                    rows = _query(
                        client, 'count by (host) (sglang_farm_build_info{job="sglang-farm"})'
                    )
                    got = sorted(r["metric"].get("host", "") for r in rows)
                    return got == sorted(HOSTS), rows

                _wait_for("both hosts' agents, each with its host label", agents_by_host)

                # Each worker is scraped at its own host's address (/sd said 127.0.0.1 for
                # both; 127.0.0.2's worker listens on 127.0.0.2 only), labelled with it.
                def workers_by_host() -> tuple[bool, Any]:
                    rows = _query(client, 'up{job="sglang"}')
                    got = sorted(
                        (r["metric"].get("host"), r["metric"]["instance"], r["value"][1])
                        for r in rows
                    )
                    want = sorted((h, f"{h}:{worker_ports[h]}", "1") for h in HOSTS)
                    return got == want, rows

                _wait_for("each host's worker discovered through /sd and scraped", workers_by_host)

                # SGLang's series and the agent's join on (host, worker): per host, no clash.
                joined = _query(
                    client,
                    'sglang:num_running_reqs{job="sglang"} * on (host, worker) group_left '
                    "sglang_farm_worker_running_requests * 0 + 1",
                )
                assert sorted(r["metric"]["host"] for r in joined) == sorted(HOSTS), joined

                # The fleet rules group evaluates per host.
                def recorded() -> tuple[bool, Any]:
                    rows = _query(client, "host:farm_workers_configured:count")
                    got = {r["metric"]["host"]: r["value"][1] for r in rows}
                    return sorted(got) == sorted(HOSTS), rows

                _wait_for("the fleet recording rules, one series per host", recorded)
                # The dashboard's per-host panel, as Grafana sends it: one host picked, then All.
                panel = _panel("Workers ready by host")
                for picked, want in ((HOSTS[1], [HOSTS[1]]), (".*", sorted(HOSTS))):
                    expr = panel.replace("$host", picked)
                    rows = _query(client, expr)
                    assert sorted(r["metric"]["host"] for r in rows) == want, (expr, rows)
                groups = client.get("/api/v1/rules").json()["data"]["groups"]
                fleet = [g for g in groups if g["name"] == "sglang-farm-fleet"]
                names = {r["name"] for g in fleet for r in g["rules"]}
                assert {"SglangFarmHostNoReadyWorker", "SglangFarmFleetBelowCapacity"} <= names
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_fleet_yml_names_no_metric_the_exporter_lacks() -> None:
    assert not re.findall(r"\bsglang_farm_[a-z0-9_]+", FLEET.read_text())
