"""The supervisor's pure core: ordering, canary, back-off, crash loop, hang, OOM ladder hook."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest

from sglang_farm.farm_view import Phase
from sglang_farm.sglang.failures import Failure, FailureKind, RestartReason
from sglang_farm.spec import HealthPolicy, RestartPolicy, StartupPolicy
from sglang_farm.workers.supervisor import (
    Action,
    Decision,
    Drain,
    Drained,
    GatewayMembership,
    GpuFailing,
    GpuQuarantine,
    HealthFailed,
    HealthPassed,
    IllegalTransition,
    Launch,
    Launched,
    Note,
    Policy,
    ProcessExited,
    ProgressSeen,
    ReleaseRequested,
    RemapsPending,
    RestartRequested,
    RolledBack,
    RollingRestart,
    Rollout,
    StartRequested,
    StopIntent,
    StopRequested,
    Supervisor,
    Terminate,
    Wedged,
    WorkerState,
    backoff_delay,
    drifted_workers,
    restored_quarantine,
    step,
    stop_budget,
    wants_in_gateway,
    wave_budget,
)

OOM = Failure(FailureKind.CUDA_OOM_LOAD, "CUDA out of memory", "lower mem_fraction_static")
BAD_FLAG = Failure(FailureKind.BAD_FLAG, "unrecognized arguments", "fix the flag")


def policy() -> Policy:
    return Policy(
        StartupPolicy(canary=0, parallel=2, load_timeout=100.0),
        HealthPolicy(period=1.0, timeout=1.0, failure_threshold=3),
        RestartPolicy(backoff_initial=1.0, backoff_max=8.0, reset_after=50.0, max_failures=3),
    )


def launches(actions: Sequence[Action]) -> list[int]:
    return [a.worker for a in actions if isinstance(a, Launch)]


def bring_up(sup: Supervisor, wid: int, now: float) -> list[Action]:
    out = list(sup.handle(wid, Launched(pid=1000 + wid), now))
    out += sup.handle(wid, HealthPassed(), now)
    return out


# Read through functions, not `sup.rollout is ...` inline: mypy keeps an attribute narrowed by
# one assert across the calls that change it, and would call the next assert unreachable.
def rollout(sup: Supervisor) -> Rollout:
    return sup.rollout


def phase(sup: Supervisor, wid: int) -> Phase:
    return sup.workers[wid].phase


def test_canary_loads_alone_then_waves_never_exceed_parallel() -> None:
    sup = Supervisor(range(6), policy())
    assert launches(sup.start(list(range(6)), 0.0)) == [0]
    assert rollout(sup) is Rollout.CANARY
    # Canary ready: the next ones get slots, at most `parallel` loading at once.
    assert launches(bring_up(sup, 0, 1.0)) == [1, 2]
    assert rollout(sup) is Rollout.ROLLING
    assert launches(bring_up(sup, 1, 2.0)) == [3]
    assert launches(bring_up(sup, 3, 3.0)) == [4]
    loading = [w for w, s in sup.workers.items() if s.phase is Phase.STARTING]
    assert loading == [2, 4]
    bring_up(sup, 2, 4.0)
    bring_up(sup, 4, 4.0)
    bring_up(sup, 5, 5.0)
    assert rollout(sup) is Rollout.DONE
    assert all(s.phase is Phase.READY for s in sup.workers.values())
    assert sup.workers[0].last_load_seconds == 1.0


def test_canary_failure_halts_rollout_and_names_the_reason() -> None:
    sup = Supervisor(range(4), policy())
    sup.start(list(range(4)), 0.0)
    sup.handle(0, Launched(pid=10), 0.0)
    actions = sup.handle(0, ProcessExited(status=-9, failure=OOM), 5.0)
    assert launches(actions) == []
    assert phase(sup, 0) is Phase.FAILED
    assert rollout(sup) is Rollout.HALTED
    assert sup.rollout_reason is not None and "CUDA out of memory" in sup.rollout_reason
    assert {s.phase for w, s in sup.workers.items() if w} == {Phase.PENDING}
    # Time passing starts nothing while halted.
    assert launches(sup.tick(500.0)) == []


def test_starting_again_after_a_halt_begins_with_the_canary() -> None:
    sup = Supervisor(range(3), policy())
    sup.start([0, 1, 2], 0.0)
    sup.handle(0, ProcessExited(status=1, failure=None), 1.0)
    assert rollout(sup) is Rollout.HALTED
    assert launches(sup.start([0, 1, 2], 2.0)) == [0]
    assert rollout(sup) is Rollout.CANARY


def test_restart_backs_off_exponentially_and_gives_up_after_the_limit() -> None:
    sup = Supervisor([0, 1], policy())
    sup.start([0, 1], 0.0)
    bring_up(sup, 0, 0.0)
    bring_up(sup, 1, 0.0)
    t = 10.0
    delays = []
    for _ in range(3):
        sup.handle(1, ProcessExited(status=-9), t)
        s = sup.workers[1]
        assert s.phase is Phase.BACKOFF and s.retry_at is not None
        delays.append(s.retry_at - t)
        assert launches(sup.tick(s.retry_at - 0.01)) == []
        assert launches(sup.tick(s.retry_at)) == [1]
        t = s.retry_at
        sup.handle(1, Launched(pid=2), t)
    assert delays == [1.0, 2.0, 4.0]
    sup.handle(1, ProcessExited(status=-9), t + 1)
    assert phase(sup, 1) is Phase.FAILED
    assert "gave up after 4 failures" in (sup.workers[1].last_action or "")
    assert sup.workers[1].restarts_by_reason == {"crash": 3}
    assert phase(sup, 0) is Phase.READY  # the others are untouched


def test_backoff_resets_after_a_stable_period() -> None:
    p = policy()
    s = WorkerState(0, phase=Phase.READY, failures=2, ready_since=0.0)
    assert step(s, HealthPassed(), 49.0, p).state.failures == 2
    from sglang_farm.workers.supervisor import Tick

    assert step(s, Tick(), 49.9, p).state.failures == 2
    assert step(s, Tick(), 50.0, p).state.failures == 0


def test_the_back_off_reset_is_a_deadline_the_ticker_wakes_for() -> None:
    """A worker READY long enough has its back-off reset when it is due, not at the
    ticker's 5 s safety tick: next_deadline names that moment, and a tick then resets it."""
    sup = Supervisor([0, 1], policy())  # reset_after 50 s
    sup.workers[0] = WorkerState(0, phase=Phase.READY, failures=2, ready_since=0.1)
    sup.workers[1] = WorkerState(1, phase=Phase.READY, ready_since=0.0)  # nothing to reset
    due = sup.next_deadline(1.0)
    assert due == 0.1 + 50.0
    sup.tick(due)
    assert sup.workers[0].failures == 0
    assert sup.next_deadline(due) is None  # reset: no deadline left


