"""End to end (issue 31 item 4): `farmctl why` of a worker that failed, then served again.

`why 3` after `reset-oom 3`, `restart 3` and a manual stop still said `gave up after 6
failures in a row` from a run before, as if it ailed the worker now. A real farm, a
simulator worker that dies of a CUDA OOM at every start until the farm gives up; the fix
reloaded; the worker serves and is stopped: `why` says when the failure was and that the
worker has served since.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from farmproc import Farm, farm_config, new_marker
from farmtoml import rewritten

pytestmark = pytest.mark.slow


def test_why_of_a_worker_that_served_since_its_crash_loop_says_so(short_tmp: Path) -> None:
    marker = new_marker()
    env = {
        "SGLANG_SIM_LOAD_SECONDS": "0.3",
        "SGLANG_SIM_HEALTH_DELAY": "0.05",
        "SGLANG_SIM_WARMUP_SECONDS": "0.1",
        "SGLANG_FARM_TEST_MARKER": marker,
    }
    cfg = farm_config(
        short_tmp,
        workers=2,
        parallel=2,
        load_seconds=0.3,
        marker=marker,
        worker_env={1: {**env, "SGLANG_SIM_FAIL_AFTER": "0.3"}},
        restart={"backoff_initial": "0.2s", "backoff_max": "0.5s", "max_failures": 1},
    )
    farm = Farm(cfg, marker)
    try:
        farm.wait_for(lambda e: e.get("event") == "worker_gave_up" and e.get("worker") == 1, 60)
        before = farm.farmctl("why", "1")
        assert "what the farm did: gave up after 2 failures in a row" in before.stdout, (
            before.stdout
        )
        assert farm.farmctl("reset-oom", "1").returncode == 0
        cfg.write_text(rewritten(cfg.read_text(), workers={"overrides": {"1": {"env": env}}}))
        n = len(farm.snapshot())
        out = farm.farmctl("reload", timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        farm.wait_for(lambda e: e.get("event") == "worker_ready" and e.get("worker") == 1, after=n)
        stop = farm.farmctl("stop", "1")
        assert stop.returncode == 0, stop.stdout + stop.stderr
        why = farm.farmctl("why", "1")
        assert why.returncode == 0, why.stdout + why.stderr
        lines = why.stdout.splitlines()
        assert lines[0] == "worker 1: stopped", why.stdout
        last = next((ln for ln in lines if ln.startswith("last failure (")), "")
        assert " ago; worker 1 has served since): CUDA out of memory" in last, why.stdout
        assert "what the farm did then: gave up after 2 failures in a row" in why.stdout
        assert "what the farm did: " not in why.stdout
    finally:
        assert farm.stop() == 0
