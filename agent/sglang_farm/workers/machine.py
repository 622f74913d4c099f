"""Pure: one worker's state machine. Its state, an event and a clock reading in, its new
state and actions out (`step`); the farm's planner (`supervisor.Supervisor`) calls it.
Nothing here awaits, reads a clock or touches a process. Both runtimes (process,
systemd) share these rules.

Worker phases (phase.Phase):

    STOPPED --start--> PENDING --launch--> STARTING --health ok--> READY <--probe ok--> UNHEALTHY
                         ^  ^                  |                   |                     |
                         |  | OOM ladder step  | load timeout      | OOM while serving   | threshold
                         |  |                  v                   v                     v  (hang)
                 back-off|  +----------- failure handling <---- exit <--------------- STOPPING
                 elapsed |                 |          |
                      BACKOFF <------------+          +--> FAILED (crash loop, deterministic
                                                           failure, failed canary)

    Operator stop/restart: any running phase -> STOPPING -> STOPPED / PENDING.

    Planned stop or restart with a gateway (`[gateway] drain_timeout`):

        READY/UNHEALTHY --stop/restart--> DRAINING --drained, or budget spent--> STOPPING

    A failing GPU (`GpuFailing`; `RemapsPending` only at a (re)start):

        STARTING/READY/UNHEALTHY/DRAINING --> STOPPING --exit--> QUARANTINED
        PENDING/BACKOFF/STOPPED/FAILED ----------------------> QUARANTINED
        QUARANTINED --release (the GPU passed its checks)--> PENDING

`step` sends each event to its own handler (`_on_...`); each edge is commented there.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace

from sglang_farm.sglang.failures import Failure, FailureKind, RestartReason, port_taken
from sglang_farm.workers.actions import Action, Drain, Launch, Note, Terminate
from sglang_farm.workers.budgets import (
    backoff_delay,
    backoff_reset_due,
    drain_deadline_due,
    load_deadline_due,
)
from sglang_farm.workers.events import (
    Drained,
    Event,
    FailureSeen,
    GatewayMembership,
    GpuFailing,
    HealthFailed,
    HealthPassed,
    Launched,
    PortTaken,
    ProcessExited,
    ProgressSeen,
    ReleaseRequested,
    RemapsPending,
    RestartRequested,
    RolledBack,
    StartRequested,
    StopRequested,
    Tick,
    Wedged,
)
from sglang_farm.workers.phase import Phase, StopIntent
from sglang_farm.workers.phase_sets import LEAVING, RUNNING, SERVING, set_aside
from sglang_farm.workers.records import FailurePast, GpuQuarantine, Policy, WorkerState

RESTART_HISTORY = 20  # restart records kept per worker (status shows them; totals are separate)


def reset_past(s: WorkerState) -> FailurePast | None:
    """The failure's word after an operator's reset: served since says more, and stays."""
    return (
        FailurePast.RESET
        if s.last_failure is not None and s.failure_past is None
        else s.failure_past
    )


@dataclass(frozen=True, slots=True)
class Decision:
    state: WorkerState
    actions: tuple[Action, ...] = ()


class IllegalTransition(ValueError):
    """An event that makes no sense in the worker's phase; the state is left unchanged."""


def _bump(counts: Mapping[str, int], key: str) -> dict[str, int]:
    out = dict(counts)
    out[key] = out.get(key, 0) + 1
    return out


