"""The supervisor's rules that mutation testing found unheld (issue 27), each a test that
fails when the rule is broken: docs/testing.md names the mutant each one kills."""

from __future__ import annotations

from collections.abc import Sequence

from sglang_farm.failures import RestartReason
from sglang_farm.phase import Phase
from sglang_farm.spec import HealthPolicy, RestartPolicy, StartupPolicy
from sglang_farm.supervisor import (
    Action,
    GpuFailing,
    HealthPassed,
    Launch,
    Launched,
    Note,
    Policy,
    ProcessExited,
    RestartRequested,
    StartRequested,
    Supervisor,
    Terminate,
    WorkerState,
    plan_waves,
    step,
)


def policy(canary: int | None = None, parallel: int = 2) -> Policy:
    return Policy(
        StartupPolicy(canary=canary, parallel=parallel, load_timeout=100.0),
        HealthPolicy(period=1.0, timeout=1.0, failure_threshold=3),
        RestartPolicy(backoff_initial=1.0, backoff_max=8.0, reset_after=50.0, max_failures=3),
    )


def launches(actions: Sequence[Action]) -> list[int]:
    return [a.worker for a in actions if isinstance(a, Launch)]


def serving_farm(n: int, pol: Policy) -> Supervisor:
    """`n` workers, all READY."""
    sup = Supervisor(range(n), pol)
    sup.start(list(range(n)), 0.0)
    for t in range(n):  # each launch is answered, whatever order the planner chose
        for w, s in sup.workers.items():
            if s.phase is Phase.STARTING and s.pid is None:
                sup.handle(w, Launched(pid=100 + w), float(t))
                sup.handle(w, HealthPassed(), float(t))
    assert all(s.phase is Phase.READY for s in sup.workers.values())
    return sup


def quarantine(sup: Supervisor, wid: int, now: float) -> None:
    """Worker `wid`'s GPU fails: it is stopped and set aside."""
    actions = sup.handle(wid, GpuFailing(wid, "xid 79", "fell off the bus"), now)
    assert [a.worker for a in actions if isinstance(a, Terminate)] == [wid]
    sup.handle(wid, ProcessExited(status=-15), now)
    assert sup.workers[wid].phase is Phase.QUARANTINED


# ---- finding 1: a restart never relaunches a quarantined worker -------------------------


def test_a_restart_request_leaves_a_quarantined_worker_set_aside() -> None:
    """`farmctl restart N` on a quarantined worker: no launch on its failing GPU."""
    s = WorkerState(3, Phase.QUARANTINED)
    for event in (RestartRequested(RestartReason.MANUAL), StartRequested()):
        d = step(s, event, 5.0, policy())
        assert d.state.phase is Phase.QUARANTINED
        assert d.actions == (Note("worker_quarantined_not_started"),)


def test_restart_all_and_a_reload_roll_past_a_quarantined_worker() -> None:
    """`restart all` (a rolling restart over every worker, as a reload's is): the quarantined
    worker's wave passes it by; it is never launched, and the others are restarted."""
    sup = serving_farm(3, policy(parallel=1))
    quarantine(sup, 1, 10.0)
    launched: list[int] = []
    launched += launches(sup.restart_rolling([0, 1, 2], RestartReason.MANUAL, 20.0))
    t = 21.0
    for _ in range(10):  # each restarted worker exits, relaunches and serves again
        for w, s in sup.workers.items():
            if s.phase is Phase.STOPPING:
                launched += launches(sup.handle(w, ProcessExited(status=0), t))
            elif s.phase is Phase.STARTING:
                sup.handle(w, Launched(pid=200 + w), t)
                launched += launches(sup.handle(w, HealthPassed(), t))
        launched += launches(sup.tick(t))  # the agent's ticker runs after every action
        t += 1.0
    assert sup.rolling == ()
    assert sup.workers[1].phase is Phase.QUARANTINED
    assert 1 not in launched
    assert sorted(launched) == [0, 2]


def test_starting_a_quarantined_worker_by_name_starts_nothing() -> None:
    """`farmctl start N` after the rollout: still set aside, no launch."""
    sup = serving_farm(2, policy())
    quarantine(sup, 0, 10.0)
    assert launches(sup.start([0], 11.0)) == []
    assert sup.workers[0].phase is Phase.QUARANTINED


# ---- finding 2: a rolling restart without a canary keeps one worker serving -------------


def test_waves_without_a_canary_never_take_every_worker_at_once() -> None:
    assert plan_waves([1, 2, 3], None, 3) == ((1, 2), (3,))
    assert plan_waves([1, 2, 3], None, 8) == ((1, 2), (3,))
    # A canary that is not among the named workers is no canary for them.
    assert plan_waves([1, 2, 3], 0, 3) == ((1, 2), (3,))
    assert plan_waves([4, 5], None, 2) == ((4,), (5,))


def test_waves_with_a_canary_take_it_alone_then_parallel() -> None:
    assert plan_waves([1, 2, 3], 2, 3) == ((2,), (1, 3))
    assert plan_waves([0, 1, 2, 3, 4], 0, 2) == ((0,), (1, 2), (3, 4))
    # One worker alone: it is its own wave, canary or not.
    assert plan_waves([2], 2, 4) == ((2,),)
    assert plan_waves([2], None, 4) == ((2,),)
    # parallel 0 is read as 1: a wave is never empty.
    assert plan_waves([1, 2], None, 0) == ((1,), (2,))
    assert plan_waves([0, 1, 2], 0, 0) == ((0,), (1,), (2,))


def test_a_restart_of_all_workers_without_a_canary_keeps_one_serving() -> None:
    sup = serving_farm(3, policy(canary=None, parallel=3))
    actions = sup.restart_rolling([0, 1, 2], RestartReason.MANUAL, 10.0)
    stopped = [a.worker for a in actions if isinstance(a, Terminate)]
    assert stopped == [0, 1]
    assert sup.workers[2].phase is Phase.READY
