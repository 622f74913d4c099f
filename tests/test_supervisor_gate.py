"""Pure: the supervisor's gate on a rolling restart (issue 23): the canary's verdict
releases it (`release_gate`: the next waves go) or drops it (`drop_gated`: the waves are
never issued); the decision stays in the supervisor, the canary driver only calls it."""

from __future__ import annotations

from sglang_farm.sglang.failures import RestartReason
from sglang_farm.spec import HealthPolicy, RestartPolicy, StartupPolicy
from sglang_farm.workers.phase import Phase
from sglang_farm.workers.supervisor import (
    Action,
    HealthPassed,
    Launch,
    Launched,
    Policy,
    ProcessExited,
    Supervisor,
)


def _gated_farm() -> tuple[Supervisor, list[Action]]:
    """4 ready workers; a gated rolling restart whose canary (0) is ready on the change."""
    p = Policy(
        StartupPolicy(canary=0, parallel=2, load_timeout=100.0),
        HealthPolicy(period=1.0, timeout=1.0, failure_threshold=3),
        RestartPolicy(backoff_initial=1.0, backoff_max=8.0, reset_after=50.0, max_failures=3),
    )
    sup = Supervisor(range(4), p)
    sup.start(list(range(4)), 0.0)
    for w in range(4):
        sup.handle(w, Launched(pid=1000 + w), 1.0)
        sup.handle(w, HealthPassed(), 1.0)
    sup.restart_rolling([0, 1, 2, 3], RestartReason.CONFIG, 10.0, gated=True)
    sup.handle(0, ProcessExited(status=-15), 11.0)
    sup.handle(0, Launched(pid=2000), 11.0)
    actions = sup.handle(0, HealthPassed(), 12.0)
    actions += sup.tick(10_000.0)
    return sup, actions


def test_release_gate_issues_the_next_wave() -> None:
    sup, actions = _gated_farm()
    assert sup.gated() and not [a for a in actions if isinstance(a, Launch)]
    actions = sup.release_gate(10_001.0)
    assert not sup.gated()
    assert any(getattr(a, "event", None) == "rolling_restart_wave" for a in actions)
    assert {w for w in (1, 2, 3) if sup.workers[w].phase is not Phase.READY} == {1, 2}


def test_drop_gated_never_issues_the_waves_and_keeps_other_restarts() -> None:
    sup, _ = _gated_farm()
    sup.drop_gated()
    assert not sup.gated() and sup.rolling == ()
    actions = sup.tick(10_001.0)
    assert not any(getattr(a, "event", None) == "rolling_restart_wave" for a in actions)
    assert all(sup.workers[w].phase is Phase.READY for w in (1, 2, 3))
    sup, _ = _gated_farm()
    sup.restart_rolling([1, 2, 3], RestartReason.MANUAL, 10_000.0)  # an operator's
    sup.drop_gated()
    assert [r.gated for r in sup.rolling] == [False]
