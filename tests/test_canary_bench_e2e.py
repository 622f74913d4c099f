"""End to end (issue 23, "Measure it"): the reduced canary matrix of `python -m bench
canary-matrix --reduced` on a small farm of simulators behind the real smg, under 16
streaming clients: the harmless change is promoted with no failed request, the 5x
slower one and the crashing one are rolled back, and only the canary ever ran them."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import pytest

# Imported by name: bench/ reaches tests/farmproc.py as `tests.farmproc`, which mypy, run
# over tests/*.py, would meet a second time as `farmproc`.
canary_matrix: Any = importlib.import_module("bench.canary_matrix")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("smg") is None,
        reason="smg (SGLang's gateway) is not installed: pip install smg==1.13.0",
    ),
]


def test_the_reduced_matrix_promotes_harmless_and_rolls_back_slow_and_crash_on_the_canary() -> None:
    # 4 workers and an 8 s window keep it short. A canary 5x slower gets few requests
    # from smg's routing (14 in 8 s in one run), so min_requests is lowered; the crash
    # comes 5 s after the canary fired up (its eval and gateway join take about 4 s),
    # inside the window.
    res = canary_matrix.run(
        print, reduced=True, repeat=1, window="8s", workers=4, crash_after_s=5, min_requests=10
    )
    trials = {t["change"]: t for t in res["trials"]}
    assert set(trials) == {"harmless-env", "itl-5x", "crash-5s"}, res["trials"]
    assert all("error" not in t for t in trials.values()), res["trials"]
    harmless, slow, crash = trials["harmless-env"], trials["itl-5x"], trials["crash-5s"]
    assert harmless["verdict"] == "promoted" and harmless["exit"] == 0, harmless
    assert harmless["failed"] == 0 and harmless["requests"] > 0, harmless
    assert harmless["ran_change"] == [0, 1, 2, 3], harmless
    for bad, check in ((slow, "itl"), (crash, "liveness")):
        assert bad["verdict"] == "rolled back" and bad["exit"] == 5, bad
        assert bad["caught_by"] == check, bad
        assert bad["ran_change"] == [0], bad  # the canary alone ever ran it
    assert res["goals"] == [], res["goals"]
    assert "Goals missed: none." in canary_matrix.table(res)


def test_under_one_shared_prompt_the_paired_probes_judge_the_canary_like_with_like() -> None:
    """Issue 34 §1 in CI: every client sends the same prompt, so smg's cache-aware routing
    sends a freshly restarted canary nothing (measured: 0 requests in 60 s, every change
    held). With 2 paired probes the canary is judged on the probes' prompts beside a
    baseline worker's: the harmless change promoted, the 5x slower one and the crash
    still rolled back on the canary alone."""
    res = canary_matrix.run(
        print,
        reduced=True,
        repeat=1,
        window="8s",
        workers=4,
        crash_after_s=5,
        min_requests=10,
        prompts="same",
        probes=2,
    )
    trials = {t["change"]: t for t in res["trials"]}
    assert set(trials) == {"harmless-env", "itl-5x", "crash-5s"}, res["trials"]
    assert all("error" not in t for t in trials.values()), res["trials"]
    harmless, slow, crash = trials["harmless-env"], trials["itl-5x"], trials["crash-5s"]
    assert harmless["verdict"] == "promoted" and harmless["exit"] == 0, harmless
    assert harmless["ran_change"] == [0, 1, 2, 3], harmless
    for bad, check in ((slow, "itl"), (crash, "liveness")):
        assert bad["verdict"] == "rolled back" and bad["exit"] == 5, bad
        assert bad["caught_by"] == check, bad
        assert bad["ran_change"] == [0], bad
