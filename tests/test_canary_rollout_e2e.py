"""End to end (issue 23): the agent, the process runtime and simulator workers under
load; a reload that makes every token 5x slower is judged on the canary alone and rolled
back, no other worker ever running it."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from farmproc import Farm, farm_config, new_marker
from farmtoml import rewritten

pytestmark = pytest.mark.slow

MODEL = "sim/Qwen3.6-27B"


@contextlib.contextmanager
def load(urls: list[str], per_worker: int = 3) -> Iterator[list[int]]:
    """`per_worker` clients per worker sending short chat requests until the block ends;
    yields the list of status codes seen."""
    stop = threading.Event()
    statuses: list[int] = []
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}

    def client(url: str) -> None:
        with httpx.Client(timeout=10, trust_env=False) as c:
            while not stop.is_set():
                try:
                    statuses.append(c.post(f"{url}/v1/chat/completions", json=body).status_code)
                except httpx.HTTPError:
                    statuses.append(0)
                    time.sleep(0.05)

    threads = [
        threading.Thread(target=client, args=(u,), daemon=True)
        for u in urls
        for _ in range(per_worker)
    ]
    for t in threads:
        t.start()
    try:
        yield statuses
    finally:
        stop.set()
        for t in threads:
            t.join(15)


def test_a_reload_making_tokens_5x_slower_is_rolled_back_from_the_canary(short_tmp: Path) -> None:
    marker = new_marker()
    cfg = farm_config(
        short_tmp,
        workers=3,
        parallel=2,
        load_seconds=0.5,
        marker=marker,
        rollout={"analysis_window": "8s", "min_requests": 20},
        # A loaded CI machine (4 test workers on 2 cores) may miss a probe or two; a
        # canary judged unhealthy there would be a false rollback, not the change's doing.
        health={"period": "1s", "timeout": "5s", "failure_threshold": 5},
    )
    farm = Farm(cfg, marker)
    try:
        farm.wait_for(lambda e: e.get("event") == "rollout_done", timeout=60)
        ports = sorted({e["port"] for e in farm.named("worker_launching") if "port" in e})
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        assert len(urls) == 3
        with load(urls):
            good = cfg.read_text()
            env = {
                "SGLANG_SIM_LOAD_SECONDS": "0.5",
                "SGLANG_SIM_HEALTH_DELAY": "0.05",
                "SGLANG_SIM_WARMUP_SECONDS": "0.1",
                "SGLANG_FARM_TEST_MARKER": marker,
                "SGLANG_SIM_TOKEN_SECONDS": "0.05",
            }
            cfg.write_text(rewritten(good, farm={"env": env}))
            n = len(farm.snapshot())
            # farmctl reload waits for the verdict: a rollback exits 5, with its evidence.
            out = farm.farmctl("reload", timeout=120)
            assert out.returncode == 5, out.stdout + out.stderr
            assert "rolled back" in out.stdout and "ITL" in out.stdout, out.stdout
            # Issue 31 item 2: it said "restarted workers 0, 1, 2" of the canary's restart.
            assert out.stdout.splitlines()[0] == (
                "config applied: restarting canary worker 0 onto the change; workers 1, 2 "
                "follow in waves if its analysis passes (otherwise they keep the old config)"
            ), out.stdout
            farm.wait_for(lambda e: e.get("event") == "canary_analysis_started", after=n)
            back = farm.wait_for(
                lambda e: (
                    e.get("event") in ("canary_rolled_back", "canary_promoted", "canary_held")
                ),
                after=n,
                timeout=60,
            )
            assert back["event"] == "canary_rolled_back", back
            assert back["worker"] == 0 and "ITL" in back["evidence"], back
            farm.wait_for(
                lambda e: e.get("event") == "worker_ready" and e.get("worker") == 0,
                after=farm.snapshot().index(
                    next(e for e in farm.snapshot()[n:] if e.get("event") == "canary_rolled_back")
                ),
                timeout=30,
            )
        # Workers 1 and 2 were never restarted; the canary ran the change once, then the
        # old config again.
        later = farm.snapshot()[n:]
        launched = [e["worker"] for e in later if e.get("event") == "worker_launching"]
        assert launched == [0, 0], launched
        # The same change again is refused, naming the verdict.
        again = farm.farmctl("reload")
        assert again.returncode == 6, again.stdout + again.stderr  # held: not rolled again
        assert "rejected by its canary" in again.stdout + again.stderr
    finally:
        assert farm.stop() == 0


def test_a_harmless_reload_is_promoted_from_the_canary_and_reaches_every_worker(
    short_tmp: Path,
) -> None:
    marker = new_marker()
    cfg = farm_config(
        short_tmp,
        workers=3,
        parallel=2,
        load_seconds=0.5,
        marker=marker,
        rollout={"analysis_window": "8s", "min_requests": 20},
        # A loaded CI machine (4 test workers on 2 cores) may miss a probe or two; a
        # canary judged unhealthy there would be a false rollback, not the change's doing.
        health={"period": "1s", "timeout": "5s", "failure_threshold": 5},
        sglang={"model_path": MODEL, "enable_metrics": True},
    )
    farm = Farm(cfg, marker)
    try:
        farm.wait_for(lambda e: e.get("event") == "rollout_done", timeout=60)
        ports = sorted({e["port"] for e in farm.named("worker_launching") if "port" in e})
        with load([f"http://127.0.0.1:{p}" for p in ports]):
            good = cfg.read_text()
            n = len(farm.snapshot())
            changed = rewritten(
                good,
                sglang={"model_path": MODEL, "enable_metrics": True, "max_running_requests": 64},
            )
            cfg.write_text(changed)
            # farmctl reload waits for the promotion, then for every wave: exit 0.
            out = farm.farmctl("reload", timeout=120)
            assert out.returncode == 0, out.stdout + out.stderr
            assert "rollout done" in out.stdout, out.stdout
            verdict = farm.wait_for(
                lambda e: (
                    e.get("event") in ("canary_rolled_back", "canary_promoted", "canary_held")
                ),
                after=n,
                timeout=60,
            )
            assert verdict["event"] == "canary_promoted", verdict
            farm.wait_for(lambda e: e.get("event") == "rolling_restart_done", after=n, timeout=60)
        launching = [e for e in farm.snapshot()[n:] if e.get("event") == "worker_launching"]
        assert sorted(e["worker"] for e in launching) == [0, 1, 2]
        assert launching[0]["worker"] == 0
        assert all("--max-running-requests" in e["argv"] for e in launching)
    finally:
        assert farm.stop() == 0


def test_a_canary_that_dies_of_a_cuda_oom_is_rolled_back_naming_the_oom(short_tmp: Path) -> None:
    """Issue 31 item 3: `SGLANG_SIM_FAIL_AFTER` (a CUDA OOM in the simulator's log, then
    its exit) gave `canary crashed 6 s into the window: the canary left serving
    (stopping)`, and `farmctl why 0` ended with `no failure recorded`."""
    marker = new_marker()
    env = {
        "SGLANG_SIM_LOAD_SECONDS": "0.5",
        "SGLANG_SIM_HEALTH_DELAY": "0.05",
        "SGLANG_SIM_WARMUP_SECONDS": "0.1",
        "SGLANG_FARM_TEST_MARKER": marker,
    }
    cfg = farm_config(
        short_tmp,
        workers=2,
        parallel=1,
        load_seconds=0.5,
        marker=marker,
        rollout={"analysis_window": "60s", "min_requests": 20},
        health={"period": "1s", "timeout": "5s", "failure_threshold": 5},
    )
    farm = Farm(cfg, marker)
    try:
        farm.wait_for(lambda e: e.get("event") == "rollout_done", timeout=60)
        good = cfg.read_text()
        cfg.write_text(rewritten(good, farm={"env": {**env, "SGLANG_SIM_FAIL_AFTER": "2"}}))
        n = len(farm.snapshot())
        out = farm.farmctl("reload", timeout=120)
        assert out.returncode == 5, out.stdout + out.stderr
        verdict = [ln for ln in out.stdout.splitlines() if ln.startswith("canary 0: rolled back")]
        assert verdict, out.stdout
        assert " into the window: CUDA out of memory" in verdict[0], verdict[0]
        assert "[cuda_oom_" in verdict[0] and "left serving" not in verdict[0], verdict[0]
        back = farm.wait_for(lambda e: e.get("event") == "canary_rolled_back", after=n)
        farm.wait_for(
            lambda e: e.get("event") == "worker_ready" and e.get("worker") == 0,
            after=farm.snapshot().index(back),
            timeout=30,
        )
        why = farm.farmctl("why", "0")
        assert why.returncode == 0, why.stdout + why.stderr
        assert "no failure recorded" not in why.stdout, why.stdout
        assert "CUDA out of memory" in why.stdout and "[cuda_oom_" in why.stdout, why.stdout
    finally:
        assert farm.stop() == 0