def test_backoff_delay_is_capped() -> None:
    r = RestartPolicy(backoff_initial=5.0, backoff_max=300.0)
    assert [backoff_delay(n, r) for n in (1, 2, 3, 7, 20)] == [5.0, 10.0, 20.0, 300.0, 300.0]


def test_hang_restarts_after_threshold_with_reason_hang() -> None:
    sup = Supervisor([0], policy())
    sup.start([0], 0.0)
    bring_up(sup, 0, 0.0)
    sup.handle(0, HealthFailed("timeout"), 1.0)
    assert phase(sup, 0) is Phase.UNHEALTHY
    sup.handle(0, HealthFailed("timeout"), 2.0)
    actions = sup.handle(0, HealthFailed("timeout"), 3.0)
    assert [a for a in actions if isinstance(a, Terminate)] == [Terminate(0)]
    assert phase(sup, 0) is Phase.STOPPING
    sup.handle(0, ProcessExited(status=-9), 4.0)
    s = sup.workers[0]
    assert s.phase is Phase.BACKOFF
    assert s.last_failure is not None and s.last_failure.kind is FailureKind.HANG
    sup.tick(10.0)
    assert sup.workers[0].restarts_by_reason == {"hang": 1}


def test_a_probe_failing_unexcused_clears_the_busy_excuse_of_an_earlier_one() -> None:
    """Review of issue 32: a worker excused as busy (READY, busy) whose next probe failed
    with no counter progress went UNHEALTHY still marked busy, so the canary analysis (which
    ends no window on an unhealthy canary unless it is busy) and the busy gauge read a
    stale excuse."""
    sup = Supervisor([0], policy())
    sup.start([0], 0.0)
    bring_up(sup, 0, 0.0)
    sup.workers[0] = replace(sup.workers[0], busy=True, progress_at=1.0)
    sup.handle(0, HealthFailed("timeout", started=2.0), 3.0)  # no progress since 1.0
    assert phase(sup, 0) is Phase.UNHEALTHY
    assert sup.workers[0].busy is False


def test_a_passing_probe_clears_unhealthy() -> None:
    sup = Supervisor([0], policy())
    sup.start([0], 0.0)
    bring_up(sup, 0, 0.0)
    sup.handle(0, HealthFailed("503"), 1.0)
    sup.handle(0, HealthFailed("503"), 2.0)
    sup.handle(0, HealthPassed(), 3.0)
    assert phase(sup, 0) is Phase.READY
    sup.handle(0, HealthFailed("503"), 4.0)
    assert phase(sup, 0) is Phase.UNHEALTHY  # the count started over


def test_load_timeout_terminates_and_counts_as_failure() -> None:
    sup = Supervisor([0, 1], policy())
    sup.start([0, 1], 0.0)
    bring_up(sup, 0, 0.0)
    sup.handle(1, Launched(pid=5), 0.0)
    assert [a for a in sup.tick(100.5) if isinstance(a, Terminate)] == [Terminate(1)]
    sup.handle(1, ProcessExited(status=-15), 101.0)
    assert sup.workers[1].last_failure is not None
    assert sup.workers[1].last_failure.kind is FailureKind.LOAD_TIMEOUT


def test_deterministic_failure_is_not_retried() -> None:
    sup = Supervisor([0, 1], policy())
    sup.start([0, 1], 0.0)
    bring_up(sup, 0, 0.0)
    sup.handle(1, ProcessExited(status=2, failure=BAD_FLAG), 1.0)
    assert phase(sup, 1) is Phase.FAILED
    assert launches(sup.tick(1000.0)) == []


def test_oom_failure_steps_the_ladder_and_restarts_at_once() -> None:
    p = Policy(
        policy().startup,
        policy().health,
        policy().restart,
        oom_next=lambda step, failure: step + 1 if step < 2 else None,
    )
    sup = Supervisor([0, 1], p)
    sup.start([0, 1], 0.0)
    sup.handle(0, Launched(pid=1), 0.0)
    # The canary OOMs while loading: the ladder has a step, so it is retried, not failed.
    actions = sup.handle(0, ProcessExited(status=-9, failure=OOM), 1.0)
    assert launches(actions) == [0]
    s = sup.workers[0]
    assert s.oom_step == 1 and s.oom_events == {"cuda": 1} and s.restarts_by_reason == {"oom": 1}
    assert rollout(sup) is Rollout.CANARY
    sup.handle(0, ProcessExited(status=-9, failure=OOM), 2.0)
    assert sup.workers[0].oom_step == 2
    sup.handle(0, ProcessExited(status=-9, failure=OOM), 3.0)
    assert phase(sup, 0) is Phase.FAILED  # ladder exhausted, canary halts the rollout
    assert rollout(sup) is Rollout.HALTED


def test_operator_stop_and_restart() -> None:
    sup = Supervisor([0, 1], policy())
    sup.start([0, 1], 0.0)
    bring_up(sup, 0, 0.0)
    bring_up(sup, 1, 0.0)
    assert sup.handle(1, RestartRequested(RestartReason.MANUAL), 1.0) == [Terminate(1)]
    assert launches(sup.handle(1, ProcessExited(status=0), 2.0)) == [1]
    assert sup.workers[1].restarts_by_reason == {"manual": 1}
    bring_up(sup, 1, 3.0)
    assert sup.handle(1, StopRequested(), 4.0) == [Terminate(1)]
    sup.handle(1, ProcessExited(status=0), 5.0)
    assert phase(sup, 1) is Phase.STOPPED
    assert launches(sup.tick(100.0)) == []
    assert sup.workers[1].failures == 0


