"""Readiness asked on SGLang's own `/ready` where the worker has it (0.5.20+), on `/health`
where it answers 404 (the seed host's 0.5.12), liveness on `/health` (issue 34 §2): the
pure choice, the config key, the systemd gate against the simulator as both versions, and
the agent's own readiness probe through a process-runtime farm of 0.5.12 simulators."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from farmproc import Farm, farm_config, new_marker
from sglang_farm.config import load_spec
from sglang_farm.errors import ConfigError
from sglang_farm.runtime.waitready import WaitExit, wait_url
from sglang_farm.sglang.ready_route import next_route, readiness_routes

GIVE_UP_S = 120.0  # a simulator starts in about 1 s here; far above, on a busy machine


def test_auto_asks_ready_then_the_liveness_route() -> None:
    assert readiness_routes("auto", "/health") == ("/ready", "/health")
    assert readiness_routes("auto", "/health_generate") == ("/ready", "/health_generate")
    assert readiness_routes("auto", "/ready") == ("/ready",)
    assert readiness_routes("/health", "/health") == ("/health",)
    assert readiness_routes("/custom", "/health") == ("/custom",)


def test_only_a_404_moves_readiness_to_the_next_route() -> None:
    routes = ("/ready", "/health")
    assert next_route(routes, 0, 404) == 1
    for status in (None, 200, 401, 500, 503):
        assert next_route(routes, 0, status) == 0, status
    assert next_route(routes, 1, 404) == 1  # the last route stays
    assert next_route(("/ready",), 0, 404) == 0


def test_ready_path_defaults_to_auto_and_takes_a_route() -> None:
    base = "[workers]\ngpus = [0]\n[sglang]\nmodel_path = '/m'\n"
    assert load_spec(base, source="f", gpu_count=1).health.ready_path == "auto"
    spec = load_spec(base + "[health]\nready_path = '/health'\n", source="f", gpu_count=1)
    assert spec.health.ready_path == "/health"
    with pytest.raises(ConfigError) as info:
        load_spec(base + "[health]\nready_path = 'ready'\n", source="f", gpu_count=1)
    (problem,) = info.value.problems
    assert "health.ready_path" in problem and '"auto" or a URL path' in problem


@pytest.fixture
def sim_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    yield port


def _sim(port: int, version: str | None) -> subprocess.Popen[bytes]:
    env = {**os.environ, "SGLANG_SIM_LOAD_SECONDS": "0.5", "SGLANG_SIM_WARMUP_SECONDS": "0.2"}
    if version is not None:
        env["SGLANG_SIM_VERSION"] = version
    return subprocess.Popen(
        [sys.executable, "-m", "sglang_farm.sim", "--model-path", "sim/m", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _until_answered(url: str) -> httpx.Response:
    end = time.monotonic() + GIVE_UP_S
    while True:
        try:
            r = httpx.get(url, timeout=30)
            if r.status_code != 503:
                return r
        except httpx.TransportError:
            pass
        assert time.monotonic() < end, f"{url} never answered"
        time.sleep(0.1)


@pytest.mark.parametrize(("version", "ready_status"), [("0.5.12", 404), (None, 200)])
def test_the_simulator_serves_ready_as_its_sglang_version_does(
    sim_port: int, version: str | None, ready_status: int
) -> None:
    proc = _sim(sim_port, version)
    try:
        base = f"http://127.0.0.1:{sim_port}"
        assert _until_answered(base + "/health").status_code == 200
        assert httpx.get(base + "/ready", timeout=30).status_code == ready_status
        info = httpx.get(base + "/server_info", timeout=30).json()
        assert info["version"] == (version or "0.5.23")
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.mark.parametrize("version", ["0.5.12", None])
def test_the_gate_is_ready_on_either_version(sim_port: int, version: str | None) -> None:
    """The systemd gate as the drop-ins run it (`--url .../ready --url .../health`): ready on
    0.5.23 through /ready, on 0.5.12 through /health after /ready's 404."""
    proc = _sim(sim_port, version)
    try:
        base = f"http://127.0.0.1:{sim_port}"
        got = wait_url(
            0,
            (base + "/ready", base + "/health"),
            deadline=GIVE_UP_S,
            probe_timeout=30,
            interval=0.1,
            main_pid=proc.pid,
        )
        assert got == WaitExit.READY
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_the_gate_alone_on_ready_never_passes_a_0512_worker(sim_port: int) -> None:
    """Without the fallback (only /ready) a 0.5.12 worker is never ready: the route matters."""
    proc = _sim(sim_port, "0.5.12")
    try:
        base = f"http://127.0.0.1:{sim_port}"
        assert _until_answered(base + "/health").status_code == 200
        got = wait_url(0, (base + "/ready",), deadline=3, probe_timeout=2, interval=0.1)
        assert got == WaitExit.NOT_READY
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.mark.parametrize("version", ["0.5.12", "0.5.23"])
def test_the_agent_brings_workers_of_either_version_to_ready(short_tmp: Path, version: str) -> None:
    """The agent's own readiness probe (process runtime): two simulated workers as 0.5.12
    become ready through /health after /ready's 404, saying so once per worker; as 0.5.23
    through /ready, with no such line. Liveness, once ready, is /health on either version
    (the generating check: /ready does not see a wedged scheduler)."""
    marker = new_marker()
    env = {"SGLANG_SIM_VERSION": version}
    cfg = farm_config(short_tmp, workers=2, marker=marker, worker_env={0: env, 1: env})
    farm = Farm(cfg, marker)

    def gets() -> list[str]:
        # The worker's own access log: each GET's route and status, in order.
        logs = farm.farmctl("logs", "0", "-n", "500").stdout
        return [line.split('"GET ')[1] for line in logs.splitlines() if '"GET /' in line]

    try:
        farm.wait_for(lambda e: e.get("event") == "rollout_done", timeout=GIVE_UP_S)
        routes = farm.named("worker_ready_route")
        end = time.monotonic() + GIVE_UP_S
        while True:  # the liveness probes after the start ([health] period 0.5 s)
            answered = gets()
            ok = [i for i, a in enumerate(answered) if '" 200' in a]
            if ok and len(answered) - ok[0] > 4:
                break
            assert time.monotonic() < end, answered
            time.sleep(0.5)
        logs = "\n".join(answered)
    finally:
        farm.stop()
    first_ok = answered[ok[0]]
    after = [a.split(" ")[0] for a in answered[ok[0] + 1 :]]
    # Liveness on /health; /ready is asked no more (the stats poll reads /metrics, /v1/loads).
    assert "/health" in after and "/ready" not in after, after
    if version == "0.5.12":
        assert sorted(e["worker"] for e in routes) == [0, 1]
        assert all(e["route"] == "/health" for e in routes)
        assert "SGLang before 0.5.20" in routes[0]["why"]
        assert any(a.startswith('/ready HTTP/1.1" 404') for a in answered), logs
        assert first_ok.startswith("/health "), logs
    else:
        assert routes == []
        assert first_ok.startswith("/ready "), logs
