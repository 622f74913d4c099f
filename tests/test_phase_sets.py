"""The phase sets the rules are written in (workers/phase_sets): what each one holds."""

from __future__ import annotations

from sglang_farm.workers.phase import Phase, StopIntent
from sglang_farm.workers.phase_sets import (
    HELD,
    RUNNING,
    SERVING,
    SERVING_OR_DRAINING,
    set_aside,
)


def test_the_two_serving_sets_differ_by_the_draining_worker_alone() -> None:
    assert {Phase.READY, Phase.UNHEALTHY} == SERVING  # in the gateway, probed, drained
    assert {Phase.DRAINING} == SERVING_OR_DRAINING - SERVING  # still answers HTTP
    assert SERVING < RUNNING


def test_a_held_worker_runs_nothing() -> None:
    assert not HELD & (RUNNING | SERVING_OR_DRAINING)


def test_set_aside_is_quarantined_or_stopping_to_be() -> None:
    assert set_aside(Phase.QUARANTINED, None)
    assert set_aside(Phase.DRAINING, StopIntent.QUARANTINE)
    assert set_aside(Phase.STOPPING, StopIntent.QUARANTINE)
    assert not set_aside(Phase.STOPPING, StopIntent.STOP)
    assert not set_aside(Phase.READY, None)