def _after_failure(s: WorkerState, failure: Failure, now: float, policy: Policy) -> Decision:
    """Record a failure of a worker whose process is gone, and decide what comes next."""
    oom = failure.oom_kind
    s = replace(
        s,
        pid=None,
        failures=s.failures + 1,
        health_failures=0,
        last_failure=failure,
        last_failure_at=now,
        failure_past=None,
        pending_failure=None,
        stop_intent=None,
        oom_events=_bump(s.oom_events, str(oom)) if oom is not None else s.oom_events,
    )
    notes: list[Action] = [
        Note("worker_failed", {"kind": str(failure.kind), "summary": failure.summary})
    ]
    next_step = policy.oom_next(s.oom_step, failure) if oom is not None else None
    if s.failures > policy.restart.max_failures:
        # -> FAILED: crash loop; restarting again would only repeat it.
        action = (
            f"gave up after {s.failures} failures in a row "
            f"({policy.restart.max_failures} restarts allowed: restart.max_failures)"
        )
        return Decision(
            s.enter(Phase.FAILED, now, last_action=action),
            (*notes, Note("worker_gave_up", {"why": action})),
        )
    if next_step is not None:
        # -> PENDING: the OOM ladder has a next step; start again at once with the new flags.
        action = f"stepped the OOM ladder to step {next_step} and restarted"
        s = s.enter(
            Phase.PENDING,
            now,
            oom_step=next_step,
            next_reason=RestartReason.OOM,
            last_action=action,
            retry_at=None,
        )
        return Decision(s, (*notes, Note("oom_ladder_step", {"step": next_step})))
    if failure.deterministic:
        # -> FAILED: the same command line fails the same way; retrying burns a model load.
        action = "not restarted: the same command line would fail the same way"
        return Decision(
            s.enter(Phase.FAILED, now, last_action=action),
            (*notes, Note("worker_gave_up", {"why": action})),
        )
    if s.halt_on_failure and not s.ever_ready:
        # -> FAILED: the canary failed before it was ever ready; the rollout halts here.
        action = "canary failed: the rollout is halted and no other worker was started"
        return Decision(
            s.enter(Phase.FAILED, now, last_action=action),
            (*notes, Note("canary_failed", {"why": failure.summary})),
        )
    delay = backoff_delay(s.failures, policy.restart)
    action = f"restart {s.failures} of {policy.restart.max_failures} scheduled in {delay:g} s"
    s = s.enter(
        Phase.BACKOFF,
        now,
        retry_at=now + delay,
        next_reason=failure.restart_reason,
        last_action=action,
    )
    return Decision(s, (*notes, Note("restart_scheduled", {"in_s": delay, "failures": s.failures})))


def wants_in_gateway(s: WorkerState) -> bool:
    """The core's membership rule: the gateway routes to a worker only while it is READY,
    and its host is not held out of the gateway (`farmctl drain-host`).

    Anything else (loading, unhealthy, draining, stopped, failed) is taken out at once,
    so users' requests go only where the farm itself would send them.
    """
    return s.phase is Phase.READY and not s.held_out


def _begin_drain(
    s: WorkerState, now: float, intent: StopIntent, reason: RestartReason | None
) -> Decision:
    s = s.enter(
        Phase.DRAINING,
        now,
        stop_intent=intent,
        next_reason=reason if reason is not None else s.next_reason,
    )
    return Decision(s, (Drain(s.id), Note("worker_draining", {"then": str(intent)})))


def _end_drain(s: WorkerState, now: float, event: str) -> Decision:
    # DRAINING -> STOPPING: the runtime's stop (SIGTERM, SIGKILL after the stop timeout).
    took = now - s.since
    s = s.enter(Phase.STOPPING, now, last_drain_seconds=took)
    return Decision(s, (Terminate(s.id), Note(event, {"drain_s": round(took, 3)})))


def _terminate_for(s: WorkerState, failure: Failure, now: float) -> Decision:
    # RUNNING -> STOPPING: the farm stops it; its exit is then handled as this failure.
    s = s.enter(Phase.STOPPING, now, stop_intent=StopIntent.FAILURE, pending_failure=failure)
    return Decision(s, (Terminate(s.id), Note("worker_terminating", {"kind": str(failure.kind)})))


