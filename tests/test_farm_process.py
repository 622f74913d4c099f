"""End to end with real processes: the agent, the process runtime and simulator workers."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from farmproc import Farm, farm_config, marked_pids, new_marker
from farmtoml import rewritten

pytestmark = pytest.mark.slow


def _intervals(farm: Farm) -> dict[int, list[tuple[float, float]]]:
    """Per worker, (launching, ready-or-exit) intervals from the agent's own log."""
    out: dict[int, list[tuple[float, float]]] = {}
    open_: dict[int, float] = {}
    for ev in farm.snapshot():
        w = ev.get("worker")
        if not isinstance(w, int):
            continue
        if ev["event"] == "worker_launching":
            open_[w] = ev["_t"]
        elif ev["event"] in ("worker_ready", "worker_exited") and w in open_:
            out.setdefault(w, []).append((open_.pop(w), ev["_t"]))
    return out


def test_demo_farm_comes_up_canary_first_in_waves_and_shutdown_leaves_nothing(
    short_tmp: Path,
) -> None:
    marker = new_marker()
    farm = Farm(
        farm_config(short_tmp, workers=8, parallel=4, load_seconds=1.0, marker=marker), marker
    )
    try:
        farm.wait_for(lambda e: e.get("event") == "rollout_done", timeout=90)
        # Every worker's ready line, however the log's lines interleave on a busy machine.
        end = time.monotonic() + 30
        while len({e["worker"] for e in farm.named("worker_ready")}) < 8 and time.monotonic() < end:
            time.sleep(0.2)
        ready = {e["worker"]: e["_t"] for e in farm.named("worker_ready")}
        launching = {e["worker"]: e["_t"] for e in farm.named("worker_launching")}
        assert sorted(ready) == list(range(8))
        # The canary was ready before any other worker was launched.
        assert all(launching[w] > ready[0] for w in range(1, 8))
        # Never more than `parallel` loading at once.
        spans = [s for w, ss in _intervals(farm).items() for s in ss]
        for t, _ in spans:
            loading = sum(1 for a, b in spans if a <= t < b)
            assert loading <= 4, f"{loading} workers loading at once"
        # farmctl sees it too.
        out = farm.farmctl("--json", "status")
        assert out.returncode == 0, out.stderr
        assert out.stdout.count('"ready"') >= 8
        # Each simulator has a scheduler child: two processes per worker.
        assert len(marked_pids(marker)) >= 16
    finally:
        code = farm.stop(signal.SIGINT)
    assert code == 0
    deadline = time.monotonic() + 10
    while marked_pids(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marked_pids(marker) == []


def test_worker_killed_with_sigkill_comes_back_with_reason_crash(short_tmp: Path) -> None:
    marker = new_marker()
    farm = Farm(
        farm_config(short_tmp, workers=3, parallel=2, load_seconds=0.5, marker=marker), marker
    )
    try:
        farm.wait_for(lambda e: e.get("event") == "rollout_done", timeout=60)
        pid = farm.named("worker_launched", worker=2)[-1]["pid"]
        n = len(farm.snapshot())
        os.kill(pid, signal.SIGKILL)
        exited = farm.wait_for(
            lambda e: e.get("event") == "worker_exited" and e.get("worker") == 2,
            after=n,
            timeout=20,
        )
        assert exited["status"] == -9
        farm.wait_for(
            lambda e: (
                e.get("event") == "worker_restarting"
                and e.get("worker") == 2
                and e.get("reason") == "crash"
            ),
            after=n,
            timeout=20,
        )
        again = farm.wait_for(
            lambda e: e.get("event") == "worker_ready" and e.get("worker") == 2, after=n, timeout=30
        )
        assert again["_t"] > exited["_t"]
        new_pid = farm.named("worker_launched", worker=2)[-1]["pid"]
        assert new_pid != pid
        # The other workers were not touched.
        assert len(farm.named("worker_launched", worker=1)) == 1
    finally:
        assert farm.stop() == 0


def test_canary_cuda_oom_halts_rollout_and_names_the_reason(short_tmp: Path) -> None:
    marker = new_marker()
    cfg = farm_config(
        short_tmp,
        workers=4,
        load_seconds=0.3,
        marker=marker,
        worker_env={0: {"SGLANG_SIM_FAIL": "cuda_oom"}},
    )
    farm = Farm(cfg, marker)
    try:
        halted = farm.wait_for(lambda e: e.get("event") == "rollout_halted", timeout=60)
        assert "CUDA out of memory" in halted["why"] or "out of memory" in halted["why"].lower()
        failed = farm.named("worker_failed", worker=0)
        assert failed and failed[-1]["kind"] == "cuda_oom_load"
        time.sleep(1.0)
        assert [e for e in farm.named("worker_launching") if e["worker"] != 0] == []
        why = farm.farmctl("why", "0")
        assert "cuda_oom" in why.stdout.lower() or "out of memory" in why.stdout.lower(), why
    finally:
        assert farm.stop() == 0
    assert marked_pids(marker) == []


def test_sigstopped_worker_is_restarted_with_reason_hang(short_tmp: Path) -> None:
    marker = new_marker()
    # period 0.5 s x threshold 3: restart issued within 1.5 s + one period of the last answer.
    farm = Farm(
        farm_config(short_tmp, workers=2, parallel=2, load_seconds=0.3, marker=marker), marker
    )
    try:
        farm.wait_for(lambda e: e.get("event") == "rollout_done", timeout=60)
        pid = farm.named("worker_launched", worker=1)[-1]["pid"]
        n = len(farm.snapshot())
        t0 = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        term = farm.wait_for(
            lambda e: e.get("event") == "worker_terminating" and e.get("worker") == 1,
            after=n,
            timeout=30,
        )
        assert term["kind"] == "hang"
        print(f"hang detected {term['_t'] - t0:.2f} s after SIGSTOP (bound 2.0 s + scheduling)")
        farm.wait_for(
            lambda e: (
                e.get("event") == "worker_restarting"
                and e.get("worker") == 1
                and e.get("reason") == "hang"
            ),
            after=n,
            timeout=30,
        )
        farm.wait_for(
            lambda e: e.get("event") == "worker_ready" and e.get("worker") == 1, after=n, timeout=30
        )
        assert len(farm.named("worker_launched", worker=0)) == 1
    finally:
        assert farm.stop() == 0
    assert marked_pids(marker) == []


def test_farmctl_restart_waits_and_reload_applies_only_valid_changes(short_tmp: Path) -> None:
    marker = new_marker()
    cfg = farm_config(short_tmp, workers=3, parallel=2, load_seconds=0.5, marker=marker)
    farm = Farm(cfg, marker)
    try:
        farm.wait_for(lambda e: e.get("event") == "rollout_done", timeout=60)
        # restart waits until the worker is ready again, and touches no other worker.
        out = farm.farmctl("restart", "1", "--timeout", "60")
        assert out.returncode == 0, out.stdout + out.stderr
        assert len(farm.named("worker_ready", worker=1)) == 2
        assert len(farm.named("worker_launched", worker=0)) == 1
        assert len(farm.named("worker_launched", worker=2)) == 1
        status = json.loads(farm.farmctl("--json", "status").stdout)
        phases = {w["id"]: w["state"] for w in status["workers"]}
        assert phases == {0: "ready", 1: "ready", 2: "ready"}
        # Queue depth comes from each worker's own metrics (polled every second here).
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            workers = json.loads(farm.farmctl("--json", "status").stdout)["workers"]
            if all("queue_depth" in w for w in workers):
                break
            time.sleep(0.5)
        assert [w.get("queue_depth") for w in workers] == [0.0, 0.0, 0.0], workers
        table = farm.farmctl("status").stdout
        assert "QUEUE" in table.splitlines()[2], table

        # A broken config is rejected with its problems; the old one keeps running.
        good = cfg.read_text()
        cfg.write_text(rewritten(good, startup={"paralel": 3}))
        bad = farm.farmctl("reload")
        assert bad.returncode == 1
        assert "paralel" in bad.stdout + bad.stderr
        assert farm.named("reload_applied") == []

        # A valid change to one worker restarts that worker only.
        n = len(farm.snapshot())
        cfg.write_text(
            rewritten(good, workers={"overrides": {"2": {"sglang": {"max_running_requests": 7}}}})
        )
        ok = farm.farmctl("--json", "reload", "--no-wait")
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert json.loads(ok.stdout)["restarted"] == [2]
        ready2 = farm.wait_for(
            lambda e: e.get("event") == "worker_ready" and e.get("worker") == 2, after=n, timeout=30
        )
        launch = [e for e in farm.snapshot()[n:] if e.get("event") == "worker_launching"]
        assert [e["worker"] for e in launch] == [2]
        assert "--max-running-requests" in launch[0]["argv"]
        assert ready2["_t"] > 0
    finally:
        assert farm.stop() == 0