def test_stop_during_backoff_cancels_the_restart() -> None:
    sup = Supervisor([0], policy())
    sup.start([0], 0.0)
    bring_up(sup, 0, 0.0)
    sup.handle(0, ProcessExited(status=-9), 1.0)
    sup.handle(0, StopRequested(), 1.5)
    assert phase(sup, 0) is Phase.STOPPED
    assert launches(sup.tick(100.0)) == []


def test_illegal_transition_raises_and_leaves_state() -> None:
    s = WorkerState(0, phase=Phase.READY)
    with pytest.raises(IllegalTransition):
        step(s, Launched(pid=1), 0.0, policy())
    assert s.phase is Phase.READY


def test_late_exit_after_stop_is_ignored() -> None:
    s = WorkerState(0, phase=Phase.STOPPED)
    assert step(s, ProcessExited(status=-9), 1.0, policy()).state == s


def test_operator_start_resets_backoff_but_agent_restart_keeps_it() -> None:
    s = WorkerState(0, phase=Phase.STOPPED, failures=3)
    from sglang_farm.workers.supervisor import StartRequested

    assert step(s, StartRequested(), 0.0, policy()).state.failures == 0
    kept = step(s, StartRequested(fresh=False), 0.0, policy()).state
    assert kept.failures == 3 and kept.phase is Phase.PENDING


def test_oom_scope_all_gives_every_worker_the_step_and_names_the_running_ones() -> None:
    p = Policy(
        policy().startup,
        policy().health,
        policy().restart,
        oom_next=lambda step, failure: step + 1,
        oom_all=True,
    )
    sup = Supervisor([0, 1, 2], p)
    sup.start([0, 1, 2], 0.0)
    for w in (0, 1, 2):
        if phase(sup, w) is Phase.STARTING:
            bring_up(sup, w, 1.0)
        else:
            sup.tick(1.0)
            bring_up(sup, w, 1.0)
    sup.handle(2, StopRequested(), 2.0)
    sup.handle(2, ProcessExited(status=0), 2.5)
    actions = sup.handle(1, ProcessExited(status=-9, failure=OOM), 3.0)
    spread = [a for a in actions if isinstance(a, Note) and a.event == "oom_step_spread"]
    assert len(spread) == 1 and spread[0].fields["restart"] == [0]  # 2 is stopped: next start
    assert [sup.workers[w].oom_step for w in (0, 1, 2)] == [1, 1, 1]


def test_a_halted_rollout_resumes_once_the_restarted_canary_is_ready() -> None:
    sup = Supervisor(range(3), policy())
    sup.start([0, 1, 2], 0.0)
    sup.handle(0, ProcessExited(status=2, failure=BAD_FLAG), 1.0)
    assert rollout(sup) is Rollout.HALTED
    # The operator fixed the flag and restarts only the canary.
    assert launches(sup.handle(0, RestartRequested(RestartReason.MANUAL), 2.0)) == [0]
    assert launches(bring_up(sup, 0, 3.0)) == [1, 2]
    assert rollout(sup) is Rollout.ROLLING and sup.rollout_reason is None


# ---- quarantine (issue 22 item 7; issue 27 finding 1) ---------------------------------------


def quarantined_farm() -> Supervisor:
    """Workers 0 and 1 ready; worker 1's GPU fails and it is stopped for it (STOPPING)."""
    sup = Supervisor([0, 1], policy())
    sup.start([0, 1], 0.0)
    bring_up(sup, 0, 0.0)
    bring_up(sup, 1, 0.0)
    assert sup.handle(1, GpuFailing(1, "xid 79", "fell off the bus"), 1.0)[0] == Terminate(1)
    return sup


def test_a_restart_or_start_of_a_quarantined_worker_is_refused_and_nothing_launches() -> None:
    sup = quarantined_farm()
    sup.handle(1, ProcessExited(status=-15), 2.0)
    assert phase(sup, 1) is Phase.QUARANTINED
    for event in (RestartRequested(RestartReason.MANUAL), StartRequested()):
        actions = sup.handle(1, event, 3.0)
        assert actions == [Note("worker_quarantined_not_started", {"worker": 1})]
        assert phase(sup, 1) is Phase.QUARANTINED
    # A rolling restart (restart all, a reload, an OOM step spread) passes it by too.
    actions = sup.restart_rolling([0, 1], RestartReason.CONFIG, 4.0)
    actions += sup.handle(0, ProcessExited(status=0), 5.0)
    actions += sup.tick(500.0)
    assert 1 not in launches(actions) and Terminate(1) not in actions
    assert phase(sup, 1) is Phase.QUARANTINED and sup.workers[1].quarantine is not None
    # Only a release starts it again.
    assert launches(sup.handle(1, ReleaseRequested(), 600.0)) == [1]


@pytest.mark.parametrize(
    "event",
    [RestartRequested(RestartReason.MANUAL), StopRequested(), StartRequested()],
    ids=["restart", "stop", "start"],
)
def test_a_request_while_it_stops_for_its_gpu_ends_quarantined_never_relaunched(
    event: RestartRequested | StopRequested | StartRequested,
) -> None:
    """Before: a restart then overrode the quarantine's stop and relaunched the worker on
    its failing GPU; a stop left it STOPPED with its quarantine recorded."""
    sup = quarantined_farm()
    sup.handle(1, event, 1.5)
    actions = sup.handle(1, ProcessExited(status=-15), 2.0)
    assert launches(actions) == [] and phase(sup, 1) is Phase.QUARANTINED
    assert launches(sup.tick(500.0)) == [] and phase(sup, 1) is Phase.QUARANTINED


Q2 = GpuQuarantine(2, "xid 79", "fell off the bus", 10.0)


def test_a_restored_quarantine_on_a_gpu_the_worker_still_uses_is_kept() -> None:
    s = WorkerState(2, quarantine=Q2)
    assert restored_quarantine(s, Phase.QUARANTINED, (2,)) == (s, Phase.QUARANTINED, None)
    assert restored_quarantine(s, Phase.QUARANTINED, (3, 2)) == (s, Phase.QUARANTINED, None)
    plain = WorkerState(2)
    assert restored_quarantine(plain, Phase.FAILED, (2,)) == (plain, Phase.FAILED, None)
    assert restored_quarantine(plain, None, (2,)) == (plain, None, None)


