"""The canary statistics bench (issue 23 #1): its rank test is a rank test, and in its
world the farm's default policy rolls back no harmless change and every 2x or 5x one."""

from __future__ import annotations

import importlib
import random
from typing import Any

from bench import canary_stats


def _matrix() -> Any:
    """bench.canary_matrix, imported by name: it reaches tests/farmproc.py as
    `tests.farmproc`, which mypy over tests/*.py would meet a second time as `farmproc`."""
    return importlib.import_module("bench.canary_matrix")


def test_mann_whitney_on_buckets_finds_a_shift_and_not_its_absence() -> None:
    same = [5.0, 20.0, 50.0, 20.0, 5.0]
    assert 0.4 < canary_stats.mwu_p(same, same) < 0.6
    slower = [0.0, 5.0, 20.0, 50.0, 25.0]
    assert canary_stats.mwu_p(slower, same) < 0.001
    assert canary_stats.mwu_p(same, slower) > 0.999
    assert canary_stats.mwu_p([0.0] * 5, same) == 1.0


def test_default_policy_never_rolls_back_harmless_and_always_catches_2x() -> None:
    by_name = {s.name: s for s in canary_stats.SCENARIOS}
    for n in (50, 200):
        for name, expected in [("harmless", 0.0), ("harmless, warm cache", 0.0), ("ITL 2x", 1.0)]:
            rates = canary_stats.cell(by_name[name], n, trials=20, seed=n)
            assert rates["ratio"] == expected, (n, name, rates)
    rng = random.Random(1)
    canary, base = canary_stats.trial(by_name["ITL 5x"], 50, rng)
    assert (canary.requests, base.requests) == (50, 350)


def test_the_matrix_reduced_is_harmless_itl_5x_and_crash() -> None:
    cm = _matrix()

    full = cm.changes(10)
    assert len(full) == 10 and sum(c.group == "harmless" for c in full) == 3
    assert [c.key for c in cm.select(full, reduced=True)] == ["harmless-env", "itl-5x", "crash-10s"]
    slow = next(c for c in full if c.key == "itl-5x")
    assert slow.env == {"SGLANG_SIM_TOKEN_SECONDS": "0.05"} and slow.bad


def test_caught_by_names_the_check_of_the_evidence() -> None:
    caught_by = _matrix().caught_by

    assert caught_by("canary crashed 1 s into the window: the canary left serving") == "liveness"
    assert caught_by("eval: canary 32/40 vs the baseline's 40/40") == "eval"
    assert caught_by("canary errors 10.2 % (12 of 118) vs the baseline's 0.0 %") == "errors"
    assert caught_by("canary ITL p50 0.05 s = 5.0x the baseline's 0.01 s") == "itl"
    assert caught_by("within limits") == ""


def _trial(**kw: object) -> dict[str, object]:
    t: dict[str, object] = {
        "label": "x", "group": "harmless", "bad": False, "repeat": 0, "verdict": "promoted",
        "evidence": "", "ran_change": [0, 1], "failed": 0, "requests": 10, "reasons": {},
    }  # fmt: skip
    t.update(kw)
    return t


def test_goals_name_every_miss_and_nothing_else() -> None:
    goals = _matrix().goals

    assert goals([_trial(), _trial(group="crash", bad=True, verdict="rolled back",
                                   ran_change=[0], failed=2)]) == []  # fmt: skip
    missed = goals(
        [
            _trial(verdict="rolled back", evidence="ITL"),
            _trial(group="latency", failed=3, reasons={"status 502": 3}),
            _trial(group="latency", bad=True, verdict="held", evidence="too little"),
            _trial(group="errors", bad=True, verdict="rolled back", ran_change=[0, 1]),
        ]
    )
    assert len(missed) == 4, missed
    assert "harmless change rolled back" in missed[0]
    assert "3 of 10 requests failed" in missed[1]
    assert "held, not rolled back" in missed[2]
    assert "workers [0, 1] ran the change" in missed[3]
