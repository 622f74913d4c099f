"""Canary figures end to end (issue 23 #1, #4): two simulators behind the real smg, one
of them answering 10 % of its requests 500 (SGLANG_SIM_ERROR_RATE); the figures built
from their /metrics and smg's per-worker outcomes judge that one and not the other.

Checks the facts the verdict rests on against the real gateway: smg labels its
outcomes with the worker's URL and counts a worker's 500 as a `failure` outcome of that
worker; SGLang's (the simulator's) finished requests do not see the 500s, its HTTP
response counter (0.5.20+) does, and the two error sources agree.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sglang_farm.canary import figures, promtext
from sglang_farm.canary.verdict import CanaryPolicy, Outcome, judge
from simproc import free_port
from smgsims import wait_http

MODEL = "sim/canary"
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("smg") is None,
    reason="smg is not installed (pip install smg; scripts/setup installs it)",
)


def _start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


@contextlib.contextmanager
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    try:
        yield started
    finally:
        for p in started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)


def test_the_gateway_outcomes_of_an_erring_canary_roll_it_back(tmp_path: Path) -> None:
    ports = [free_port() for _ in range(4)]
    good_url, bad_url = (f"http://127.0.0.1:{p}" for p in ports[:2])
    gateway, metrics = f"http://127.0.0.1:{ports[2]}", f"http://127.0.0.1:{ports[3]}"
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_SIM_")}
    base_env |= {
        "SGLANG_SIM_LOAD_SECONDS": "0.2",
        "SGLANG_SIM_WARMUP_SECONDS": "0.1",
        "SGLANG_SIM_HEALTH_DELAY": "0.05",
        "SGLANG_SIM_TOKEN_SECONDS": "0.002",
    }
    with processes() as started:
        for port, extra in ((ports[0], {}), (ports[1], {"SGLANG_SIM_ERROR_RATE": "0.1"})):
            argv = [sys.executable, "-m", "sglang_farm.sim", "--model-path", MODEL]
            argv += ["--host", "127.0.0.1", "--port", str(port), "--enable-metrics"]
            started.append(_start(argv, base_env | extra, tmp_path / f"sim{port}.log"))
        for port in ports[:2]:
            wait_http(
                f"http://127.0.0.1:{port}/health", 30, "simulator", tmp_path / f"sim{port}.log"
            )
        smg = [sys.executable, "-m", "smg", "launch", "--host", "127.0.0.1"]
        smg += ["--port", str(ports[2]), "--policy", "round_robin"]
        smg += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(ports[3])]
        smg += ["--worker-urls", good_url, bad_url]
        log = tmp_path / "smg.log"
        started.append(_start(smg, dict(os.environ), log))
        wait_http(f"{gateway}/readiness", 30, "smg", log)
        wait_http(f"{metrics}/metrics", 30, "smg's metrics listener", log)

        def scrape() -> list[figures.WorkerSample]:
            gw = promtext.parse(httpx.get(f"{metrics}/metrics").text, source="smg")
            bodies = {u: httpx.get(f"{u}/metrics").text for u in (good_url, bad_url)}
            return [
                figures.worker_sample(promtext.parse(text, source=u), gw, u)
                for u, text in bodies.items()
            ]

        before = scrape()
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        statuses = []
        with httpx.Client(timeout=10) as client:
            for _ in range(400):
                statuses.append(
                    client.post(f"{gateway}/v1/chat/completions", json=body).status_code
                )
        time.sleep(0.5)  # smg's counters settle after the answer
        after = scrape()
    good = figures.window(before[0], after[0], 30.0)
    bad = figures.window(before[1], after[1], 30.0)
    assert after[1].gateway_failed is not None, "smg exposed no outcomes for the worker's URL"
    assert good.errors == 0 and good.requests >= 150, good
    assert bad.errors >= 5, (bad, statuses.count(500))
    assert bad.requests >= 150
    # SGLang's own count of finished requests misses the 500s; the gateway's does not.
    assert after[1].requests - before[1].requests <= bad.requests - bad.errors
    # The worker's own response counter (SGLang 0.5.20+) and smg's outcomes agree on the
    # 500s: each source alone judges the canary the same (issue 30 #1).
    assert bad.source is figures.ErrorSource.WORKERS
    via_gateway = bad.on(figures.ErrorSource.GATEWAY)
    assert via_gateway is not None and via_gateway.errors == bad.errors, (bad, via_gateway)
    v = judge(bad, good, [], CanaryPolicy())
    assert v.outcome is Outcome.ROLLBACK, v.evidence
    assert v.evidence.startswith("canary errors ")
    assert judge(good, bad, [], CanaryPolicy()).outcome is Outcome.PROMOTE