def test_a_restored_quarantine_without_its_phase_holds_the_worker_quarantined() -> None:
    """The agent went while stopping the worker for its GPU: the decision stands."""
    s = WorkerState(2, quarantine=Q2)
    assert restored_quarantine(s, None, (2,)) == (s, Phase.QUARANTINED, None)
    assert restored_quarantine(s, Phase.STOPPED, (2,)) == (s, Phase.QUARANTINED, None)


def test_adopting_a_running_worker_with_a_quarantine_finishes_its_stop() -> None:
    sup = Supervisor([1, 2], policy())
    sup.restore(2, WorkerState(2, quarantine=Q2))
    adoption = sup.adopt({1: 101, 2: 102}, {2: Phase.QUARANTINED}, 5.0, serving={1, 2})
    assert adoption.adopted == {1, 2} and adoption.held == set()
    assert Terminate(2) in adoption.actions and Terminate(1) not in adoption.actions
    assert phase(sup, 1) is Phase.READY and phase(sup, 2) is Phase.STOPPING
    # The agent's start of the rollout leaves it alone; its exit ends it quarantined.
    assert launches(sup.start([1, 2], 6.0, fresh=False)) == []
    sup.handle(2, ProcessExited(status=-15), 7.0)
    assert phase(sup, 2) is Phase.QUARANTINED and launches(sup.tick(500.0)) == []


def test_a_restored_quarantine_on_a_gpu_the_worker_left_is_dropped_saying_why() -> None:
    s = WorkerState(2, quarantine=Q2, quarantines_by_reason={"xid 79": 1})
    restored, ph, why = restored_quarantine(s, Phase.QUARANTINED, (5,))
    assert ph is None and restored.quarantine is None
    assert restored.quarantines_by_reason == {"xid 79": 1}
    assert why == (
        "the config puts the worker on GPU 5 and it no longer uses GPU 2, the one the "
        "quarantine names"
    )
    assert restored.last_action == f"quarantine on GPU 2 (xid 79) dropped at agent start: {why}"


def test_a_restored_quarantined_phase_without_a_record_is_dropped_saying_why() -> None:
    restored, ph, why = restored_quarantine(WorkerState(1), Phase.QUARANTINED, (1,))
    assert ph is None and restored.quarantine is None
    assert why is not None and "no record of the GPU" in why


# ---- each event's edges, h11-style (issue 24 §4): every phase it may arrive in ---------------

ALL_PHASES = tuple(Phase)
_SERVING_PHASES = (Phase.READY, Phase.UNHEALTHY)
_RUNNING_PHASES = (Phase.STARTING, *_SERVING_PHASES)
T = 100.0  # `now` of the event under test; states entered their phase at 90.0


def gateway_policy(drain_timeout: float = 30.0) -> Policy:
    p = policy()
    return Policy(p.startup, p.health, p.restart, drain_timeout=drain_timeout)


def at(ph: Phase, **fields: object) -> WorkerState:
    """Worker 7 in phase `ph` since 90.0 (running phases with a pid and a launch time)."""
    running = ph in (*_RUNNING_PHASES, Phase.DRAINING, Phase.STOPPING)
    base = WorkerState(
        7, pid=4242 if running else None, launched_at=50.0 if running else None, ever_ready=True
    )
    return base.enter(ph, 90.0, **fields)


def unchanged(s: WorkerState, d: Decision) -> bool:
    return d.state == s and d.actions == ()


FAIL = GpuFailing(3, "xid 79", "fell off the bus")


@pytest.mark.parametrize("ph", [*_RUNNING_PHASES, Phase.DRAINING])
def test_gpu_failing_stops_a_running_worker_to_end_quarantined(ph: Phase) -> None:
    d = step(at(ph), FAIL, T, gateway_policy())
    assert d.state.phase is Phase.STOPPING and d.state.since == T
    assert d.state.stop_intent is StopIntent.QUARANTINE
    assert d.state.quarantine == GpuQuarantine(3, "xid 79", "fell off the bus", T)
    assert d.state.quarantines_by_reason == {"xid 79": 1}
    assert d.actions == (
        Terminate(7),
        Note("gpu_quarantined", {"reason": "xid 79", "detail": "fell off the bus"}),
    )
    # STOPPING -> QUARANTINED at its exit, never restarted.
    out = step(d.state, ProcessExited(status=-15), T + 1, gateway_policy())
    assert out.state.phase is Phase.QUARANTINED and out.state.pid is None
    assert out.actions == (Note("worker_quarantined"),)


def test_gpu_failing_while_stopping_turns_the_stop_into_a_quarantine() -> None:
    s = at(Phase.STOPPING, stop_intent=StopIntent.RESTART)
    d = step(s, FAIL, T, policy())
    assert d.state.phase is Phase.STOPPING and d.state.since == 90.0
    assert d.state.stop_intent is StopIntent.QUARANTINE and d.state.quarantine is not None
    assert [type(a) for a in d.actions] == [Note]  # the stop under way goes on: no Terminate


@pytest.mark.parametrize("ph", [Phase.PENDING, Phase.BACKOFF, Phase.STOPPED, Phase.FAILED])
def test_gpu_failing_sets_a_worker_that_runs_nothing_aside_at_once(ph: Phase) -> None:
    d = step(at(ph, retry_at=95.0), FAIL, T, policy())
    assert d.state.phase is Phase.QUARANTINED and d.state.retry_at is None
    assert d.state.quarantine is not None and d.state.quarantine.gpu == 3
    assert [type(a) for a in d.actions] == [Note]


def test_gpu_failing_again_keeps_the_first_reason() -> None:
    first = GpuQuarantine(3, "gpu lost", "lost", 80.0)
    for s in (
        at(Phase.QUARANTINED, quarantine=first),
        at(Phase.STOPPING, quarantine=first, stop_intent=StopIntent.QUARANTINE),
    ):
        assert unchanged(s, step(s, FAIL, T, policy()))