def step(s: WorkerState, event: Event, now: float, policy: Policy) -> Decision:
    """One worker's transition: the handler of the event's kind (one per kind, below).
    Raises IllegalTransition for events that make no sense now."""
    match event:
        case GpuFailing():
            return _on_gpu_failing(s, event, now)
        case RemapsPending():
            return _on_remaps_pending(s, event, now)
        case ReleaseRequested():
            return _on_release(s, now)
        case StartRequested():
            return _on_start(s, event, now)
        case StopRequested():
            return _on_stop(s, event, now, policy)
        case RestartRequested():
            return _on_restart(s, event, now, policy)
        case RolledBack():
            return _on_rolled_back(s, event, now, policy)
        case Launched():
            return _on_launched(s, event)
        case HealthPassed():
            return _on_health_passed(s, now)
        case HealthFailed():
            return _on_health_failed(s, event, now, policy)
        case ProgressSeen():
            return _on_progress(s, now)
        case Wedged():
            return _on_wedged(s, event, now)
        case PortTaken():
            return _on_port_taken(s, event, now)
        case FailureSeen():
            return _on_failure_seen(s, event, now)
        case Drained():
            return _on_drained(s, now)
        case GatewayMembership():
            return _on_membership(s, event)
        case ProcessExited():
            return _on_exit(s, event, now, policy)
        case Tick():
            return _on_tick(s, now, policy)
    raise IllegalTransition(f"worker {s.id}: unknown event {event!r}")


def _set_aside(s: WorkerState) -> bool:
    return set_aside(s.phase, s.stop_intent)


def _on_gpu_failing(s: WorkerState, event: GpuFailing, now: float) -> Decision:
    gpu, reason, detail = event.gpu, event.reason, event.detail
    if _set_aside(s):
        return Decision(s)  # set aside already: the first reason stands
    q = GpuQuarantine(gpu, reason, detail, now)
    s = replace(
        s,
        quarantine=q,
        quarantines_by_reason=_bump(s.quarantines_by_reason, reason),
        last_action=f"GPU {gpu} quarantined ({reason}); not restarted until released",
    )
    note = Note("gpu_quarantined", {"reason": reason, "detail": detail})
    if s.phase in (*RUNNING, Phase.DRAINING):
        # RUNNING -> STOPPING: out of service; its exit leads to QUARANTINED.
        s = s.enter(Phase.STOPPING, now, stop_intent=StopIntent.QUARANTINE)
        return Decision(s, (Terminate(s.id), note))
    if s.phase is Phase.STOPPING:
        return Decision(replace(s, stop_intent=StopIntent.QUARANTINE), (note,))
    # PENDING/BACKOFF/STOPPED/FAILED -> QUARANTINED: nothing runs; never started.
    return Decision(s.enter(Phase.QUARANTINED, now, retry_at=None), (note,))


def _on_remaps_pending(s: WorkerState, event: RemapsPending, now: float) -> Decision:
    if s.phase not in (Phase.PENDING, Phase.BACKOFF):
        # A running worker keeps its GPU (the remap applies at the GPU's next reset); a
        # stopped one is judged again when it is wanted.
        return Decision(s)
    # PENDING/BACKOFF -> QUARANTINED: at a (re)start, a GPU with row remaps pending needs
    # a reset first.
    failing = GpuFailing(
        event.gpu,
        "pending row remaps",
        "NVML reports row remaps pending: reset the GPU before it is used",
    )
    return _on_gpu_failing(s, failing, now)


def _on_release(s: WorkerState, now: float) -> Decision:
    if s.phase is not Phase.QUARANTINED:
        return Decision(s)
    # QUARANTINED -> PENDING: the GPU passed its checks; start afresh.
    return Decision(
        s.enter(Phase.PENDING, now, quarantine=None, failures=0, retry_at=None),
        (Note("gpu_released"),),
    )


