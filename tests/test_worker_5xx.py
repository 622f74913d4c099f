"""Each worker's 5xx from SGLang's own counter (issue 34 §2): `sglang:http_responses_total`
read as the canary reads it, kept over the recent polls, exported as the farm's counters
and ratio, and shown by `farmctl status` and `why`; absent, never 0, for a worker whose
SGLang has no such counter (0.5.12). The pure parts, poll_worker against the simulator as
both versions, and a process-runtime farm of one of each."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from farmproc import Farm, farm_config, new_marker
from sglang_farm.canary import figures, promtext
from sglang_farm.cli.ctl.status import format_status
from sglang_farm.cli.readings import errors_cell, errors_line
from sglang_farm.sglang.health import LocalHttp
from sglang_farm.sglang.load import (
    RecentAnswers,
    WorkerSample,
    WorkerStatsTracker,
    recent_answers,
)
from sglang_farm.sglang.stats import parse_metrics_text, poll_worker
from simproc import StartSim

GIVE_UP_S = 120.0  # a simulator starts in about 1 s here; far above, on a busy machine
FAST = {"SGLANG_SIM_LOAD_SECONDS": "0", "SGLANG_SIM_TOKEN_SECONDS": "0"}

# SGLang 0.5.23's HTTP counters beside a scheduler gauge: 2xx, 4xx and 5xx answers on
# serving routes, and the agent's own probes and scrapes (no traffic).
BODY_0523 = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",tp_rank="0"} 1.0
# TYPE sglang:http_requests_total counter
sglang:http_requests_total{endpoint="/generate",method="POST"} 70.0
sglang:http_requests_total{endpoint="/metrics",method="GET"} 5.0
# TYPE sglang:http_responses_total counter
sglang:http_responses_total{endpoint="/generate",method="POST",status_code="200"} 40.0
sglang:http_responses_total{endpoint="/v1/chat/completions",method="POST",status_code="200"} 10.0
sglang:http_responses_total{endpoint="/v1/chat/completions",method="POST",status_code="500"} 4.0
sglang:http_responses_total{endpoint="/generate",method="POST",status_code="503"} 1.0
sglang:http_responses_total{endpoint="/generate",method="POST",status_code="400"} 7.0
sglang:http_responses_total{endpoint="/health",method="GET",status_code="503"} 30.0
sglang:http_responses_total{endpoint="/metrics",method="GET",status_code="200"} 5.0
"""
BODY_0512 = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",tp_rank="0"} 1.0
# TYPE sglang:num_requests_total counter
sglang:num_requests_total{model_name="m"} 61.0
"""


def test_the_farms_figures_read_the_counter_as_the_canary_does() -> None:
    """One reading of the counter for both (`sglang.responses`): 2xx and 5xx on the serving
    routes are answers, the 5xx errors; 4xx and the probes count for neither. A 0.5.12
    worker has none: None, not 0."""
    sample = parse_metrics_text(0, 1.0, BODY_0523)
    assert (sample.answered, sample.server_errors) == (55.0, 5.0)
    assert figures.http_responses(promtext.parse(BODY_0523)) == (55.0, 5.0)
    assert sample.running == 1.0  # the other figures as before
    old = parse_metrics_text(0, 1.0, BODY_0512)
    assert (old.answered, old.server_errors) == (None, None)
    assert figures.http_responses(promtext.parse(BODY_0512)) == (None, None)


def _sample(at: float, answered: float | None, errors: float | None) -> WorkerSample:
    return WorkerSample(0, at, True, source="metrics", answered=answered, server_errors=errors)


def test_the_recent_figure_is_the_windows_increase_with_a_reset_counted_as_prometheus_does() -> (
    None
):
    tracker = WorkerStatsTracker(answers_window_s=60.0)
    st = tracker.update(None, _sample(0.0, 100, 1), 0.0)
    assert st.recent is None  # one poll: no window yet (absent, not 0)
    st = tracker.update(st, _sample(30.0, 150, 6), 30.0)
    assert st.recent == RecentAnswers(30.0, 50.0, 5.0)
    assert st.recent.ratio == pytest.approx(0.1)
    # The worker restarted (its counters from 0): the later value is the whole increase.
    st = tracker.update(st, _sample(60.0, 20, 2), 60.0)
    assert st.recent == RecentAnswers(60.0, 70.0, 7.0)
    # Polls older than the window drop out.
    st = tracker.update(st, _sample(90.0, 20, 2), 90.0)
    assert st.recent == RecentAnswers(60.0, 20.0, 2.0)
    st = tracker.update(st, _sample(150.0, 20, 2), 150.0)
    assert st.recent == RecentAnswers(60.0, 0.0, 0.0) and st.recent.ratio is None
    # A failed poll keeps the window's polls; a poll without the counter clears them.
    down = tracker.update(st, WorkerSample(0, 160.0, False, error="timeout"), 160.0)
    assert down.recent == st.recent and down.answered is None
    assert tracker.update(down, _sample(170.0, None, None), 170.0).recent is None
    assert recent_answers([(0.0, 5.0, 9.0), (1.0, 6.0, 12.0)]) == RecentAnswers(1.0, 1.0, 1.0)


async def _poll(url: str) -> WorkerSample:
    return await poll_worker(LocalHttp(), url, 10.0, worker=0, known_version="x")


@pytest.mark.parametrize("version", ["0.5.23", "0.5.12"])
def test_a_poll_of_the_simulator_counts_its_500s_as_its_sglang_version_does(
    sims: StartSim,
    version: str,
) -> None:
    """SGLANG_SIM_ERROR_RATE's 500s, counted by the worker's own counter as 0.5.23;
    SGLANG_SIM_VERSION=0.5.12 has no counter: the sample says None, not 0."""
    env = {**FAST, "SGLANG_SIM_ERROR_RATE": "0.3", "SGLANG_SIM_SEED": "5"}
    sim = sims("--enable-metrics", env={**env, "SGLANG_SIM_VERSION": version})
    sim.wait_ready()
    before = asyncio.run(_poll(sim.url))
    with httpx.Client(base_url=sim.url, timeout=10) as client:
        codes = [
            client.post("/generate", json={"text": "hi", "max_tokens": 1}).status_code
            for _ in range(30)
        ]
        assert client.post("/generate", content=b"{nope").status_code == 400
    after = asyncio.run(_poll(sim.url))
    assert after.ok, after.error
    if version == "0.5.12":
        assert (after.answered, after.server_errors) == (None, None)
        return
    assert before.answered is not None and before.server_errors is not None
    assert after.answered is not None and after.server_errors is not None
    assert after.server_errors - before.server_errors == codes.count(500) > 0
    assert after.answered - before.answered == len(codes)  # the 400 is the client's


@pytest.mark.slow
def test_status_why_and_metrics_show_each_workers_recent_5xx_and_none_for_0512(
    short_tmp: Path,
) -> None:
    """A farm of a 0.5.23 worker answering some 500s and a 0.5.12 one: status JSON and table
    carry worker 0's recent 5xx from its counter, `why 0` says it, the exporter has its
    counters; worker 1 has none of them (absent, not 0)."""
    marker = new_marker()
    errors = {"SGLANG_SIM_ERROR_RATE": "0.4", "SGLANG_SIM_SEED": "3"}
    cfg = farm_config(
        short_tmp,
        workers=2,
        marker=marker,
        worker_env={0: errors, 1: {**errors, "SGLANG_SIM_VERSION": "0.5.12"}},
    )
    farm = Farm(cfg, marker)
    try:
        ev = farm.wait_for(lambda e: e.get("event") == "metrics_listening", timeout=GIVE_UP_S)
        farm.wait_for(lambda e: e.get("event") == "rollout_done", timeout=GIVE_UP_S)
        st = json.loads(farm.farmctl("--json", "status").stdout)
        urls = {w["id"]: w["base_url"] for w in st["workers"]}
        codes: dict[int, list[int]] = {0: [], 1: []}
        for wid, url in urls.items():
            with httpx.Client(base_url=url, timeout=10) as client:
                codes[wid] = [
                    client.post("/generate", json={"text": "hi", "max_tokens": 1}).status_code
                    for _ in range(25)
                ]
        assert codes[0].count(500) > 0 and codes[1].count(500) > 0
        end = time.monotonic() + GIVE_UP_S
        while True:
            st = json.loads(farm.farmctl("--json", "status").stdout)
            w0, w1 = st["workers"]
            r = w0.get("recent_5xx")
            if r and r["answered"] >= len(codes[0]):
                break
            assert time.monotonic() < end, st
            time.sleep(0.5)
        text = farm.farmctl("status").stdout
        why0 = farm.farmctl("why", "0").stdout
        why1 = json.loads(farm.farmctl("--json", "why", "1").stdout)
        port = ev["address"].rsplit(":", 1)[1]
        body = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    finally:
        farm.stop()
    assert r["server_errors"] == codes[0].count(500)
    assert r["answered"] == len(codes[0])
    assert r["ratio"] == pytest.approx(codes[0].count(500) / len(codes[0]))
    assert "recent_5xx" not in w1  # SGLang 0.5.12: no counter, so no figure
    assert "recent_5xx" not in why1
    lines = text.splitlines()
    head = next(ln for ln in lines if ln.startswith("WORKER"))
    assert "5XX" in head.split()
    row0 = next(ln for ln in lines if ln.startswith("0 "))
    row1 = next(ln for ln in lines if ln.startswith("1 "))
    assert errors_cell(r) in row0 and "%" not in row1
    assert f"5xx: {codes[0].count(500)} of {len(codes[0])} answers" in why0
    samples = {
        (s.name, s.labels.get("worker")): s.value
        for fam in text_string_to_metric_families(body)
        for s in fam.samples
    }
    assert samples[("sglang_farm_worker_http_server_errors_total", "0")] >= codes[0].count(500)
    assert samples[("sglang_farm_worker_http_responses_total", "0")] >= len(codes[0])
    assert ("sglang_farm_worker_http_server_errors_total", "1") not in samples
    assert ("sglang_farm_worker_http_responses_total", "1") not in samples
    assert ("sglang_farm_worker_http_5xx_ratio", "1") not in samples


def test_the_table_shows_a_5xx_column_only_when_a_worker_has_the_figure() -> None:
    def status(**extra: object) -> dict[str, object]:
        w = {"id": 0, "gpus": [0], "port": 30000, "state": "ready", "since": 1.0, **extra}
        return {"farm": "f", "runtime": "process", "rollout": "done", "now": 2.0, "workers": [w]}

    assert "5XX" not in format_status(status())
    recent = {"seconds": 29.0, "answered": 480.0, "server_errors": 10.0, "ratio": 10 / 480}
    shown = format_status(status(recent_5xx=recent))
    assert "5XX" in shown and "2.1% of 480" in shown
    idle = {"seconds": 29.0, "answered": 0.0, "server_errors": 0.0, "ratio": None}
    assert "0 answered" in format_status(status(recent_5xx=idle))
    assert errors_line(recent) == (
        "5xx: 10 of 480 answers on its serving routes (2.1%) over the last 29 s, as its "
        "SGLang counts them (sglang:http_responses_total)"
    )