@pytest.mark.parametrize("ph", [Phase.PENDING, Phase.BACKOFF])
def test_remaps_pending_sets_aside_a_worker_about_to_start(ph: Phase) -> None:
    d = step(at(ph), RemapsPending(3), T, policy())
    assert d.state.phase is Phase.QUARANTINED
    assert d.state.quarantine is not None
    assert (d.state.quarantine.gpu, d.state.quarantine.reason) == (3, "pending row remaps")
    assert d.state.quarantines_by_reason == {"pending row remaps": 1}


@pytest.mark.parametrize("ph", [p for p in ALL_PHASES if p not in (Phase.PENDING, Phase.BACKOFF)])
def test_remaps_pending_leaves_a_running_or_stopped_worker_alone(ph: Phase) -> None:
    s = at(ph)
    assert unchanged(s, step(s, RemapsPending(3), T, policy()))


def test_release_starts_a_quarantined_worker_afresh() -> None:
    s = at(Phase.QUARANTINED, quarantine=GpuQuarantine(3, "xid 79", "x", 80.0), failures=2)
    d = step(s, ReleaseRequested(), T, policy())
    assert d.state.phase is Phase.PENDING and d.state.quarantine is None
    assert d.state.failures == 0 and d.actions == (Note("gpu_released"),)


@pytest.mark.parametrize("ph", [p for p in ALL_PHASES if p is not Phase.QUARANTINED])
def test_release_of_a_worker_not_quarantined_changes_nothing(ph: Phase) -> None:
    s = at(ph)
    assert unchanged(s, step(s, ReleaseRequested(), T, policy()))


def test_drained_ends_the_drain_with_the_stop() -> None:
    s = at(Phase.DRAINING, stop_intent=StopIntent.STOP)
    d = step(s, Drained(), T, gateway_policy())
    assert d.state.phase is Phase.STOPPING and d.state.last_drain_seconds == 10.0
    assert d.state.stop_intent is StopIntent.STOP
    assert d.actions == (Terminate(7), Note("worker_drained", {"drain_s": 10.0}))


@pytest.mark.parametrize("ph", [p for p in ALL_PHASES if p is not Phase.DRAINING])
def test_drained_outside_a_drain_changes_nothing(ph: Phase) -> None:
    s = at(ph)
    assert unchanged(s, step(s, Drained(), T, gateway_policy()))


@pytest.mark.parametrize("ph", ALL_PHASES)
@pytest.mark.parametrize("member", [True, False])
def test_gateway_membership_is_recorded_in_every_phase(ph: Phase, member: bool) -> None:
    s = at(ph, in_gateway=not member)
    d = step(s, GatewayMembership(member), T, gateway_policy())
    assert d.state == replace(s, in_gateway=member) and d.actions == ()


def test_with_a_gateway_the_next_wave_waits_for_the_gateway_to_route_to_the_last() -> None:
    p = gateway_policy()
    sup = Supervisor(
        [0, 1, 2],
        Policy(replace(p.startup, parallel=1), p.health, p.restart, drain_timeout=p.drain_timeout),
    )
    sup.start([0, 1, 2], 0.0)
    for w in (0, 1, 2):
        bring_up(sup, w, 1.0)
        sup.handle(w, GatewayMembership(True), 1.0)
    sup.restart_rolling([0, 1, 2], RestartReason.CONFIG, 2.0)  # wave 1: the canary, 0
    sup.handle(0, GatewayMembership(False), 2.0)
    sup.handle(0, Drained(), 3.0)
    sup.handle(0, ProcessExited(status=0), 4.0)
    assert Drain(1) not in bring_up(sup, 0, 5.0)
    assert phase(sup, 0) is Phase.READY  # ready, not yet routed to: the wave is not over
    assert phase(sup, 1) is Phase.READY
    actions = sup.handle(0, GatewayMembership(True), 6.0)
    assert Drain(1) in actions and phase(sup, 1) is Phase.DRAINING


@pytest.mark.parametrize("ph", _SERVING_PHASES)
def test_progress_is_recorded_while_serving(ph: Phase) -> None:
    d = step(at(ph), ProgressSeen(), T, policy())
    assert d.state.progress_at == T and d.state.phase is ph and d.actions == ()


@pytest.mark.parametrize("ph", [p for p in ALL_PHASES if p not in _SERVING_PHASES])
def test_progress_outside_serving_changes_nothing(ph: Phase) -> None:
    s = at(ph)
    assert unchanged(s, step(s, ProgressSeen(), T, policy()))


@pytest.mark.parametrize("ph", _SERVING_PHASES)
def test_progress_after_a_probe_was_sent_excuses_its_failure_as_busy(ph: Phase) -> None:
    p = policy()  # busy_window 30 s
    s = step(at(ph, health_failures=1), ProgressSeen(), T, p).state
    d = step(s, HealthFailed("timed out", started=T - 1), T + 5, p)
    assert d.state.phase is Phase.READY and d.state.busy and d.state.health_failures == 0
    assert d.actions == (Note("worker_busy", {"detail": "timed out"}),)
    # Progress seen before the probe was sent, or too long ago, excuses nothing.
    late = step(s, HealthFailed("timed out", started=T + 1), T + 5, p)
    assert late.state.health_failures == 2 and not late.state.busy
    stale = step(s, HealthFailed("timed out", started=T - 1), T + p.health.busy_window + 1, p)
    assert stale.state.health_failures == 2 and not stale.state.busy


@pytest.mark.parametrize("ph", _SERVING_PHASES)
def test_wedged_stops_a_serving_worker_as_a_hang(ph: Phase) -> None:
    d = step(at(ph, busy=True), Wedged("2 requests running, no progress for 130 s"), T, policy())
    assert d.state.phase is Phase.STOPPING and d.state.stop_intent is StopIntent.FAILURE
    assert not d.state.busy
    f = d.state.pending_failure
    assert f is not None and f.kind is FailureKind.HANG
    assert f.summary == "wedged: 2 requests running, no progress for 130 s"
    assert d.actions == (Terminate(7), Note("worker_terminating", {"kind": "hang"}))
    # Its exit is handled as that hang: back-off, restart reason hang.
    out = step(d.state, ProcessExited(status=-15), T + 1, policy())
    assert out.state.phase is Phase.BACKOFF and out.state.next_reason is RestartReason.HANG