def _on_start(s: WorkerState, event: StartRequested, now: float) -> Decision:
    if _set_aside(s):
        # QUARANTINED stays (and a stop for its GPU goes on): only a release, after the
        # GPU's checks, starts it again.
        return Decision(s, (Note("worker_quarantined_not_started"),))
    if s.phase in (Phase.STOPPED, Phase.FAILED):
        # STOPPED/FAILED -> PENDING: wanted again; the rollout planner launches it.
        return Decision(
            s.enter(
                Phase.PENDING,
                now,
                failures=0 if event.fresh else s.failures,
                retry_at=None,
                next_reason=s.next_reason if s.phase is Phase.FAILED else None,
                failure_past=reset_past(s)
                if event.fresh and s.phase is Phase.FAILED
                else s.failure_past,
            )
        )
    if s.phase is Phase.BACKOFF:
        # BACKOFF -> PENDING: an operator asked; skip the rest of the wait.
        return Decision(s.enter(Phase.PENDING, now, retry_at=None))
    return Decision(s)  # already wanted


def _on_stop(s: WorkerState, event: StopRequested, now: float, policy: Policy) -> Decision:
    drain = event.drain
    if _set_aside(s):
        # Stopped already, or stopping for its GPU: it must end set aside (QUARANTINED),
        # never STOPPED with its quarantine still recorded (a start would then run it).
        return Decision(s)
    if s.phase in SERVING and drain and policy.drain_timeout is not None:
        # READY -> DRAINING: out of the gateway, its requests finish, then the stop.
        return _begin_drain(s, now, StopIntent.STOP, None)
    if s.phase is Phase.DRAINING:
        s = replace(s, stop_intent=StopIntent.STOP)
        return Decision(s) if drain else _end_drain(s, now, "drain_skipped")
    if s.phase in RUNNING:
        # RUNNING -> STOPPING: operator stop.
        return Decision(
            s.enter(Phase.STOPPING, now, stop_intent=StopIntent.STOP), (Terminate(s.id),)
        )
    if s.phase is Phase.STOPPING:
        return Decision(replace(s, stop_intent=StopIntent.STOP))
    # PENDING/BACKOFF/FAILED -> STOPPED: nothing runs; forget the scheduled start.
    return Decision(
        s.enter(Phase.STOPPED, now, retry_at=None) if s.phase is not Phase.STOPPED else s
    )


def _on_restart(s: WorkerState, event: RestartRequested, now: float, policy: Policy) -> Decision:
    reason, drain = event.reason, event.drain
    if _set_aside(s):
        # QUARANTINED stays (and a stop for its GPU goes on): only a release, after the
        # GPU's checks, starts it again.
        return Decision(s, (Note("worker_quarantined_not_started"),))
    if s.phase in SERVING and drain and policy.drain_timeout is not None:
        # READY -> DRAINING: out of the gateway, its requests finish, then the restart.
        return _begin_drain(s, now, StopIntent.RESTART, reason)
    if s.phase is Phase.DRAINING:
        s = replace(s, stop_intent=StopIntent.RESTART, next_reason=reason)
        return Decision(s) if drain else _end_drain(s, now, "drain_skipped")
    if s.phase in RUNNING:
        # RUNNING -> STOPPING: restart = stop, then start at once.
        s = s.enter(Phase.STOPPING, now, stop_intent=StopIntent.RESTART, next_reason=reason)
        return Decision(s, (Terminate(s.id),))
    if s.phase is Phase.STOPPING:
        return Decision(replace(s, stop_intent=StopIntent.RESTART, next_reason=reason))
    # STOPPED/BACKOFF/FAILED/PENDING -> PENDING: nothing to stop; start it.
    return Decision(
        s.enter(
            Phase.PENDING,
            now,
            retry_at=None,
            failures=0 if s.phase is Phase.FAILED else s.failures,
            next_reason=reason,
            failure_past=reset_past(s) if s.phase is Phase.FAILED else s.failure_past,
        )
    )


def _on_rolled_back(s: WorkerState, event: RolledBack, now: float, policy: Policy) -> Decision:
    """The canary back on the accepted config: its OOM step as before the change; from
    serving drained first, from BACKOFF or FAILED (the change broke it) straight to a
    launch, with the accepted config's command (the launcher reads it then). An
    operator's stop stands."""
    s = replace(s, oom_step=event.oom_step)
    if s.phase is Phase.STOPPED:
        return Decision(s)
    return _on_restart(s, RestartRequested(RestartReason.CONFIG), now, policy)


