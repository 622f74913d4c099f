"""Shipped alert rules and dashboard: promtool runs the rule tests and parses every expression,
and every metric they name is one the exporter really exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from metrics_fixtures import canary_state
from sglang_farm.gpus.xid import CATALOG_URL
from sglang_farm.metrics.collectors import build_registry

ROOT = Path(__file__).resolve().parent.parent
ALERTS = ROOT / "etc" / "prometheus" / "alerts.yml"
ALERTS_TEST = ROOT / "etc" / "prometheus" / "alerts_test.yml"
DASHBOARD = ROOT / "etc" / "grafana" / "sglang-farm.json"

# Grafana's template variables, replaced by what they expand to so promtool can parse.
GRAFANA_VARS = {"$__rate_interval": "5m", "$host": ".*"}


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not installed (Debian package 'prometheus'); CI installs it")
    return path


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_promtool(), *args], capture_output=True, text=True, timeout=60, cwd=cwd, check=False
    )


def _dashboard_exprs() -> list[str]:
    exprs: list[str] = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            exprs.append(target["expr"])
    return exprs


def _exported_names() -> set[str]:
    # The fixture behind a gateway after a canary rollback exports every family: the
    # farm's own, the gateway's and the canary analysis's.
    text = generate_latest(build_registry(lambda: canary_state())).decode()
    text += _batch_service_text()
    names: set[str] = set()
    for fam in text_string_to_metric_families(text):
        names.add(fam.name)
        names.update(s.name for s in fam.samples)
    return names


def _batch_service_text() -> str:
    """The batch service's own /metrics (issue 33), a batch running and a retry counted:
    the per-batch and per-reason series exist only once there is one."""
    from sglang_farm.batch.metrics import BatchMetrics

    m = BatchMetrics()
    for state in ("pending", "in_flight", "completed", "failed"):
        m.requests.labels(batch="batch_a", state=state).set(1)
    m.retries.labels(reason="connection").inc()
    m.eta.labels(batch="batch_a").set(60)
    m.last_progress.labels(batch="batch_a").set(1.0)
    return generate_latest(m.registry).decode()


def test_alert_rules_parse() -> None:
    r = _run("check", "rules", str(ALERTS))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_alert_rule_unit_tests_pass() -> None:
    r = _run("test", "rules", ALERTS_TEST.name, cwd=ALERTS_TEST.parent)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_alert_has_a_rule_test() -> None:
    alerts = set(re.findall(r"^\s*- alert: (\w+)", ALERTS.read_text(), re.M))
    tested = set(re.findall(r"^\s*alertname: (\w+)", ALERTS_TEST.read_text(), re.M))
    assert alerts and alerts == tested, f"untested: {alerts - tested}; unknown: {tested - alerts}"


def test_every_dashboard_expression_parses(tmp_path: Path) -> None:
    exprs = _dashboard_exprs()
    assert len(exprs) >= 15
    rules = []
    for i, expr in enumerate(exprs):
        for var, value in GRAFANA_VARS.items():
            expr = expr.replace(var, value)
        assert "$" not in expr, f"unhandled Grafana variable in {expr!r}"
        rules.append({"record": f"dashboard:expr_{i}", "expr": expr})
    # JSON is YAML: promtool reads this as a rules file.
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = _run("check", "rules", str(path))
    assert r.returncode == 0, r.stdout + r.stderr


def test_dashboard_panels_have_unique_ids_and_cover_the_issue_views() -> None:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    text = " ".join(_dashboard_exprs())
    for needed in (
        "sglang_farm_gpu_memory_used_bytes",
        "sglang_farm_gpu_utilization_ratio",
        "sglang_farm_worker_queued_requests",
        "sglang_farm_worker_generation_throughput_tokens_per_second",
        "sglang_farm_worker_state",
        "sglang_farm_worker_restarts_total",
        "sglang_farm_worker_oom_events_total",
        "sglang_farm_gateway_up",
        "sglang_farm_gateway_members",
        "sglang_farm_gateway_errors_total",
        "sglang_farm_worker_in_gateway",
        "sglang_farm_worker_last_drain_duration_seconds",
        "sglang_farm_gpu_quarantined",
        "sglang_farm_worker_quarantines_total",
        # Each worker's 5xx from SGLang's own counter (issue 34 §2).
        "sglang_farm_worker_http_server_errors_total",
        "sglang_farm_worker_http_responses_total",
        # The batch service's row (issue 33).
        "sglang_farm_batch_requests",
        "sglang_farm_batch_tokens_total",
        "sglang_farm_batch_in_flight",
        "sglang_farm_batch_concurrency_target",
        "sglang_farm_batch_retries_total",
        "sglang_farm_batch_eta_seconds",
    ):
        assert needed in text, needed


def _rule(alert: str) -> str:
    # The rule's block of alerts.yml, up to the next rule (no YAML library in the test deps).
    text = ALERTS.read_text()
    start = text.index(f"- alert: {alert}\n")
    end = text.find("- alert:", start + 1)
    return text[start : end if end > 0 else None]


def test_the_quarantine_alert_pages_at_once_and_says_what_to_do() -> None:
    rule = _rule("SglangFarmGpuQuarantined")
    assert "expr: sglang_farm_gpu_quarantined == 1\n" in rule
    assert "for:" not in rule  # a quarantine is held until released: no reason to wait
    assert "severity: critical" in rule
    for needed in ("docs/gpu-health.md", CATALOG_URL, "farmctl why", "farmctl release-gpu"):
        assert needed in rule, needed
    # WorkerDown leaves the quarantined phase out: one page per quarantine, not two.
    assert "quarantined" not in _rule("SglangFarmWorkerDown").split("labels:")[0]


def test_dashboard_panels_do_not_overlap() -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]  # Grafana's grid is 24 columns
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                other = cells.setdefault((x, y), panel["title"])
                assert other == panel["title"], f"{panel['title']!r} overlaps {other!r}"


def test_dashboard_has_a_multi_host_variable_that_every_query_uses() -> None:
    dash = json.loads(DASHBOARD.read_text())
    var = {v["name"]: v for v in dash["templating"]["list"]}["host"]
    assert var["multi"] and var["includeAll"]
    assert "label_values(sglang_farm_build_info, host)" in var["definition"]
    # "All" also matches series without a host label (a single host scraped without fleet.yml).
    assert var["allValue"] == ".*"
    for expr in _dashboard_exprs():
        assert "$instance" not in expr and "instance=~" not in expr, expr
        for selector in re.findall(r"\b(?:sglang_farm_|sglang:)[a-z_]+\{[^}]*\}", expr):
            assert 'host=~"$host"' in selector, f"{selector!r} ignores the host variable"


def test_dashboard_fleet_row_has_per_host_and_fleet_wide_views() -> None:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    fleet = [
        p
        for p in panels
        if p["gridPos"]["y"]
        < min(q["gridPos"]["y"] for q in panels if q["type"] == "row" and q["title"] == "Farm")
    ]
    assert fleet[0]["type"] == "row" and fleet[0]["title"].startswith("Fleet")
    exprs = [t["expr"] for p in fleet for t in p.get("targets", [])]
    for needed in (
        'state="ready"',
        "sglang:num_requests_total",
        "histogram_quantile(0.99, sum by (le) (rate(sglang:inter_token_latency_seconds_bucket",
        "histogram_quantile(0.99, sum by (host, le) (rate(sglang:inter_token_latency_seconds",
        "sglang_farm_gpu_quarantined",
        "sglang_farm_rollout_state",
        "sglang_farm_canary_state",
    ):
        assert any(needed in e for e in exprs), needed
    # Each view both fleet-wide (a stat, one number) and per host (a series by host).
    per_host = [
        e for p in fleet if p["type"] == "timeseries" for e in (t["expr"] for t in p["targets"])
    ]
    for metric in (
        'state="ready"',
        "num_requests_total",
        "inter_token_latency",
        "gpu_quarantined",
        "rollout_state",
    ):
        assert any(metric in e and "by (host" in e for e in per_host), metric
        assert any(
            metric in t["expr"] and "by (host" not in t["expr"]
            for p in fleet
            if p["type"] == "stat"
            for t in p["targets"]
        ), metric


@pytest.mark.parametrize("source", [ALERTS, DASHBOARD], ids=["alerts", "dashboard"])
def test_every_metric_named_is_exported(source: Path) -> None:
    named = set(re.findall(r"\bsglang_farm_[a-z0-9_]+", source.read_text()))
    assert named
    missing = named - _exported_names()
    assert not missing, f"{source.name} names metrics the exporter does not export: {missing}"