@pytest.mark.parametrize("ph", [p for p in ALL_PHASES if p not in _SERVING_PHASES])
def test_wedged_outside_serving_changes_nothing(ph: Phase) -> None:
    """The one wedged guard: a loading worker's stall is the load deadline's to judge."""
    s = at(ph)
    assert unchanged(s, step(s, Wedged("stuck"), T, policy()))


def test_the_stop_budget_is_the_drain_then_the_stop_timeout() -> None:
    p = gateway_policy(drain_timeout=30.0)  # stop_timeout 60 s (the default)
    assert stop_budget(p) == 30.0 + p.restart.stop_timeout
    assert stop_budget(p, drain=False) == p.restart.stop_timeout
    assert stop_budget(policy()) == p.restart.stop_timeout  # no gateway: no drain
    assert wave_budget(p) == p.startup.load_timeout + 30.0 + p.restart.stop_timeout


def test_a_wave_that_outlives_its_budget_gives_way_to_the_next() -> None:
    p = gateway_policy()
    sup = Supervisor(
        [0, 1, 2],
        Policy(replace(p.startup, parallel=1), p.health, p.restart, drain_timeout=p.drain_timeout),
    )
    sup.start([0, 1, 2], 0.0)
    for w in (0, 1, 2):
        bring_up(sup, w, 1.0)
    sup.restart_rolling([0, 1, 2], RestartReason.CONFIG, 2.0)  # worker 0 drains, never settles
    assert sup.next_deadline(2.0) == 2.0 + 30.0  # its drain budget comes first
    budget = p.startup.load_timeout + 30.0 + p.restart.stop_timeout  # a load after a stop
    assert Drain(1) not in sup.tick(2.0 + budget - 1)
    assert Drain(1) in sup.tick(2.0 + budget)


# Clock readings where (t + budget) - t falls short of the budget in floating point: a
# tick at the deadline next_deadline named must act on it all the same (issue 32 §2).
DRAIN_AT = 131063.18761917001  # with a 30 s drain budget
WAVE_AT = 131058.91484918354  # with a 190 s wave budget (100 load + 30 drain + 60 stop)


def test_a_tick_at_the_drain_deadline_ends_the_drain() -> None:
    sup = Supervisor([0], gateway_policy())  # drain budget 30 s
    sup.workers[0] = WorkerState(
        0, Phase.DRAINING, since=DRAIN_AT, pid=7, stop_intent=StopIntent.STOP
    )
    due = sup.next_deadline(DRAIN_AT)
    assert due is not None and due - DRAIN_AT == pytest.approx(30.0)
    assert Terminate(0) in sup.tick(due)


def test_a_tick_at_the_load_deadline_stops_the_loading_worker() -> None:
    """Mutant machine _on_tick/GtE->Gt (`now > load_at`): the tick at the very deadline
    `next_deadline` wakes for did nothing, and the ticker woke again at once."""
    p = gateway_policy()
    sup = Supervisor([0], p)
    sup.workers[0] = WorkerState(0, Phase.STARTING, since=WAVE_AT, pid=7, launched_at=WAVE_AT)
    due = sup.next_deadline(WAVE_AT)
    assert due is not None and due - WAVE_AT == pytest.approx(p.startup.load_timeout)
    assert Terminate(0) in sup.tick(due)
    assert sup.workers[0].phase is Phase.STOPPING


def test_a_tick_at_the_wave_deadline_issues_the_next_wave() -> None:
    p = gateway_policy()
    assert wave_budget(p) == 190.0
    sup = Supervisor([0, 1], p)
    sup.workers = {w: WorkerState(w, Phase.READY, pid=7 + w) for w in (0, 1)}
    sup.workers[0] = WorkerState(0, Phase.STARTING, pid=7, launched_at=WAVE_AT + 1e6)
    sup.rolling = (RollingRestart(RestartReason.MANUAL, ((1,),), wave=(0,), wave_started=WAVE_AT),)
    due = sup.next_deadline(WAVE_AT)
    assert due is not None and due - WAVE_AT == pytest.approx(190.0)
    assert sup.rolling[0].wave == (0,)
    sup.tick(due)
    assert sup.rolling[0].wave == (1,)  # the wave ran out of time: the next one goes


def test_a_stop_is_done_once_each_worker_runs_nothing_and_starts_nothing() -> None:
    sup = Supervisor([0, 1, 2], gateway_policy())
    sup.start([0, 1, 2], 0.0)
    for w in (0, 1, 2):
        bring_up(sup, w, 1.0)
    assert not sup.stopping() and not sup.stopped([0])
    sup.handle(0, StopRequested(), 2.0)  # drains first
    assert sup.stopping() and not sup.stopped([0])
    sup.handle(0, Drained(), 3.0)
    assert sup.stopping() and not sup.stopped([0])
    sup.handle(0, ProcessExited(status=0), 4.0)
    assert sup.stopped([0]) and not sup.stopping()
    sup.handle(1, GpuFailing(1, "gpu lost", "lost"), 5.0)
    sup.handle(1, ProcessExited(status=-15), 6.0)  # QUARANTINED: runs nothing
    assert sup.stopped([0, 1, 99])  # 99: not a worker (a reload removed it)
    assert not sup.stopped([0, 1, 2])
    # A restart is not a stop: PENDING starts again by itself.
    sup.handle(2, RestartRequested(RestartReason.MANUAL, drain=False), 7.0)
    sup.handle(2, ProcessExited(status=0), 8.0)
    assert not sup.stopped([2])


def test_adopted_workers_that_drifted_from_the_config_are_named_for_a_restart() -> None:
    now = {1: ("python", "--port", "1"), 2: ("python", "--port", "2"), 3: ("python", "-x")}
    found: dict[int, tuple[str, ...] | None] = {
        1: ("python", "--port", "1"),  # as the config renders it
        2: ("python", "--port", "9"),  # edited while the agent was down
        3: None,  # the runtime cannot tell
        4: ("python", "--old"),  # running, but not adopted
    }
    assert drifted_workers({1, 2, 3}, found, now.__getitem__) == [2]
    assert drifted_workers({1, 2, 3}, found, now.__getitem__, secrets_changed={3, 1}) == [1, 2, 3]