def _on_launched(s: WorkerState, event: Launched) -> Decision:
    if s.phase is not Phase.STARTING:
        raise IllegalTransition(f"worker {s.id}: launched while {s.phase}")
    return Decision(replace(s, pid=event.pid), (Note("worker_launched", {"pid": event.pid}),))


def _on_health_passed(s: WorkerState, now: float) -> Decision:
    if s.phase is Phase.STARTING:
        # STARTING -> READY: /health answered 200 within the load deadline.
        load = now - s.launched_at if s.launched_at is not None else None
        s = s.enter(
            Phase.READY,
            now,
            ready_since=now,
            ever_ready=True,
            health_failures=0,
            last_load_seconds=load,
            halt_on_failure=False,
            failure_past=FailurePast.SERVED if s.last_failure is not None else None,
        )
        return Decision(s, (Note("worker_ready", {"load_s": round(load or 0.0, 3)}),))
    if s.phase is Phase.UNHEALTHY:
        # UNHEALTHY -> READY: a probe passed again before the threshold.
        return Decision(
            s.enter(Phase.READY, now, health_failures=0, busy=False),
            (Note("worker_recovered"),),
        )
    return Decision(replace(s, health_failures=0, busy=False))


def _on_progress(s: WorkerState, now: float) -> Decision:
    return Decision(replace(s, progress_at=now) if s.phase in SERVING else s)


def _on_wedged(s: WorkerState, event: Wedged, now: float) -> Decision:
    if s.phase not in SERVING:
        return Decision(s)  # loading, stopping or gone: the load deadline and exits judge it
    # READY -> STOPPING: requests run, nothing advances: a wedged engine.
    failure = Failure(
        FailureKind.HANG,
        f"wedged: {event.detail}",
        "the farm restarts it even though /health answered; if it recurs, look at "
        "`farmctl logs` for CUDA errors and at GPU health (XID errors)",
    )
    return _terminate_for(replace(s, busy=False), failure, now)


def _busy(s: WorkerState, event: HealthFailed, now: float, policy: Policy) -> bool:
    """Its counters advanced after the failed probe was sent, within the busy window."""
    return (
        s.phase in SERVING
        and s.progress_at is not None
        and event.started is not None
        and s.progress_at > event.started
        and now - s.progress_at <= policy.health.busy_window
    )


def _on_health_failed(s: WorkerState, event: HealthFailed, now: float, policy: Policy) -> Decision:
    detail = event.detail
    if _busy(s, event, now, policy):
        # READY stays (UNHEALTHY -> READY): its /health is slow behind a batch while
        # its counters advance: busy, and the failure is excused.
        busy_note: tuple[Action, ...] = () if s.busy else (Note("worker_busy", {"detail": detail}),)
        if s.phase is Phase.UNHEALTHY:
            return Decision(s.enter(Phase.READY, now, busy=True, health_failures=0), busy_note)
        return Decision(replace(s, busy=True, health_failures=0), busy_note)
    if s.phase in SERVING:
        n = s.health_failures + 1
        if n >= policy.health.failure_threshold:
            # UNHEALTHY -> STOPPING: `failure_threshold` failed probes in a row: a hang.
            failure = Failure(
                FailureKind.HANG,
                f"health probe failed {n} times in a row ({detail})",
                "the farm restarts it; if it recurs, look at `farmctl logs` for a stuck "
                "scheduler and at GPU health (XID errors)",
            )
            return _terminate_for(replace(s, health_failures=n, busy=False), failure, now)
        # READY -> UNHEALTHY: a probe failed, below the threshold, not excused: an earlier
        # probe's busy excuse no longer holds.
        ns = (
            s.enter(Phase.UNHEALTHY, now, health_failures=n, busy=False)
            if s.phase is Phase.READY
            else replace(s, health_failures=n, busy=False)
        )
        return Decision(ns, (Note("health_failed", {"count": n, "detail": detail}),))
    return Decision(s)  # while loading, a refused connection is normal


