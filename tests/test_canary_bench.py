"""The canary statistics bench (issue 23 #1): its rank test is a rank test, and in its
world the farm's default policy rolls back no harmless change and every 2x or 5x one."""

from __future__ import annotations

import random

from bench import canary_stats


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