# ---- the host held out of the gateway (issue 26 item 2: farmctl drain-host) -----------------
# drain-host holds every worker of the host out of the gateway without stopping it;
# planned stops, restarts and rollouts keep working meanwhile; undrain-host lets them in.


def serving(ids: list[int], policy: Policy | None = None) -> Supervisor:
    """Every worker READY and routed to."""
    sup = Supervisor(ids, policy or gateway_policy())
    sup.start(ids, 0.0)
    for _ in range(len(ids)):
        for w in ids:
            if sup.workers[w].phase is Phase.STARTING:
                sup.handle(w, Launched(pid=1000 + w), 1.0)
                sup.handle(w, HealthPassed(), 1.0)
                sup.handle(w, GatewayMembership(True), 1.0)
    assert all(s.phase is Phase.READY for s in sup.workers.values())
    return sup


def test_a_held_out_worker_is_not_wanted_in_the_gateway_even_when_ready() -> None:
    s = WorkerState(3).enter(Phase.READY, 1.0)
    assert wants_in_gateway(s)
    assert not wants_in_gateway(replace(s, held_out=True))


def test_drain_host_holds_every_worker_out_and_stops_none() -> None:
    sup = serving([0, 1, 2])
    actions = sup.hold_out(True, 5.0)
    assert sup.held_out and sup.held_out_since == 5.0
    assert all(s.held_out for s in sup.workers.values())
    assert all(s.phase is Phase.READY for s in sup.workers.values())  # still running
    assert not [a for a in actions if not isinstance(a, Note)]  # no stop, no drain action
    assert Note("host_held_out", {"workers": [0, 1, 2]}) in actions
    assert not any(wants_in_gateway(s) for s in sup.workers.values())
    # The same again changes nothing and says nothing.
    assert sup.hold_out(True, 6.0) == [] and sup.held_out_since == 5.0


def test_undrain_host_lets_every_ready_worker_back_in() -> None:
    sup = serving([0, 1, 2])
    sup.hold_out(True, 5.0)
    actions = sup.hold_out(False, 9.0)
    assert not sup.held_out and sup.held_out_since is None
    assert all(wants_in_gateway(s) for s in sup.workers.values())
    assert Note("host_back_in", {"workers": [0, 1, 2]}) in actions


def test_a_worker_added_by_a_reload_while_held_out_is_held_out_too() -> None:
    sup = serving([0, 1])
    sup.hold_out(True, 5.0)
    sup.reconfigure(sup.policy, added=[2], removed=[])
    assert sup.workers[2].held_out


def test_a_restart_while_held_out_comes_back_ready_but_stays_out() -> None:
    sup = serving([0, 1])
    sup.hold_out(True, 5.0)
    sup.handle(0, GatewayMembership(False), 5.0)
    # A planned stop drains as before: not in the gateway, so at once to its requests.
    assert Drain(0) in sup.handle(0, StopRequested(), 6.0)
    sup.handle(0, Drained(), 7.0)
    sup.handle(0, ProcessExited(0), 8.0)
    assert phase(sup, 0) is Phase.STOPPED and sup.workers[0].held_out
    sup.start([0], 9.0)
    sup.handle(0, Launched(pid=5), 10.0)
    sup.handle(0, HealthPassed(), 11.0)
    assert phase(sup, 0) is Phase.READY and not wants_in_gateway(sup.workers[0])


def test_a_rolling_restart_while_held_out_does_not_wait_for_the_gateway() -> None:
    """A held-out worker never rejoins: its wave is settled once it is ready again, not
    after the wave budget (the upgrade of a drained host restarts every worker)."""
    p = gateway_policy()
    sup = serving(
        [0, 1, 2],
        Policy(replace(p.startup, parallel=1), p.health, p.restart, drain_timeout=p.drain_timeout),
    )
    sup.hold_out(True, 5.0)
    for w in (0, 1, 2):
        sup.handle(w, GatewayMembership(False), 5.0)
    sup.restart_rolling([0, 1, 2], RestartReason.CONFIG, 6.0)  # wave 1: the canary, 0
    sup.handle(0, Drained(), 6.5)
    sup.handle(0, ProcessExited(0), 7.0)
    sup.handle(0, Launched(pid=9), 7.5)
    actions = sup.handle(0, HealthPassed(), 8.0)
    assert Drain(1) in actions  # the next wave at once, not after the wave budget
    assert phase(sup, 1) is Phase.DRAINING


def test_a_restart_asked_while_the_farm_stops_a_worker_for_a_failure_keeps_the_failure() -> None:
    """Issue 31 item 3: a canary's OOM while serving (the farm stopping it), then its
    rollback's restart: the exit went to PENDING and the OOM was forgotten (`why`: no
    failure recorded). It stays the worker's last failure, dated when it was seen."""
    from sglang_farm.workers.supervisor import FailureSeen

    serving_oom = Failure(FailureKind.CUDA_OOM_SERVING, "CUDA out of memory while serving", "")
    s = WorkerState(0, Phase.READY, since=0.0, pid=7, launched_at=0.0, ever_ready=True)
    s = step(s, FailureSeen(serving_oom), 10.0, policy()).state
    assert s.phase is Phase.STOPPING and s.pending_failure == serving_oom
    s = step(s, RestartRequested(RestartReason.CONFIG), 12.0, policy()).state
    done = step(s, ProcessExited(-15), 14.0, policy()).state
    assert done.phase is Phase.PENDING
    assert done.last_failure == serving_oom and done.last_failure_at == 10.0
    assert done.pending_failure is None
    # A plain restart (no failure under way) keeps the earlier failure and its time.
    before = WorkerState(
        0, Phase.READY, since=0.0, pid=7, ever_ready=True, last_failure=OOM, last_failure_at=3.0
    )
    s = step(before, RestartRequested(RestartReason.MANUAL), 20.0, policy()).state
    done = step(s, ProcessExited(-15), 21.0, policy()).state
    assert done.phase is Phase.PENDING
    assert done.last_failure == OOM and done.last_failure_at == 3.0


