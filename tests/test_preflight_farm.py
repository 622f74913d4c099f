"""End to end (issue 31 item 1): the farm's own running workers are no port conflict.

With the farm running, every `farmctl reload` logged one error-level `preflight_failed`
per worker (`HTTP port N on 127.0.0.1: cannot bind: Address already in use`) and applied
anyway, and `sglang-farm doctor` said `N failed ... NOT OK` and exited 1. A port held
by the worker that owns it passes; one held by another user still fails
(test_preflight.py::test_a_port_its_own_running_worker_holds_passes_and_anyone_elses_fails).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from farmproc import ROOT, SGLANG_FARM, Farm, farm_config, new_marker

pytestmark = pytest.mark.slow


def test_a_reload_and_the_doctor_on_a_running_farm_report_no_port_conflict(short_tmp: Path) -> None:
    marker = new_marker()
    cfg = farm_config(short_tmp, workers=2, parallel=2, load_seconds=0.3, marker=marker)
    farm = Farm(cfg, marker)
    try:
        farm.wait_for(lambda e: e.get("event") == "rollout_done", timeout=60)
        ports = sorted({e["port"] for e in farm.named("worker_launching") if "port" in e})
        assert len(ports) == 2
        n = len(farm.snapshot())
        out = farm.farmctl("reload", timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        done = farm.wait_for(lambda e: e.get("event") == "preflight_done", after=n)
        later = farm.snapshot()[n:]
        failed = [e for e in later if e.get("event") == "preflight_failed"]
        assert failed == [] and done.get("fail", 0) == 0, failed or done
        doctor = subprocess.run(
            [*SGLANG_FARM, "doctor", "--config", str(cfg)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
        text = doctor.stdout + doctor.stderr
        for wid, port in enumerate(ports):
            assert f"HTTP port {port} is worker {wid}'s own (it runs)" in text, text
        assert "cannot bind" not in text, text
        assert doctor.returncode == 0, text
    finally:
        assert farm.stop() == 0
