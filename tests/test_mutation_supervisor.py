"""The supervisor's rules that mutation testing found unheld (issue 27), each a test that
fails when the rule is broken: docs/testing.md names the mutant each one kills."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import pytest

from configtext import MINIMAL, load
from sglang_farm.sglang.failures import Failure, FailureKind, RestartReason
from sglang_farm.spec import HealthPolicy, RestartPolicy, StartupPolicy
from sglang_farm.workers.phase import Phase
from sglang_farm.workers.supervisor import (
    RESTART_HISTORY,
    Action,
    Drain,
    Drained,
    FailureSeen,
    GatewayMembership,
    GpuFailing,
    HealthFailed,
    HealthPassed,
    Launch,
    Launched,
    Note,
    Policy,
    ProcessExited,
    ProgressSeen,
    ReleaseRequested,
    RestartRequested,
    RollingRestart,
    StartRequested,
    StopIntent,
    StopRequested,
    Supervisor,
    Terminate,
    Tick,
    Wedged,
    WorkerState,
    launch,
    plan_waves,
    step,
    wants_in_gateway,
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
    assert plan_waves([1, 2], 2, 4) == ((2,), (1,))
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


# ---- the rest of the core's rules that mutation testing found unheld --------------------
# (each test names the rule; docs/testing.md's run shows which mutant each one kills)

GW = 30.0  # the drain budget of a farm with a gateway


def gw_policy(**startup: object) -> Policy:
    p = policy(**startup)  # type: ignore[arg-type]  # canary / parallel
    return Policy(p.startup, p.health, p.restart, drain_timeout=GW)


def ready(wid: int = 0, **changes: object) -> WorkerState:
    base = WorkerState(wid, Phase.READY, since=10.0, pid=7, launched_at=5.0, ready_since=10.0)
    return replace(base, ever_ready=True, **changes)  # type: ignore[arg-type]


def notes(actions: Sequence[Action]) -> list[str]:
    return [a.event for a in actions if isinstance(a, Note)]


def test_a_crash_says_how_the_process_ended() -> None:
    def summary(status: int | None) -> str:
        d = step(ready(), ProcessExited(status=status), 20.0, policy())
        assert d.state.last_failure is not None
        return d.state.last_failure.summary

    assert "exited killed by signal 9 and" in summary(-9)
    assert "exited with exit status 1 and" in summary(1)
    assert "exited with exit status 0 and" in summary(0)
    assert "exited with no exit status and" in summary(None)


def test_a_failed_probe_while_counters_advance_is_excused_as_busy() -> None:
    pol = policy()  # busy_window 30 s (the default)
    s = replace(ready(), progress_at=100.0)
    d = step(s, HealthFailed("timeout", started=99.0), 130.0, pol)  # exactly the window
    assert (d.state.phase, d.state.busy, d.state.health_failures) == (Phase.READY, True, 0)
    assert notes(d.actions) == ["worker_busy"]
    again = step(d.state, HealthFailed("timeout", started=99.0), 130.0, pol)
    assert again.actions == ()  # said once
    # Counters that advanced before the probe was sent, or too long ago, excuse nothing.
    for started, now in ((100.0, 101.0), (99.0, 130.5), (None, 101.0)):
        d = step(s, HealthFailed("timeout", started=started), now, pol)
        assert (d.state.phase, d.state.health_failures) == (Phase.UNHEALTHY, 1)
    # Not serving: nothing to excuse, nothing counted.
    loading = WorkerState(0, Phase.STARTING, progress_at=100.0)
    assert step(loading, HealthFailed("refused", started=99.0), 101.0, pol).state == loading
    # UNHEALTHY and busy: back to READY.
    sick = replace(s, phase=Phase.UNHEALTHY, health_failures=2)
    d = step(sick, HealthFailed("timeout", started=99.0), 101.0, pol)
    assert (d.state.phase, d.state.busy, d.state.health_failures) == (Phase.READY, True, 0)


def test_progress_is_recorded_only_while_serving() -> None:
    assert step(ready(), ProgressSeen(), 50.0, policy()).state.progress_at == 50.0
    loading = WorkerState(0, Phase.STARTING)
    assert step(loading, ProgressSeen(), 50.0, policy()).state.progress_at is None


def test_a_wedged_engine_is_stopped_only_while_serving() -> None:
    d = step(ready(busy=True), Wedged("no tokens for 120 s"), 50.0, policy())
    assert d.state.phase is Phase.STOPPING and not d.state.busy
    assert d.actions[0] == Terminate(0)
    loading = WorkerState(0, Phase.STARTING)
    assert step(loading, Wedged("x"), 50.0, policy()).state == loading


def test_load_deadline_is_past_the_timeout_not_at_it() -> None:
    s = WorkerState(0, Phase.STARTING, since=10.0, launched_at=10.0)
    assert step(s, Tick(), 110.0, policy()).state == s  # load_timeout 100: not yet
    d = step(s, Tick(), 110.5, policy())
    assert d.state.phase is Phase.STOPPING and d.actions[0] == Terminate(0)


def test_the_drain_budget_ends_a_drain_at_its_end() -> None:
    s = WorkerState(0, Phase.DRAINING, since=100.0, stop_intent=StopIntent.STOP)
    assert step(s, Tick(), 100.0 + GW - 0.5, gw_policy()).state == s
    d = step(s, Tick(), 100.0 + GW, gw_policy())
    assert d.state.phase is Phase.STOPPING
    assert d.state.last_drain_seconds == GW
    assert d.actions == (Terminate(0), Note("drain_budget_expired", {"drain_s": GW}))
    # No gateway, no budget: a Tick leaves a draining worker alone.
    assert step(s, Tick(), 1000.0, policy()).state == s


def test_a_drain_reports_its_time_to_the_millisecond() -> None:
    s = WorkerState(0, Phase.DRAINING, since=100.0, stop_intent=StopIntent.STOP)
    d = step(s, Drained(), 100.12345, gw_policy())
    assert d.actions == (Terminate(0), Note("worker_drained", {"drain_s": 0.123}))
    assert step(ready(), Drained(), 100.0, gw_policy()).state == ready()


def test_the_back_off_starts_over_after_reset_after_ready() -> None:
    s = ready(failures=2, ready_since=100.0)
    assert step(s, Tick(), 149.5, policy()).state.failures == 2  # reset_after 50
    d = step(s, Tick(), 150.0, policy())
    assert d.state.failures == 0 and notes(d.actions) == ["backoff_reset"]


def test_ready_records_the_load_time_and_that_it_was_ready() -> None:
    s = WorkerState(0, Phase.STARTING, since=10.0, launched_at=10.0)
    d = step(s, HealthPassed(), 15.0, policy())
    assert d.state.last_load_seconds == 5.0 and d.state.ever_ready


def test_an_oom_seen_in_the_log_stops_only_a_worker_that_served() -> None:
    oom = Failure(FailureKind.CUDA_OOM_SERVING, "CUDA out of memory", "x")
    d = step(ready(), FailureSeen(oom), 50.0, policy())
    assert d.state.phase is Phase.STOPPING and d.state.pending_failure == oom
    loading = WorkerState(0, Phase.STARTING, launched_at=1.0)
    d = step(loading, FailureSeen(oom), 50.0, policy())
    assert d.state.phase is Phase.STARTING and d.state.last_failure == oom
    other = Failure(FailureKind.FATAL_TRACEBACK, "Traceback", "x")
    d = step(ready(), FailureSeen(other), 50.0, policy())
    assert d.state.phase is Phase.READY and d.state.last_failure == other
    stopped = WorkerState(0, Phase.STOPPED)
    assert step(stopped, FailureSeen(other), 50.0, policy()).state == stopped


def test_a_planned_stop_drains_unless_told_not_to() -> None:
    for event, intent in (
        (StopRequested(), StopIntent.STOP),
        (RestartRequested(RestartReason.MANUAL), StopIntent.RESTART),
    ):
        d = step(ready(), event, 50.0, gw_policy())
        assert d.state.phase is Phase.DRAINING and d.state.stop_intent is intent
        assert d.actions[0] == Drain(0)
        # Already draining: a second request waits for the drain, or skips it.
        again = step(d.state, event, 51.0, gw_policy())
        assert again.state.phase is Phase.DRAINING and again.actions == ()
        skip = replace(event, drain=False)
        d2 = step(d.state, skip, 51.0, gw_policy())
        assert d2.state.phase is Phase.STOPPING
        assert d2.actions == (Terminate(0), Note("drain_skipped", {"drain_s": 1.0}))
        # drain=False from READY: straight to STOPPING.
        d3 = step(ready(), skip, 50.0, gw_policy())
        assert d3.state.phase is Phase.STOPPING and d3.actions == (Terminate(0),)


def test_a_drain_keeps_the_restart_reason_it_had() -> None:
    s = ready(next_reason=RestartReason.OOM)
    d = step(s, StopRequested(), 50.0, gw_policy())
    assert d.state.next_reason is RestartReason.OOM


def test_release_starts_only_a_quarantined_worker_afresh() -> None:
    q = WorkerState(0, Phase.QUARANTINED, failures=3)
    d = step(q, ReleaseRequested(), 50.0, policy())
    assert (d.state.phase, d.state.failures) == (Phase.PENDING, 0)
    assert step(ready(), ReleaseRequested(), 50.0, policy()).state == ready()


def test_a_gpu_failing_while_stopping_changes_only_the_intent() -> None:
    s = replace(ready(), phase=Phase.STOPPING, stop_intent=StopIntent.RESTART)
    d = step(s, GpuFailing(0, "xid 79", "d"), 50.0, policy())
    assert d.state.phase is Phase.STOPPING
    assert d.state.stop_intent is StopIntent.QUARANTINE
    assert not [a for a in d.actions if isinstance(a, Terminate)]
    # Set aside already (stopping for it): the first reason stands.
    again = step(d.state, GpuFailing(0, "gpu lost", "e"), 51.0, policy())
    assert again.state == d.state and again.actions == ()


def test_an_operator_start_cuts_a_back_off_short() -> None:
    s = WorkerState(0, Phase.BACKOFF, retry_at=100.0, failures=2)
    d = step(s, StartRequested(), 50.0, policy())
    assert (d.state.phase, d.state.retry_at, d.state.failures) == (Phase.PENDING, None, 2)


def test_a_launch_starts_clean_and_keeps_the_last_restarts() -> None:
    history = tuple((float(i), "crash") for i in range(RESTART_HISTORY))
    s = WorkerState(
        0,
        Phase.PENDING,
        health_failures=2,
        busy=True,
        next_reason=RestartReason.HANG,
        restarts=history,
    )
    d = launch(s, 99.0)
    assert (d.state.health_failures, d.state.busy) == (0, False)
    assert len(d.state.restarts) == RESTART_HISTORY == 20
    assert d.state.restarts[0] == (1.0, "crash") and d.state.restarts[-1] == (99.0, "hang")
    assert d.actions == (Note("worker_restarting", {"reason": "hang"}), Launch(0))


def test_a_failure_clears_the_probe_count() -> None:
    s = replace(ready(), health_failures=2)
    d = step(s, ProcessExited(status=1), 50.0, policy())
    assert d.state.health_failures == 0 and d.state.phase is Phase.BACKOFF


def test_only_the_canary_halts_on_a_failure_before_ready() -> None:
    loading = WorkerState(3, Phase.STARTING, launched_at=1.0)
    assert step(loading, ProcessExited(status=1), 5.0, policy()).state.phase is Phase.BACKOFF
    canary = replace(loading, halt_on_failure=True)
    assert step(canary, ProcessExited(status=1), 5.0, policy()).state.phase is Phase.FAILED


def test_the_gateway_routes_only_to_ready_workers() -> None:
    assert wants_in_gateway(ready())
    for phase in Phase:
        if phase is not Phase.READY:
            assert not wants_in_gateway(replace(ready(), phase=phase))


# ---- the farm: deadlines, rolling restarts, reloads, OOM spread, adoption ---------------


def test_next_deadline_is_the_earliest_time_rule() -> None:
    pol = Policy(
        StartupPolicy(canary=None, parallel=1, load_timeout=100.0),
        HealthPolicy(period=1.0, timeout=1.0, failure_threshold=3),
        RestartPolicy(backoff_initial=1.0, backoff_max=8.0, stop_timeout=7.0),
        drain_timeout=GW,
    )
    sup = Supervisor(range(4), pol)
    assert sup.next_deadline(0.0) is None
    sup.workers[0] = WorkerState(0, Phase.BACKOFF, retry_at=500.0)
    sup.workers[1] = WorkerState(1, Phase.STARTING, launched_at=450.0)
    sup.workers[2] = WorkerState(2, Phase.DRAINING, since=480.0)
    sup.workers[3] = WorkerState(3, Phase.BACKOFF)  # no retry time: no deadline
    assert sup.next_deadline(0.0) == 500.0
    sup.workers[0] = WorkerState(0, Phase.STOPPED, retry_at=100.0)  # not backing off
    assert sup.next_deadline(0.0) == 510.0  # 480 + the drain budget
    sup.workers[2] = WorkerState(2, Phase.READY, since=100.0)
    # Just past 450 + load_timeout: the tick stops it past the timeout, not at it.
    assert sup.next_deadline(0.0) == math.nextafter(550.0, math.inf)
    sup.workers[1] = WorkerState(1, Phase.READY, launched_at=10.0)
    assert sup.next_deadline(0.0) is None
    # READY with failures counted: its back-off resets reset_after (600 s) after ready.
    sup.workers[1] = WorkerState(1, Phase.READY, failures=2, ready_since=300.0)
    assert sup.next_deadline(0.0) == 300.0 + 600.0
    sup.workers[1] = WorkerState(1, Phase.UNHEALTHY, failures=2, ready_since=300.0)
    assert sup.next_deadline(0.0) is None  # not READY: the reset waits
    sup.workers[1] = WorkerState(1, Phase.READY, ready_since=300.0)  # nothing to reset
    assert sup.next_deadline(0.0) is None
    # A rolling wave in flight: it times out after load + stop + drain.
    sup.rolling = (RollingRestart(RestartReason.MANUAL, (), wave=(1,), wave_started=1000.0),)
    assert sup.next_deadline(0.0) == 1000.0 + 100.0 + 7.0 + GW
    sup.policy = replace(pol, drain_timeout=None)
    assert sup.next_deadline(0.0) == 1000.0 + 100.0 + 7.0


def test_a_wave_that_does_not_settle_is_given_up_at_its_timeout() -> None:
    sup = serving_farm(3, policy(parallel=1))  # wave timeout: 100 s load (+ 0 stop)
    timeout = sup.policy.startup.load_timeout + sup.policy.restart.stop_timeout
    sup.restart_rolling([0, 1, 2], RestartReason.MANUAL, 10.0)
    assert sup.rolling[0].wave == (0,)
    # Worker 0 never comes back: the next wave waits for the timeout, then goes.
    sup.tick(10.0 + timeout - 0.5)
    assert sup.rolling[0].wave == (0,)
    actions = sup.tick(10.0 + timeout)
    assert Note("rolling_restart_wave", {"workers": [1]}) in actions
    assert sup.rolling[0].wave == (1,)


def test_a_wave_waits_for_every_worker_in_it() -> None:
    sup = serving_farm(4, policy(parallel=2))
    sup.restart_rolling([0, 1, 2, 3], RestartReason.MANUAL, 10.0)
    assert sup.rolling[0].wave == (0, 1)
    sup.handle(0, ProcessExited(status=0), 11.0)
    sup.handle(1, ProcessExited(status=0), 11.0)
    sup.handle(0, Launched(pid=300), 11.0)
    sup.handle(0, HealthPassed(), 12.0)  # worker 1 still loading
    sup.tick(12.0)
    assert sup.rolling[0].wave == (0, 1)
    sup.handle(1, Launched(pid=301), 12.0)
    actions = sup.handle(1, HealthPassed(), 13.0)
    assert Note("rolling_restart_wave", {"workers": [2, 3]}) in actions


def test_with_a_gateway_a_wave_settles_only_when_back_in_it() -> None:
    sup = Supervisor(range(2), gw_policy())
    for w in (0, 1):
        sup.workers[w] = ready(w, in_gateway=True)
    sup.rolling = (RollingRestart(RestartReason.MANUAL, ((1,),), wave=(0,), wave_started=5.0),)
    sup.workers[0] = ready(0, in_gateway=False)  # serving again, not yet routed to
    assert sup.tick(6.0) == [] and sup.rolling[0].wave == (0,)
    actions = sup.handle(0, GatewayMembership(member=True), 7.0)
    assert Note("rolling_restart_wave", {"workers": [1]}) in actions


def in_flight(sup: Supervisor) -> tuple[RollingRestart, ...]:
    # Through a function: mypy would keep `sup.rolling` narrowed to what was assigned.
    return sup.rolling


def test_the_last_wave_ends_the_rolling_restart_with_a_note() -> None:
    sup = serving_farm(2, policy())
    sup.rolling = (RollingRestart(RestartReason.CONFIG, (), wave=(0,), wave_started=5.0),)
    actions = sup.tick(6.0)
    assert Note("rolling_restart_done", {"reason": "config"}) in actions
    assert in_flight(sup) == ()
    # Two rolling restarts: each goes on by itself.
    sup.rolling = (
        RollingRestart(RestartReason.CONFIG, (), wave=(0,), wave_started=5.0),
        RollingRestart(RestartReason.OOM, ((1,),), wave=(), wave_started=5.0),
    )
    actions = sup.tick(7.0)
    assert Note("rolling_restart_done", {"reason": "config"}) in actions
    assert Note("rolling_restart_wave", {"workers": [1]}) in actions


def test_one_worker_restarts_at_once_with_the_drain_asked_for() -> None:
    sup = Supervisor(range(2), gw_policy())
    sup.workers[1] = ready(1)
    actions = sup.restart_rolling([1, 9], RestartReason.MANUAL, 10.0)  # 9: no such worker
    assert actions[0] == Drain(1) and sup.rolling == ()
    sup.workers[0] = ready(0)
    actions = sup.restart_rolling([0], RestartReason.MANUAL, 10.0, drain=False)
    assert Terminate(0) in actions and sup.workers[0].phase is Phase.STOPPING
    assert sup.restart_rolling([7], RestartReason.MANUAL, 10.0) == []
    # Several: the waves drain too, unless told not to.
    sup2 = Supervisor(range(3), gw_policy(canary=None, parallel=1))
    for w in range(3):
        sup2.workers[w] = ready(w, in_gateway=True)
    assert Drain(0) in sup2.restart_rolling([0, 1, 2], RestartReason.MANUAL, 10.0)
    assert sup2.rolling[0].drain
    sup3 = Supervisor(range(3), gw_policy(canary=None, parallel=1))
    for w in range(3):
        sup3.workers[w] = ready(w, in_gateway=True)
    assert Terminate(0) in sup3.restart_rolling([0, 1, 2], RestartReason.MANUAL, 10.0, drain=False)


def test_a_reload_forgets_removed_workers_and_adds_stopped_ones() -> None:
    sup = serving_farm(3, policy(parallel=1))
    sup.rolling = (RollingRestart(RestartReason.CONFIG, ((1,), (2,)), wave=(0, 2)),)
    sup.reconfigure(policy(parallel=2), added=[5, 0], removed=[2])
    assert sorted(sup.workers) == [0, 1, 5]
    assert sup.workers[5].phase is Phase.STOPPED
    assert sup.workers[0].phase is Phase.READY  # already there: kept as it was
    assert sup.rolling[0].waves == ((1,),) and sup.rolling[0].wave == (0,)
    assert sup.policy.startup.parallel == 2


def test_restore_refuses_a_state_of_another_or_unknown_worker() -> None:
    sup = Supervisor(range(2), policy())
    sup.restore(1, WorkerState(1, Phase.FAILED))
    assert sup.workers[1].phase is Phase.FAILED
    for wid, state in ((1, WorkerState(0)), (5, WorkerState(5))):
        with pytest.raises(ValueError, match="not a worker of this farm"):
            sup.restore(wid, state)


def oom_policy(scope_all: bool, parallel: int = 2) -> Policy:
    p = policy(parallel=parallel)
    return Policy(p.startup, p.health, p.restart, lambda step, f: step + 1, scope_all)


OOM = Failure(FailureKind.CUDA_OOM_LOAD, "CUDA out of memory", "lower mem_fraction_static")


def test_an_oom_step_spreads_to_every_worker_only_with_scope_all() -> None:
    sup = serving_farm(4, oom_policy(scope_all=True))
    sup.workers[3] = replace(sup.workers[3], phase=Phase.STOPPED, pid=None)
    sup.workers[2] = replace(sup.workers[2], oom_step=1)  # at the step already
    actions = sup.handle(0, ProcessExited(status=1, failure=OOM), 20.0)
    assert Note("oom_step_spread", {"worker": 0, "step": 1, "restart": [1]}) in actions
    assert [s.oom_step for s in sup.workers.values()] == [1, 1, 1, 1]
    assert len(sup.rolling) == 1 and sup.rolling[0].reason is RestartReason.OOM
    # Nothing running to restart: the step is taken, no rolling restart.
    sup2 = serving_farm(2, oom_policy(scope_all=True))
    sup2.workers[1] = replace(sup2.workers[1], phase=Phase.STOPPED, pid=None)
    sup2.handle(0, ProcessExited(status=1, failure=OOM), 20.0)
    assert sup2.workers[1].oom_step == 1 and sup2.rolling == ()
    # scope "worker": the others keep theirs.
    sup3 = serving_farm(2, oom_policy(scope_all=False))
    actions = sup3.handle(0, ProcessExited(status=1, failure=OOM), 20.0)
    assert sup3.workers[1].oom_step == 0 and "oom_step_spread" not in notes(actions)


def test_an_event_that_takes_no_oom_step_spreads_nothing() -> None:
    sup = serving_farm(2, oom_policy(scope_all=True))
    sup.workers[0] = replace(sup.workers[0], oom_step=1)
    actions = sup.handle(0, HealthPassed(), 20.0)
    assert sup.workers[1].oom_step == 0 and "oom_step_spread" not in notes(actions)


def test_reset_oom_goes_back_to_the_workers_own_flags() -> None:
    sup = Supervisor(range(1), policy())
    sup.workers[0] = replace(sup.workers[0], oom_step=3)
    sup.reset_oom(0)
    assert sup.workers[0].oom_step == 0


def test_the_loading_slots_are_parallel_and_at_least_one() -> None:
    for parallel, first in ((1, [0]), (0, [0]), (2, [0, 1])):
        sup = Supervisor(range(3), policy(canary=None, parallel=parallel))
        assert launches(sup.start([0, 1, 2], 0.0)) == first


def test_rollout_notes_say_what_happened() -> None:
    sup = Supervisor(range(2), policy(canary=0))
    actions = sup.start([0, 1], 0.0)
    assert Note("rollout_started", {"phase": "canary", "canary": 0}) in actions
    sup.handle(0, Launched(pid=1), 1.0)
    actions = sup.handle(0, HealthPassed(), 2.0)
    assert Note("rollout_canary_ready", {"canary": 0}) in actions
    sup.handle(1, Launched(pid=2), 3.0)
    actions = sup.handle(1, HealthPassed(), 4.0)
    assert Note("rollout_done", {"ready": 2, "workers": 2}) in actions


def test_a_quarantined_canary_lets_the_rollout_go_on() -> None:
    sup = Supervisor(range(3), policy(canary=0, parallel=2))
    sup.start([0, 1, 2], 0.0)
    actions = sup.handle(0, GpuFailing(0, "xid 79", "d"), 1.0)
    actions += sup.handle(0, ProcessExited(status=-15), 2.0)
    assert Note("rollout_canary_quarantined", {"canary": 0}) in actions
    assert sorted(launches(actions)) == [1, 2]


def test_only_the_canary_loads_while_the_rollout_is_halted_or_waiting() -> None:
    sup = Supervisor(range(3), policy(canary=1, parallel=3))
    assert launches(sup.start([0, 1, 2], 0.0)) == [1]
    assert {w: s.phase for w, s in sup.workers.items()} == {
        0: Phase.PENDING,
        1: Phase.STARTING,
        2: Phase.PENDING,
    }


def test_starting_the_stopped_canary_begins_a_new_rollout() -> None:
    sup = serving_farm(3, policy(canary=0))
    sup.handle(0, StopRequested(), 5.0)
    sup.handle(0, ProcessExited(status=0), 6.0)
    actions = sup.start([0], 7.0)
    assert Note("rollout_started", {"phase": "canary", "canary": 0}) in actions
    # Starting another worker while the rollout is done begins none.
    sup2 = serving_farm(3, policy(canary=0))
    sup2.handle(2, StopRequested(), 5.0)
    sup2.handle(2, ProcessExited(status=0), 6.0)
    assert "rollout_started" not in notes(sup2.start([2], 7.0))
    # ...nor does starting the canary that still serves.
    assert "rollout_started" not in notes(sup2.start([0], 7.0))


def test_an_operator_start_resets_the_back_off_unless_the_agent_asks() -> None:
    sup = Supervisor(range(1), policy(canary=None))
    sup.workers[0] = WorkerState(0, Phase.FAILED, failures=4)
    sup.start([0], 1.0)
    assert sup.workers[0].failures == 0
    sup.workers[0] = WorkerState(0, Phase.FAILED, failures=4)
    sup.start([0], 1.0, fresh=False)
    assert sup.workers[0].failures == 4


def test_adoption_keeps_held_workers_and_takes_over_running_ones() -> None:
    sup = Supervisor(range(6), policy())
    remembered = {
        0: Phase.READY,  # running: adopted
        1: Phase.FAILED,  # not running: held
        2: Phase.STOPPED,  # not running: held
        3: Phase.READY,  # not running, was serving: started by the rollout
        4: Phase.FAILED,  # running again (someone started it): adopted
        9: Phase.FAILED,  # no longer a worker of this farm
    }
    a = sup.adopt({8: 108, 0: 100, 4: 104, 5: 105}, remembered, 50.0, serving=[0])
    assert a.adopted == {0, 4, 5} and a.held == {1, 2}
    assert a.actions == (
        Note(
            "workers_held",
            {"workers": [1, 2], "why": "failed or stopped before the agent restarted"},
        ),
    )
    phases = {w: s.phase for w, s in sup.workers.items()}
    assert phases == {
        0: Phase.READY,
        1: Phase.FAILED,
        2: Phase.STOPPED,
        3: Phase.STOPPED,
        4: Phase.STARTING,
        5: Phase.STARTING,
    }
    assert (sup.workers[0].pid, sup.workers[0].ever_ready) == (100, True)
    assert (sup.workers[4].pid, sup.workers[4].launched_at) == (104, 50.0)


def test_a_cold_start_holds_only_quarantined_workers() -> None:
    sup = Supervisor(range(3), policy())
    a = sup.adopt({}, {0: Phase.FAILED, 1: Phase.QUARANTINED, 2: None}, 50.0)
    assert a.adopted == frozenset() and a.held == {1}
    assert sup.workers[1].phase is Phase.QUARANTINED
    assert sup.workers[0].phase is Phase.STOPPED  # the fresh state: the rollout starts it
    # Nothing held: nothing said.
    assert Supervisor(range(2), policy()).adopt({}, {0: Phase.FAILED}, 1.0).actions == ()


def test_policy_from_spec_reads_the_gateway_and_the_oom_scope() -> None:
    def oom_next(step: int, failure: Failure) -> int | None:
        return step + 1

    plain = load(MINIMAL)
    p = Policy.from_spec(plain, oom_next)
    assert p.drain_timeout is None and p.oom_next is oom_next and not p.oom_all
    assert Policy.from_spec(plain).oom_next(0, OOM) is None
    off = load(MINIMAL + "[oom]\nenabled = false\n")
    assert Policy.from_spec(off, oom_next).oom_next(0, OOM) is None
    every = load(MINIMAL + '[oom]\nscope = "all"\n')
    assert Policy.from_spec(every, oom_next).oom_all
    gw = load(MINIMAL + '[gateway]\nmode = "managed"\ndrain_timeout = "45s"\n')
    assert Policy.from_spec(gw).drain_timeout == 45.0
    assert Policy.from_spec(gw, oom_next).drain_timeout == 45.0


def test_a_new_worker_starts_with_a_clean_record() -> None:
    s = Supervisor([3], policy()).workers[3]
    assert (s.phase, s.since, s.failures, s.health_failures) == (Phase.STOPPED, 0.0, 0, 0)
    assert not (s.halt_on_failure or s.in_gateway or s.busy or s.ever_ready)


def test_a_rolling_restart_waiting_on_its_wave_holds_back_no_other() -> None:
    sup = serving_farm(3, policy())
    sup.workers[0] = replace(sup.workers[0], phase=Phase.STARTING)  # not settled
    sup.rolling = (
        RollingRestart(RestartReason.CONFIG, ((2,),), wave=(0,), wave_started=5.0),
        RollingRestart(RestartReason.OOM, ((1,),), wave=(), wave_started=5.0),
    )
    actions = sup.tick(6.0)
    assert Note("rolling_restart_wave", {"workers": [1]}) in actions
    assert [r.wave for r in in_flight(sup)] == [(0,), (1,)]


def test_an_oom_step_spread_drains_the_others_through_the_gateway() -> None:
    p = gw_policy(parallel=1)
    pol = Policy(p.startup, p.health, p.restart, lambda step, f: step + 1, True, GW)
    sup = Supervisor(range(3), pol)
    for w in range(3):
        sup.workers[w] = ready(w, in_gateway=True)
    actions = sup.handle(0, ProcessExited(status=1, failure=OOM), 20.0)
    assert in_flight(sup)[0].drain
    assert Drain(1) in actions


def test_without_scope_all_an_oom_step_stays_with_its_worker() -> None:
    p = policy()
    sup = serving_farm(2, Policy(p.startup, p.health, p.restart, lambda step, f: step + 1))
    sup.handle(0, ProcessExited(status=1, failure=OOM), 20.0)
    assert (sup.workers[0].oom_step, sup.workers[1].oom_step) == (1, 0)


def test_a_halted_rollout_says_why() -> None:
    sup = Supervisor(range(3), policy(canary=0))
    sup.start([0, 1, 2], 0.0)
    sup.handle(0, Launched(pid=1), 1.0)
    actions = sup.handle(0, ProcessExited(status=1), 2.0)
    assert "rollout_halted" in notes(actions)


def test_ready_reports_its_load_time_and_clears_the_probe_record() -> None:
    s = WorkerState(0, Phase.STARTING, since=10.0, launched_at=10.0, halt_on_failure=True)
    d = step(s, HealthPassed(), 11.23456, policy())
    assert d.actions == (Note("worker_ready", {"load_s": 1.235}),)
    assert not d.state.halt_on_failure
    unknown = replace(s, launched_at=None)
    assert step(unknown, HealthPassed(), 11.0, policy()).actions == (
        Note("worker_ready", {"load_s": 0.0}),
    )
    sick = replace(ready(), phase=Phase.UNHEALTHY, health_failures=2, busy=True)
    d = step(sick, HealthPassed(), 20.0, policy())
    assert (d.state.phase, d.state.health_failures, d.state.busy) == (Phase.READY, 0, False)
    d = step(replace(ready(), health_failures=1, busy=True), HealthPassed(), 20.0, policy())
    assert (d.state.health_failures, d.state.busy) == (0, False)


def test_a_restart_of_a_failed_worker_starts_its_count_over() -> None:
    failed = WorkerState(0, Phase.FAILED, failures=4)
    assert step(failed, RestartRequested(RestartReason.MANUAL), 1.0, policy()).state.failures == 0
    backoff = WorkerState(0, Phase.BACKOFF, failures=2, retry_at=9.0)
    d = step(backoff, RestartRequested(RestartReason.MANUAL), 1.0, policy())
    assert (d.state.phase, d.state.failures) == (Phase.PENDING, 2)


def test_starting_a_failed_worker_keeps_why_it_restarts() -> None:
    failed = WorkerState(0, Phase.FAILED, next_reason=RestartReason.OOM)
    assert step(failed, StartRequested(), 1.0, policy()).state.next_reason is RestartReason.OOM
    stopped = WorkerState(0, Phase.STOPPED, next_reason=RestartReason.OOM)
    assert step(stopped, StartRequested(), 1.0, policy()).state.next_reason is None


def test_a_stopped_process_leaves_no_probe_failures_behind() -> None:
    for intent, phase in (
        (StopIntent.QUARANTINE, Phase.QUARANTINED),
        (StopIntent.STOP, Phase.STOPPED),
        (StopIntent.RESTART, Phase.PENDING),
    ):
        s = replace(ready(), phase=Phase.STOPPING, stop_intent=intent, health_failures=3)
        d = step(s, ProcessExited(status=0), 50.0, policy())
        assert (d.state.phase, d.state.health_failures, d.state.pid) == (phase, 0, None)


def test_an_adopted_serving_worker_starts_with_no_probe_failures() -> None:
    sup = Supervisor(range(1), policy())
    sup.restore(0, WorkerState(0, Phase.READY, health_failures=2))
    sup.adopt({0: 100}, {0: Phase.READY}, 5.0, serving=[0])
    assert (sup.workers[0].phase, sup.workers[0].health_failures) == (Phase.READY, 0)


def test_adopting_a_quarantined_worker_first_still_adopts_the_workers_after_it() -> None:
    """Kills `Supervisor.adopt/continue->break`: a worker whose quarantine's stop outlived
    the agent, met first, ended the adoption loop: the serving workers after it were not
    adopted (and would be launched again over their own running processes)."""
    from sglang_farm.workers.supervisor import GpuQuarantine

    sup = Supervisor([1, 2, 3], Policy(StartupPolicy(), HealthPolicy(), RestartPolicy()))
    sup.restore(1, WorkerState(1, quarantine=GpuQuarantine(1, "xid 79", "off the bus", 1.0)))
    adoption = sup.adopt({1: 101, 2: 102, 3: 103}, {}, 5.0, serving={2, 3})
    assert adoption.adopted == {1, 2, 3}
    assert Terminate(1) in adoption.actions and Terminate(2) not in adoption.actions
    assert [sup.workers[w].phase for w in (1, 2, 3)] == [
        Phase.STOPPING,
        Phase.READY,
        Phase.READY,
    ]