def test_a_failure_is_past_once_the_worker_served_or_the_operator_reset_it() -> None:
    """Issue 31 item 4: `why` said "gave up after 6 failures" of a worker that had served
    since. The last failure stays (when, what), marked past: served since, or reset."""
    from sglang_farm.workers.supervisor import FailurePast

    p = policy()
    failed = WorkerState(
        3, Phase.FAILED, since=5.0, failures=4, last_failure=OOM, last_failure_at=5.0
    )
    # An operator's start or restart of the failed worker, or reset-oom: reset.
    assert step(failed, StartRequested(), 9.0, p).state.failure_past is FailurePast.RESET
    assert step(failed, StartRequested(fresh=False), 9.0, p).state.failure_past is None
    again = step(failed, RestartRequested(RestartReason.MANUAL), 9.0, p).state
    assert again.failure_past is FailurePast.RESET
    sup = Supervisor([3], p)
    sup.restore(3, failed)
    sup.reset_oom(3)
    assert sup.workers[3].failure_past is FailurePast.RESET
    # Ready again: served since (which stays over a later reset).
    starting = WorkerState(
        3,
        Phase.STARTING,
        since=10.0,
        pid=5,
        launched_at=10.0,
        last_failure=OOM,
        last_failure_at=5.0,
        failure_past=FailurePast.RESET,
    )
    ready = step(starting, HealthPassed(), 20.0, p).state
    assert ready.phase is Phase.READY and ready.failure_past is FailurePast.SERVED
    assert ready.last_failure == OOM and ready.last_failure_at == 5.0
    sup.restore(3, ready)
    sup.reset_oom(3)
    served = sup.workers[3]
    assert served.failure_past is FailurePast.SERVED
    stopped = step(
        step(ready, StopRequested(drain=False), 30.0, p).state, ProcessExited(0), 31.0, p
    ).state
    assert stopped.phase is Phase.STOPPED and stopped.failure_past is FailurePast.SERVED
    # Without a failure there is no past to mark.
    fresh = WorkerState(3, Phase.STARTING, since=0.0, pid=5, launched_at=0.0)
    assert step(fresh, HealthPassed(), 1.0, p).state.failure_past is None
    assert step(WorkerState(3, Phase.FAILED), StartRequested(), 1.0, p).state.failure_past is None
    # A new failure is the present one: while running, and at the exit.
    crashed = step(ready, ProcessExited(1), 40.0, p).state
    assert crashed.last_failure_at == 40.0 and crashed.failure_past is None
    from sglang_farm.workers.supervisor import FailureSeen

    seen = step(ready, FailureSeen(BAD_FLAG), 41.0, p).state
    assert seen.last_failure == BAD_FLAG and seen.failure_past is None
    # Not a reset: a start of a stopped worker, a restart of one backing off; a restart
    # through a stop keeps the word, one asked while the farm stops it for a failure not.
    stopped_failed = replace(failed, phase=Phase.STOPPED)
    assert step(stopped_failed, StartRequested(), 50.0, p).state.failure_past is None
    backoff = replace(failed, phase=Phase.BACKOFF)
    restart = RestartRequested(RestartReason.MANUAL)
    assert step(backoff, restart, 50.0, p).state.failure_past is None
    through = step(step(ready, restart, 50.0, p).state, ProcessExited(-15), 51.0, p).state
    assert through.phase is Phase.PENDING and through.failure_past is FailurePast.SERVED
    failing = step(ready, FailureSeen(replace(OOM, kind=FailureKind.CUDA_OOM_SERVING)), 52.0, p)
    assert failing.state.phase is Phase.STOPPING
    gone = step(step(failing.state, restart, 53.0, p).state, ProcessExited(-15), 54.0, p).state
    assert gone.last_failure_at == 52.0 and gone.failure_past is None


def test_a_canary_rolled_back_is_drained_and_restarted_on_its_old_oom_step() -> None:
    """RolledBack (the canary put back on the accepted config): one event of the core
    sets the OOM step it had before the change and restarts it, drained first: the
    canary driver no longer rewrites the supervisor's state (issue 32 §1)."""
    p = gateway_policy()
    serving = WorkerState(0, phase=Phase.READY, oom_step=2, in_gateway=True)
    d = step(serving, RolledBack(oom_step=0), 10.0, p)
    assert d.state.phase is Phase.DRAINING and d.state.oom_step == 0
    assert d.state.stop_intent is StopIntent.RESTART
    assert d.state.next_reason is RestartReason.CONFIG
    failed = WorkerState(0, phase=Phase.FAILED, oom_step=1, failures=3)
    d = step(failed, RolledBack(oom_step=0), 10.0, p)  # the change broke it: started at once
    assert d.state.phase is Phase.PENDING and d.state.oom_step == 0 and d.state.failures == 0


def test_a_canary_an_operator_stopped_stays_stopped_when_rolled_back() -> None:
    """An operator's stop stands: the rollback only puts its OOM step back."""
    stopped = WorkerState(0, phase=Phase.STOPPED, oom_step=2)
    d = step(stopped, RolledBack(oom_step=1), 10.0, gateway_policy())
    assert d.state == replace(stopped, oom_step=1) and d.actions == ()


def test_a_rolled_back_canarys_step_is_its_own_and_spreads_to_no_other_worker() -> None:
    """With `scope = "all"`, putting the canary back on the OOM step it had before the
    change (higher than its current one after a `reset-oom` in the window) is no OOM of
    the farm: no other worker takes it, no rolling restart (the review's finding: the old
    restore() skipped the spread; the event must too)."""
    p = Policy(
        policy().startup,
        policy().health,
        policy().restart,
        oom_next=lambda step, failure: step + 1,
        oom_all=True,
    )
    sup = Supervisor([0, 1, 2], p)
    for w in (0, 1, 2):
        sup.workers[w] = WorkerState(w, phase=Phase.READY, ready_since=0.0)
    actions = sup.handle(0, RolledBack(oom_step=2), 5.0)
    assert [sup.workers[w].oom_step for w in (0, 1, 2)] == [2, 0, 0]
    assert not [a for a in actions if isinstance(a, Note) and a.event == "oom_step_spread"]
    assert sup.rolling == ()