def _on_port_taken(s: WorkerState, event: PortTaken, now: float) -> Decision:
    if s.phase not in RUNNING:
        return Decision(s)  # a verdict on a process already being stopped, or gone
    # RUNNING -> STOPPING: another process holds its port; SGLang cannot bind it
    # (a load that would fail at its end), and whatever answers is not the worker.
    return _terminate_for(s, port_taken(event.port, event.holder, s.id), now)


def _on_failure_seen(s: WorkerState, event: FailureSeen, now: float) -> Decision:
    failure = event.failure
    if s.phase in RUNNING and failure.oom_kind is not None and s.ever_ready:
        # READY -> STOPPING: SGLang may survive a CUDA OOM while serving; the farm restarts
        # (with the next OOM-ladder step, decided when the exit is handled).
        return _terminate_for(s, failure, now)
    return Decision(
        replace(s, last_failure=failure, last_failure_at=now, failure_past=None)
        if s.phase in RUNNING
        else s
    )


def _on_drained(s: WorkerState, now: float) -> Decision:
    if s.phase is Phase.DRAINING:
        # DRAINING -> STOPPING: out of the gateway and idle; now the stop.
        return _end_drain(s, now, "worker_drained")
    return Decision(s)


def _on_membership(s: WorkerState, event: GatewayMembership) -> Decision:
    return Decision(replace(s, in_gateway=event.member))


def _on_exit(s: WorkerState, event: ProcessExited, now: float, policy: Policy) -> Decision:
    status, failure = event.status, event.failure
    if s.phase in LEAVING:
        # (a draining worker that exits on its own has done what was asked)
        intent = s.stop_intent
        if intent is StopIntent.QUARANTINE:
            # STOPPING -> QUARANTINED: stopped because its GPU is failing.
            return Decision(
                s.enter(Phase.QUARANTINED, now, pid=None, stop_intent=None, health_failures=0),
                (Note("worker_quarantined"),),
            )
        if intent is StopIntent.STOP:
            # STOPPING -> STOPPED: operator stop done.
            return Decision(
                s.enter(Phase.STOPPED, now, pid=None, stop_intent=None, health_failures=0),
                (Note("worker_stopped"),),
            )
        if intent is StopIntent.RESTART:
            # STOPPING -> PENDING: restart; start again at once. A failure the farm was
            # stopping it for when the restart was asked (a canary's OOM, then its
            # rollback) stays its last failure: `why` names it (issue 31).
            failed = s.pending_failure
            return Decision(
                s.enter(
                    Phase.PENDING,
                    now,
                    pid=None,
                    stop_intent=None,
                    health_failures=0,
                    pending_failure=None,
                    last_failure=failed or s.last_failure,
                    last_failure_at=s.last_failure_at if failed is None else s.since,
                    failure_past=s.failure_past if failed is None else None,
                )
            )
        return _after_failure(s, s.pending_failure or _crash(status), now, policy)
    if s.phase in RUNNING:
        # RUNNING -> failure handling: it exited on its own.
        return _after_failure(s, failure or _crash(status), now, policy)
    return Decision(s)  # a late exit report for a process already accounted for


