"""A running farm's exporter (agent, simulator workers, fake GPUs): promtool, real Prometheus."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from farmproc import Farm, farm_config, new_marker, tmpdir
from promproc import _query, _start_prometheus, _wait_for

pytestmark = pytest.mark.slow

WORKERS = 4
# Families that must have one series per worker once the farm is up and polled.
PER_WORKER = (
    "sglang_farm_worker_up",
    "sglang_farm_worker_running_requests",
    "sglang_farm_worker_queued_requests",
    "sglang_farm_worker_kv_cache_usage_ratio",
    "sglang_farm_worker_generation_throughput_tokens_per_second",
    "sglang_farm_worker_gpu_memory_bytes",
    "sglang_farm_worker_last_load_duration_seconds",
    "sglang_farm_worker_oom_ladder_step",
    # Issue 34 §2: SGLang 0.5.23's (the simulator's default) own HTTP counters, per worker.
    "sglang_farm_worker_http_responses_total",
    "sglang_farm_worker_http_server_errors_total",
)
PER_GPU = (
    "sglang_farm_gpu_memory_used_bytes",
    "sglang_farm_gpu_memory_total_bytes",
    "sglang_farm_gpu_utilization_ratio",
    "sglang_farm_gpu_temperature_celsius",
    "sglang_farm_gpu_power_watts",
)


@pytest.fixture(scope="module")
def farm() -> Iterator[tuple[Farm, str]]:
    tmp, marker = tmpdir(), new_marker()
    # Worker 3 dies of a CUDA OOM 3 s after it is ready (SGLang's text, printed by the simulator);
    # worker 1 answers 500 to a share of its generations (issue 34 §2: its own counter says so).
    cfg = farm_config(
        tmp,
        workers=WORKERS,
        parallel=2,
        load_seconds=0.5,
        marker=marker,
        worker_env={
            1: {"SGLANG_SIM_ERROR_RATE": "0.5", "SGLANG_SIM_SEED": "2"},
            3: {"SGLANG_SIM_FAIL_AFTER": "3"},
        },
    )
    f = Farm(cfg, marker)
    try:
        ev = f.wait_for(lambda e: e.get("event") == "metrics_listening", timeout=30)
        f.wait_for(lambda e: e.get("event") == "rollout_done", timeout=60)
        yield f, f"127.0.0.1:{ev['address'].rsplit(':', 1)[1]}"
    finally:
        f.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def _samples(target: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body = httpx.get(f"http://{target}/metrics", timeout=5).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(body)
        for s in fam.samples
    }


def _value(samples: dict[Any, float], name: str, **labels: str) -> float | None:
    for (n, lab), v in samples.items():
        if n == name and all(dict(lab).get(k) == val for k, val in labels.items()):
            return v
    return None


def test_a_real_scrape_passes_promtool(farm: tuple[Farm, str]) -> None:
    _, target = farm
    body = httpx.get(f"http://{target}/metrics", timeout=5).content
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package 'prometheus'); CI installs it")
    out = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True)
    assert out.returncode == 0, out.stdout.decode() + out.stderr.decode()
    assert out.stdout.strip() == b"" and out.stderr.strip() == b"", out


def test_worker_states_and_gpu_memory_follow_the_farm(farm: tuple[Farm, str]) -> None:
    _, target = farm

    def ready() -> tuple[bool, Any]:
        s = _samples(target)
        states = {
            w: _value(s, "sglang_farm_worker_state", worker=str(w), state="ready")
            for w in range(WORKERS - 1)
        }
        up = {w: _value(s, "sglang_farm_worker_up", worker=str(w)) for w in range(WORKERS - 1)}
        mem = {
            w: _value(s, "sglang_farm_worker_gpu_memory_bytes", worker=str(w))
            for w in range(WORKERS - 1)
        }
        ok = (
            all(v == 1 for v in states.values())
            and all(v == 1 for v in up.values())
            and all((v or 0) > 0 for v in mem.values())
        )
        return ok, {"states": states, "up": up, "mem": mem}

    _wait_for("workers 0-2 ready, polled and holding (simulated) GPU memory", ready, timeout=30)
    s = _samples(target)
    assert _value(s, "sglang_farm_gpu_simulated") == 1  # the demo GPUs say so


def test_a_cuda_oom_while_serving_counts_as_an_oom_event_and_restart(
    farm: tuple[Farm, str],
) -> None:
    f, target = farm
    f.wait_for(lambda e: e.get("event") == "worker_failed" and e.get("worker") == 3, timeout=30)

    def counted() -> tuple[bool, Any]:
        s = _samples(target)
        oom = _value(s, "sglang_farm_worker_oom_events_total", worker="3", kind="cuda")
        restarts = _value(s, "sglang_farm_worker_restarts_total", worker="3", reason="oom")
        return (oom or 0) >= 1 and (restarts or 0) >= 1, {"oom": oom, "restarts": restarts}

    _wait_for(
        "oom_events_total{kind=cuda} and restarts_total{reason=oom} for worker 3",
        counted,
        timeout=30,
    )
    failed = f.named("worker_failed", worker=3)[0]
    assert failed["kind"] == "cuda_oom_serving"


def test_prometheus_scrapes_the_farm_and_discovers_its_workers(
    farm: tuple[Farm, str], tmp_path: Path
) -> None:
    f, target = farm
    config = json.dumps(
        {
            "global": {"scrape_interval": "1s"},
            "scrape_configs": [
                {"job_name": "sglang-farm", "static_configs": [{"targets": [target]}]},
                {
                    "job_name": "sglang",
                    "http_sd_configs": [{"url": f"http://{target}/sd", "refresh_interval": "1s"}],
                },
            ],
        }
    )
    proc, url = _start_prometheus(tmp_path, config)
    try:
        with httpx.Client(base_url=url, timeout=5) as client:
            for fam in PER_WORKER:

                def per_worker(fam: str = fam) -> tuple[bool, Any]:
                    rows = _query(client, f'{fam}{{job="sglang-farm"}}')
                    workers = sorted({r["metric"].get("worker") for r in rows})
                    return {"0", "1", "2"} <= set(workers), rows

                _wait_for(f"{fam} for workers 0-2", per_worker)
            for fam in PER_GPU:

                def per_gpu(fam: str = fam) -> tuple[bool, Any]:
                    rows = _query(client, f'{fam}{{job="sglang-farm"}}')
                    return len({r["metric"].get("gpu") for r in rows}) == WORKERS, rows

                _wait_for(f"{fam} for {WORKERS} GPUs", per_gpu)

            def states() -> tuple[bool, Any]:
                rows = _query(
                    client, 'sum by (state) (sglang_farm_worker_state{job="sglang-farm"})'
                )
                got = {r["metric"]["state"]: float(r["value"][1]) for r in rows}
                return sum(got.values()) == WORKERS and got.get("ready", 0) >= 3, got

            _wait_for("one state per worker", states)

            def discovered() -> tuple[bool, Any]:
                rows = _query(client, 'sglang:num_running_reqs{job="sglang"}')
                return {"0", "1", "2"} <= {r["metric"].get("worker") for r in rows}, rows

            _wait_for("SGLang's own series, discovered through /sd, with worker labels", discovered)

            # Issue 34 §2: worker 1's 500s, as its SGLang counted them, reach Prometheus
            # through the farm's counters; the dashboard's 5xx share is computed from them.
            st = json.loads(f.farmctl("--json", "status").stdout)
            url = next(w["base_url"] for w in st["workers"] if w["id"] == 1)
            with httpx.Client(base_url=url, timeout=10) as worker:
                codes = [
                    worker.post("/generate", json={"text": "hi", "max_tokens": 1}).status_code
                    for _ in range(20)
                ]
            assert 0 < codes.count(500) < len(codes), codes

            def counted() -> tuple[bool, Any]:
                errors = _query(client, 'sglang_farm_worker_http_server_errors_total{worker="1"}')
                share = _query(
                    client,
                    'rate(sglang_farm_worker_http_server_errors_total{worker="1"}[1m]) / '
                    'rate(sglang_farm_worker_http_responses_total{worker="1"}[1m])',
                )
                got = [float(r["value"][1]) for r in errors]
                return got == [codes.count(500)] and bool(share), (got, share)

            _, share = _wait_for("worker 1's 500s in Prometheus", counted)
            assert 0 < float(share[0]["value"][1]) <= 1, share
    finally:
        proc.terminate()
        proc.wait(10)
