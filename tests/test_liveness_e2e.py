"""Busy versus wedged, end to end: a real farm of simulators under the process runtime.

Worker 1 runs SGLang's generating `/health` (SGLANG_SIM_HEALTH_QUEUES) under a full batch
of long non-streamed requests: its `/health` times out beat after beat while its counters
advance, and the farm must keep it (`worker_busy`, never `worker_terminating`). Worker 2
wedges (SGLANG_SIM_WEDGE_AFTER) with requests running: its `/health` keeps answering 200
while its counters freeze, and the farm must restart it, saying "wedged". Worker 0 idles.
"""

from __future__ import annotations

import threading
import time
import tomllib
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from farmproc import Farm, farm_config, marked_pids, new_marker

pytestmark = pytest.mark.slow

TOKEN_S = 0.05
LONG = 500  # tokens: 25 s per request: worker 1's first batch runs through the whole test
MAX_RUNNING = 4
STALL_S = 8.0
WEDGE_AFTER_S = 3.0
WORKER_HEALTH_TIMEOUT_S = 2.0
HEALTH = {
    "period": "1s",
    "timeout": "1s",
    "failure_threshold": 2,
    "busy_window": "6s",
    "stall_window": f"{STALL_S:g}s",
}
RESTART = {"backoff_initial": "0.5s", "backoff_max": "5s", "max_failures": 5, "stop_timeout": "2s"}


class Load:
    """`clients` threads, each sending long non-streamed /generate requests to one worker's
    port, one after the other, until `stop()` (the one in flight is left to the worker)."""

    def __init__(self, base_url: str, clients: int, *, repeat: bool) -> None:
        self.base_url = base_url
        self.repeat = repeat
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": LONG}}
        with httpx.Client(base_url=self.base_url, timeout=60, trust_env=False) as client:
            while not self._stop.is_set():
                try:
                    client.post("/generate", json=body)
                except httpx.HTTPError:
                    return  # the worker was stopped under it
                if not self.repeat:
                    return

    def stop(self) -> None:
        self._stop.set()


def running(base_url: str) -> float:
    """`sglang:num_running_reqs` on the worker's own /metrics."""
    text = httpx.get(base_url + "/metrics", timeout=2, trust_env=False).text
    for line in text.splitlines():
        if line.startswith("sglang:num_running_reqs"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no sglang:num_running_reqs in /metrics")


def wait_until(what: str, check: Callable[[], bool], timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.timeout(90)
def test_busy_worker_is_kept_and_wedged_worker_restarted(short_tmp: Path) -> None:
    marker = new_marker()
    config = farm_config(
        short_tmp,
        workers=3,
        parallel=3,
        load_seconds=0.3,
        marker=marker,
        health=HEALTH,
        restart=RESTART,
        sglang={"max_running_requests": MAX_RUNNING},
        # The pollers must see the counters move well within a health period.
        metrics={"worker_poll_interval": "0.5s"},
        worker_env={
            1: {
                "SGLANG_SIM_HEALTH_QUEUES": "1",
                "SGLANG_SIM_TOKEN_SECONDS": str(TOKEN_S),
                # Each probe then also fails on the server's side, which logs it.
                "SGLANG_HEALTH_CHECK_TIMEOUT": str(WORKER_HEALTH_TIMEOUT_S),
            },
            2: {
                "SGLANG_SIM_WEDGE_AFTER": str(WEDGE_AFTER_S),
                "SGLANG_SIM_TOKEN_SECONDS": str(TOKEN_S),
            },
        },
    )
    base = int(tomllib.loads(config.read_text())["workers"]["base_port"])
    busy_url, wedged_url = f"http://127.0.0.1:{base + 1}", f"http://127.0.0.1:{base + 2}"

    farm = Farm(config, marker)
    loads: list[Load] = []
    try:
        farm.wait_for(lambda e: e.get("event") == "rollout_done", timeout=30)
        start = len(farm.snapshot())
        t0 = time.monotonic()
        # Worker 2: requests running when it wedges (3 s after it was ready).
        loads.append(Load(wedged_url, 2, repeat=False))
        # Worker 1: a full batch and as many queued behind it, for as long as the test runs.
        loads.append(Load(busy_url, 2 * MAX_RUNNING, repeat=True))
        wait_until("a full batch on worker 1", lambda: running(busy_url) == MAX_RUNNING, 5)
        # Its /health, as the farm probes it, gets no answer within the 1 s timeout.
        with pytest.raises(httpx.ReadTimeout):
            httpx.get(busy_url + "/health", timeout=1.0, trust_env=False)

        failed = farm.wait_for(
            lambda e: e.get("event") == "worker_failed" and e.get("worker") == 2,
            after=start,
            timeout=40,
        )
        took = failed["_t"] - t0
        assert failed["kind"] == "hang", failed
        assert failed["summary"].startswith("wedged:"), failed
        assert "requests running and no token or request progress" in failed["summary"], failed
        term = farm.named("worker_terminating", worker=2)
        assert [e["kind"] for e in term] == ["hang"], term
        # Not before its counters had been frozen for the stall window.
        assert term[0]["_t"] - t0 >= WEDGE_AFTER_S + STALL_S - 1.5, (term[0]["_t"] - t0, took)
        why = farm.farmctl("why", "2")
        assert why.returncode == 0, why.stderr
        assert "wedged" in why.stdout, why.stdout

        # Worker 1 through the same window, its /health timing out beat after beat.
        after = farm.snapshot()[start:]
        mine = [e for e in after if e.get("worker") == 1]
        assert [e for e in mine if e.get("event") == "worker_terminating"] == [], mine
        with pytest.raises(httpx.ReadTimeout):
            httpx.get(busy_url + "/health", timeout=1.0, trust_env=False)
        assert running(busy_url) == MAX_RUNNING
        busy = [e for e in mine if e.get("event") == "worker_busy"]
        assert busy, [e.get("event") for e in mine]
        assert busy[0]["detail"] == "no answer within 1 s", busy[0]
        # At most the one probe that failed before the farm had seen the counters move.
        assert len([e for e in mine if e.get("event") == "health_failed"]) <= 1, mine
        # The worker's own log: SGLang's "Health check failed", probe after probe.
        logs = farm.farmctl("logs", "1", "--lines", "2000")
        assert logs.returncode == 0, logs.stderr
        failures = logs.stdout.count("Health check failed.")
        assert failures >= 3, (failures, took, logs.stdout[-2000:])
        assert len(farm.named("worker_launched", worker=1)) == 1
        assert len(farm.named("worker_launched", worker=0)) == 1
        print(
            f"worker 2 restarted {took:.1f} s after the load began; worker 1 kept, busy, "
            f"its /health failed {failures} times"
        )
    finally:
        for load in loads:
            load.stop()
        assert farm.stop() == 0
    assert marked_pids(marker) == []