def _on_tick(s: WorkerState, now: float, policy: Policy) -> Decision:
    load_at = load_deadline_due(s, policy)
    if load_at is not None and now >= load_at:
        # STARTING -> STOPPING: not ready within startup.load_timeout.
        failure = Failure(
            FailureKind.LOAD_TIMEOUT,
            f"not ready {policy.startup.load_timeout:g} s after launch (startup.load_timeout)",
            "look at `farmctl logs` for where loading stopped; raise "
            "startup.load_timeout if the model simply needs longer",
        )
        return _terminate_for(s, failure, now)
    drain_at = drain_deadline_due(s, policy)
    if drain_at is not None and now >= drain_at:
        # DRAINING -> STOPPING: the drain budget is spent; stop it with what it runs.
        return _end_drain(s, now, "drain_budget_expired")
    if s.phase is Phase.BACKOFF and s.retry_at is not None and now >= s.retry_at:
        # BACKOFF -> PENDING: the back-off delay has passed.
        return Decision(s.enter(Phase.PENDING, now, retry_at=None))
    reset_at = backoff_reset_due(s, policy)
    if reset_at is not None and now >= reset_at:
        # READY, stable for reset_after: the back-off starts over.
        return Decision(replace(s, failures=0), (Note("backoff_reset"),))
    return Decision(s)


def _crash(status: int | None) -> Failure:
    how = (
        "with no exit status"
        if status is None
        else (f"killed by signal {-status}" if status < 0 else f"with exit status {status}")
    )
    return Failure(
        FailureKind.CRASH,
        f"the process exited {how} and its log shows no known failure",
        "read `farmctl logs` for the last lines before the exit",
    )


def launch(s: WorkerState, now: float) -> Decision:
    """PENDING -> STARTING: the planner gave this worker a loading slot."""
    if s.phase is not Phase.PENDING:
        raise IllegalTransition(f"worker {s.id}: launch while {s.phase}")
    restarts, by_reason = s.restarts, s.restarts_by_reason
    notes: list[Action] = []
    if s.next_reason is not None:
        restarts = (*s.restarts, (now, str(s.next_reason)))[-RESTART_HISTORY:]
        by_reason = _bump(s.restarts_by_reason, str(s.next_reason))
        notes.append(Note("worker_restarting", {"reason": str(s.next_reason)}))
    s = s.enter(
        Phase.STARTING,
        now,
        launched_at=now,
        ready_since=None,
        health_failures=0,
        progress_at=None,
        busy=False,
        pid=None,
        next_reason=None,
        restarts=restarts,
        restarts_by_reason=by_reason,
    )
    return Decision(s, (*notes, Launch(s.id)))


def restored_quarantine(
    s: WorkerState, phase: Phase | None, gpus: Collection[int]
) -> tuple[WorkerState, Phase | None, str | None]:
    """Pure: a remembered quarantine judged against the GPUs the config gives the worker now.

    Returns the state and phase to restore, and why a quarantine was dropped (None: nothing
    dropped). A quarantine is released by naming its GPU (`release-gpu G`), so one that
    names no GPU (a QUARANTINED phase without its record), or a GPU the worker no longer
    uses (the config moved it), could be released by nothing and would hold the worker
    for good: it is dropped, and the worker starts as any other. Its history
    (`quarantines_by_reason`) stays. A GPU left failing shows again at NVML's next look
    (lost, unhealthy) or at the worker's start (row remaps pending).
    """
    q = s.quarantine
    if q is None and phase is Phase.QUARANTINED:
        why = (
            "the state file says quarantined but keeps no record of the GPU or the reason, "
            "so nothing could release it"
        )
    elif q is not None and q.gpu not in gpus:
        now_on = ", ".join(str(g) for g in sorted(gpus))
        why = (
            f"the config puts the worker on GPU {now_on} and it no longer uses GPU {q.gpu}, "
            "the one the quarantine names"
        )
    elif q is not None:
        # A record without the phase: the agent went while it stopped the worker for its
        # GPU (STOPPING is not remembered). The farm's decision stands: QUARANTINED (held;
        # `Supervisor.adopt` finishes the stop of a worker still running).
        return s, Phase.QUARANTINED, None
    else:
        return s, phase, None
    where = f" on GPU {q.gpu} ({q.reason})" if q is not None else ""
    s = replace(
        s,
        quarantine=None,
        last_action=f"quarantine{where} dropped at agent start: {why}",
    )
    return s, (None if phase is Phase.QUARANTINED else phase), why
