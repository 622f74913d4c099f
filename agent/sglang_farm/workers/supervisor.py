"""Pure: the supervisor's decisions. Events and a clock reading in, new state and actions out.

One state machine per worker (`step`), and a farm-level `Supervisor` that owns the
rollout (canary first, then at most `parallel` workers loading at once) and turns
PENDING workers into launches. Nothing here awaits, reads a clock or touches a
process: the agent (`agent.py`) feeds events from the runtime and the health
probes, passes `now` (monotonic seconds), and carries out the returned actions.
Both runtimes (process, systemd) share these rules.

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

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

from sglang_farm.sglang.failures import Failure, FailureKind, RestartReason, port_taken
from sglang_farm.spec import FarmSpec, HealthPolicy, RestartPolicy, StartupPolicy
from sglang_farm.workers.phase import Phase
from sglang_farm.workers.phase import StopIntent as StopIntent  # re-exported
from sglang_farm.workers.phase_sets import HELD, LEAVING, RUNNING, SERVING, set_aside

RESTART_HISTORY = 20  # restart records kept per worker (status shows them; totals are separate)


class Rollout(StrEnum):
    IDLE = "idle"  # the farm has not been started
    CANARY = "canary"  # only the canary may load
    ROLLING = "rolling"  # the others load, at most `parallel` at once
    DONE = "done"  # every wanted worker has settled (ready or failed)
    HALTED = "halted"  # the canary failed: nothing else starts until an operator starts again


@dataclass(frozen=True, slots=True)
class RollingRestart:
    """Planned restarts of several workers, one wave at a time, so the rest keep serving.

    The next wave is issued once every worker of the current one has settled (serving
    again, and back in the gateway when there is one; or failed, or stopped), or
    when the wave has run out of time.
    """

    reason: RestartReason
    waves: tuple[tuple[int, ...], ...]  # not yet issued, in order
    wave: tuple[int, ...] = ()  # issued, not yet settled
    wave_started: float = 0.0
    drain: bool = True  # planned: drained out of the gateway first
    # Issue 23: the canary's verdict (canary/driver.py) releases the waves after the first.
    gated: bool = False


def plan_waves(
    worker_ids: Sequence[int], canary: int | None, parallel: int
) -> tuple[tuple[int, ...], ...]:
    """Pure: the canary alone first (as in a first rollout), then waves of `parallel`.

    Without the canary among them, a wave never takes all of `worker_ids` at once.
    """
    ids = list(worker_ids)
    waves: list[tuple[int, ...]] = []
    if canary is not None and canary in ids and len(ids) > 1:
        ids.remove(canary)
        waves.append((canary,))
        size = max(1, parallel)
    else:
        size = max(1, min(parallel, len(ids) - 1))
    waves += [tuple(ids[i : i + size]) for i in range(0, len(ids), size)]
    return tuple(waves)


@dataclass(frozen=True, slots=True)
class Adoption:
    """What a restarted agent found: workers it adopted and workers it keeps held."""

    adopted: frozenset[int]
    held: frozenset[int]  # failed or stopped before the agent restarted: not started again
    actions: tuple[Action, ...] = ()


def drifted_workers(
    adopted: Collection[int],
    argv: Mapping[int, Sequence[str] | None],
    argv_now: Callable[[int], Sequence[str]],
    secrets_changed: Collection[int] = (),
) -> list[int]:
    """Pure: the adopted workers to restart onto the config as it is now: those running
    another command line than it renders (`argv`: each one's as found; None: the runtime
    cannot tell), and those whose secrets changed while the agent was down (the argv
    does not show them)."""
    return sorted(
        w
        for w in adopted
        if w in secrets_changed or ((found := argv.get(w)) is not None and found != argv_now(w))
    )


class FailurePast(StrEnum):
    """Why a worker's last failure is its past, not what ails it now (issue 31: `why`
    repeated a crash loop's "gave up" after the worker had served again)."""

    SERVED = "served"  # it has served (been ready) since
    RESET = "reset"  # the operator reset it since: reset-oom, a start or restart while failed


def _reset(s: WorkerState) -> FailurePast | None:
    """The failure's word after an operator's reset: served since says more, and stays."""
    return (
        FailurePast.RESET
        if s.last_failure is not None and s.failure_past is None
        else s.failure_past
    )


# ---- events -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Launched:
    """The runtime launched the worker's process."""

    pid: int | None


@dataclass(frozen=True, slots=True)
class ProcessExited:
    """The worker's process tree is gone. `failure` is the classifier's verdict, if any."""

    status: int | None
    failure: Failure | None = None


@dataclass(frozen=True, slots=True)
class HealthPassed:
    pass


@dataclass(frozen=True, slots=True)
class HealthFailed:
    detail: str
    # When the failed probe was sent (the supervisor's clock); None: unknown. A failure
    # is excused as busy only by counter progress seen after this.
    started: float | None = None


@dataclass(frozen=True, slots=True)
class FailureSeen:
    """The log shows a failure while the process still runs (SGLang survives some CUDA OOMs)."""

    failure: Failure


@dataclass(frozen=True, slots=True)
class StartRequested:
    """An operator's start resets the back-off; the agent's own start after a restart keeps it."""

    fresh: bool = True


@dataclass(frozen=True, slots=True)
class StopRequested:
    """Stop it. With a gateway, a serving worker drains first unless `drain` is False."""

    drain: bool = True


@dataclass(frozen=True, slots=True)
class RestartRequested:
    reason: RestartReason
    drain: bool = True


@dataclass(frozen=True, slots=True)
class GpuQuarantine:
    """Why a worker's GPU is set aside: `reason` short ("xid 79", "gpu lost"), `detail`
    the catalog's words or NVML's error, `at` the supervisor's clock."""

    gpu: int
    reason: str
    detail: str
    at: float = 0.0


@dataclass(frozen=True, slots=True)
class GpuFailing:
    """The worker's GPU cannot be trusted (a reset-class XID, lost, pending row remaps)."""

    gpu: int
    reason: str
    detail: str


@dataclass(frozen=True, slots=True)
class RemapsPending:
    """NVML reports row remaps pending on the worker's GPU (`workers.gpu_health.fleet_events`): a
    worker about to (re)start there is set aside until the GPU is reset."""

    gpu: int


@dataclass(frozen=True, slots=True)
class ProgressSeen:
    """The worker's own token or request counters advanced (its engine is working)."""


@dataclass(frozen=True, slots=True)
class Wedged:
    """Requests run but nothing advances (and its GPU idles): the engine is stuck even if
    /health answers (a CUDA error can leave it answering)."""

    detail: str


@dataclass(frozen=True, slots=True)
class ReleaseRequested:
    """The operator released the GPU after it passed its checks: start the worker again."""


@dataclass(frozen=True, slots=True)
class Drained:
    """A draining worker is out of the gateway and has no request running or queued."""


@dataclass(frozen=True, slots=True)
class GatewayMembership:
    """The gateway confirmed the worker is routed to (True) or no longer is (False)."""

    member: bool


@dataclass(frozen=True, slots=True)
class PortTaken:
    """The socket listening on the worker's port is held by a process outside its own tree
    (`portowner`): `holder` names it ("PID 4242 (user nobody)"). Whatever answers there
    is not the worker, so its answers never make it ready."""

    port: int
    holder: str


@dataclass(frozen=True, slots=True)
class Tick:
    pass


Event = (
    Launched
    | ProcessExited
    | HealthPassed
    | HealthFailed
    | FailureSeen
    | StartRequested
    | StopRequested
    | RestartRequested
    | Drained
    | GatewayMembership
    | GpuFailing
    | RemapsPending
    | ReleaseRequested
    | ProgressSeen
    | Wedged
    | PortTaken
    | Tick
)


# ---- actions ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Launch:
    """Start the worker's process with the command line of its current OOM step."""

    worker: int


@dataclass(frozen=True, slots=True)
class Terminate:
    """Stop the worker's whole process tree (SIGTERM, SIGKILL after the stop timeout)."""

    worker: int


@dataclass(frozen=True, slots=True)
class Drain:
    """Watch the worker drain: out of the gateway, then no request running or queued;
    report `Drained`. (The supervisor stops it anyway when the drain budget is spent.)"""

    worker: int


@dataclass(frozen=True, slots=True)
class Note:
    """A fact to log: a snake_case `event` and its `fields` (the agent adds worker and gpu)."""

    event: str
    fields: Mapping[str, object] = field(default_factory=dict)


Action = Launch | Terminate | Drain | Note


# ---- state ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Policy:
    startup: StartupPolicy
    health: HealthPolicy
    restart: RestartPolicy
    # The OOM ladder: (current step, failure) -> the next step, or None when it does not apply.
    oom_next: Callable[[int, Failure], int | None] = lambda _step, _failure: None
    # [oom] scope = "all": a step taken by one worker is taken by every worker.
    oom_all: bool = False
    # With a gateway: how long a planned stop waits for the worker to drain. None: no
    # gateway, planned stops go straight to STOPPING.
    drain_timeout: float | None = None

    @classmethod
    def from_spec(
        cls, spec: FarmSpec, oom_next: Callable[[int, Failure], int | None] | None = None
    ) -> Policy:
        drain = spec.gateway.drain_timeout if spec.gateway.enabled else None
        if oom_next is None or not spec.oom.enabled:
            return cls(spec.startup, spec.health, spec.restart, drain_timeout=drain)
        return cls(
            spec.startup,
            spec.health,
            spec.restart,
            oom_next,
            spec.oom.scope == "all",
            drain_timeout=drain,
        )


@dataclass(frozen=True, slots=True)
class WorkerState:
    id: int
    phase: Phase = Phase.STOPPED
    since: float = 0.0
    pid: int | None = None
    failures: int = 0  # consecutive failures with no stable period in between
    health_failures: int = 0
    launched_at: float | None = None
    ready_since: float | None = None
    retry_at: float | None = None
    stop_intent: StopIntent | None = None
    next_reason: RestartReason | None = None  # why the next launch is a restart; None = first start
    pending_failure: Failure | None = None  # the failure that made the farm stop it
    halt_on_failure: bool = False  # the canary of a rollout: a failure halts the rollout
    ever_ready: bool = False
    last_failure: Failure | None = None
    last_failure_at: float | None = None
    failure_past: FailurePast | None = None  # None: the last failure is the present one
    last_action: str | None = None
    restarts: tuple[tuple[float, str], ...] = ()
    restarts_by_reason: Mapping[str, int] = field(default_factory=dict)
    oom_events: Mapping[str, int] = field(default_factory=dict)
    oom_step: int = 0
    last_load_seconds: float | None = None
    in_gateway: bool = False  # the gateway confirmed it routes to this worker
    last_drain_seconds: float | None = None
    progress_at: float | None = None  # when its counters last advanced (while serving)
    busy: bool = False  # its last failed probe was excused: counters were advancing
    quarantine: GpuQuarantine | None = None  # set while its GPU is set aside
    quarantines_by_reason: Mapping[str, int] = field(default_factory=dict)
    # Issue 26: the host is held out of the gateway (`Supervisor.hold_out`: farmctl
    # drain-host), copied into each worker's state so the membership rule reads one state.
    held_out: bool = False

    def enter(self, phase: Phase, now: float, **changes: object) -> WorkerState:
        # replace() checks the field names at run time; mypy cannot type **changes per field.
        return replace(self, phase=phase, since=now, **changes)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Decision:
    state: WorkerState
    actions: tuple[Action, ...] = ()


class IllegalTransition(ValueError):
    """An event that makes no sense in the worker's phase; the state is left unchanged."""


# What a waiter for stops allows beyond `stop_budget`: the exit's report, the runtime's reaping.
STOP_SLACK_S = 15.0


def stop_budget(policy: Policy, *, drain: bool = True) -> float:
    """The longest a planned stop takes: the drain (with a gateway, unless skipped), then the
    runtime's stop (SIGTERM, SIGKILL after `restart.stop_timeout`)."""
    drained = policy.drain_timeout if drain and policy.drain_timeout is not None else 0.0
    return drained + policy.restart.stop_timeout


def wave_budget(policy: Policy) -> float:
    """The longest one wave of a rolling restart takes: a stop, then a model load."""
    return policy.startup.load_timeout + stop_budget(policy)


def backoff_delay(failures: int, policy: RestartPolicy) -> float:
    """Exponential back-off: initial, 2x, 4x ... capped at backoff_max."""
    exponent = max(0, failures - 1)
    return float(min(policy.backoff_max, policy.backoff_initial * (2**exponent)))


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
                failure_past=_reset(s)
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
            failure_past=_reset(s) if s.phase is Phase.FAILED else s.failure_past,
        )
    )


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
            return _terminate_for(replace(s, health_failures=n), failure, now)
        # READY -> UNHEALTHY: a probe failed, below the threshold.
        ns = (
            s.enter(Phase.UNHEALTHY, now, health_failures=n)
            if s.phase is Phase.READY
            else replace(s, health_failures=n)
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


def load_deadline_due(s: WorkerState, policy: Policy) -> float | None:
    """When a tick stops a loading worker not ready in time: the first clock reading past
    `startup.load_timeout` after its launch (past it, not at it); None: not loading. The
    tick applies it, `next_deadline` wakes for it: a deadline the tick did not act on had
    the ticker wake at once, again and again, until the clock moved past it."""
    if s.phase is not Phase.STARTING or s.launched_at is None:
        return None
    return math.nextafter(s.launched_at + policy.startup.load_timeout, math.inf)


def drain_deadline_due(s: WorkerState, policy: Policy) -> float | None:
    """When a tick stops a draining worker with what it still runs: its drain budget after
    the drain began; None: not draining, or no budget. One rule for the tick and
    `next_deadline` (`now - since >= budget` could miss the deadline by a rounding)."""
    if s.phase is not Phase.DRAINING or policy.drain_timeout is None:
        return None
    return s.since + policy.drain_timeout


def wave_timeout_due(r: RollingRestart, policy: Policy) -> float | None:
    """When a rolling restart's wave in flight has run out of time (`wave_budget`) and the
    next one goes, settled or not; None: no wave in flight."""
    return r.wave_started + wave_budget(policy) if r.wave else None


def backoff_reset_due(s: WorkerState, policy: Policy) -> float | None:
    """When a tick resets the worker's back-off: READY with failures counted, `reset_after`
    after it became ready; None: no reset pending. The tick applies it, `next_deadline`
    wakes for it: one rule, so the reset is never left to the ticker's safety tick."""
    if s.phase is not Phase.READY or not s.failures or s.ready_since is None:
        return None
    return s.ready_since + policy.restart.reset_after


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


def _tag(worker_id: int, actions: Sequence[Action]) -> list[Action]:
    """Notes name their worker, so every logged event does."""
    return [
        Note(a.event, {"worker": worker_id, **a.fields}) if isinstance(a, Note) else a
        for a in actions
    ]


class Supervisor:
    """The farm: worker states plus the rollout. Deterministic; the clock comes in as `now`."""

    def __init__(self, worker_ids: Sequence[int], policy: Policy) -> None:
        self.policy = policy
        self.workers: dict[int, WorkerState] = {w: WorkerState(w) for w in worker_ids}
        self.rollout = Rollout.IDLE
        self.rollout_reason: str | None = None
        self.rolling: tuple[RollingRestart, ...] = ()  # planned multi-worker restarts in flight
        # Issue 26: the host is held out of the gateway (drain-host) since this time.
        self.held_out_since: float | None = None

    # -- commands ---------------------------------------------------------------------

    def start(self, worker_ids: Sequence[int], now: float, *, fresh: bool = True) -> list[Action]:
        """Want these workers running; from idle or a halt, this begins a rollout."""
        canary = self.policy.startup.canary
        begin = self.rollout in (Rollout.IDLE, Rollout.HALTED) or (
            canary is not None
            and canary in worker_ids
            and self.workers[canary].phase in (Phase.STOPPED, Phase.FAILED)
        )
        actions: list[Action] = []
        for w in worker_ids:
            actions += self._apply(w, StartRequested(fresh), now)
        if begin:
            if (
                canary is not None
                and canary in self.workers
                and self.workers[canary].phase is Phase.PENDING
            ):
                self.rollout = Rollout.CANARY
                self.workers[canary] = replace(self.workers[canary], halt_on_failure=True)
            else:
                self.rollout = Rollout.ROLLING
            self.rollout_reason = None
            actions.append(Note("rollout_started", {"phase": str(self.rollout), "canary": canary}))
        return actions + self._plan(now)

    def adopt(
        self,
        running: Mapping[int, int],
        remembered: Mapping[int, Phase | None],
        now: float,
        *,
        serving: Collection[int] = (),
    ) -> Adoption:
        """A restarted agent found `running` workers (id -> pid) still up.

        Those in `serving` passed their readiness gate before (an `active` unit): READY at
        once, so the gateway keeps routing to them through the agent's restart (liveness
        probes judge them from the next period on). The others are STARTING until their
        health answers. A worker that had given up, or
        that an operator stopped (`remembered`), and that is not running stays so: it is
        not this restart's to start. With nothing running, nothing is held (a cold start).
        A running worker with a quarantine recorded (the agent went while stopping it for
        its GPU) is stopped: the stop goes on, and it ends QUARANTINED.
        """
        held: set[int] = set()
        for wid, phase in remembered.items():
            if wid not in self.workers or wid in running or phase not in HELD:
                continue
            if running or phase is Phase.QUARANTINED:
                # (remembered) -> FAILED/STOPPED/QUARANTINED: kept as it was before the agent
                # restarted. A quarantine is kept even at a cold start: the GPU is still bad.
                self.workers[wid] = self.workers[wid].enter(phase, now)
                held.add(wid)
        adopted: set[int] = set()
        actions: list[Action] = []
        for wid, pid in running.items():
            if wid not in self.workers:
                continue
            if self.workers[wid].quarantine is not None:
                # (remembered quarantine) -> STOPPING: the agent went while stopping it
                # for its GPU and the process outlived it; the stop goes on, then
                # QUARANTINED. Never READY again on the GPU it was set aside from.
                self.workers[wid] = self.workers[wid].enter(
                    Phase.STOPPING, now, pid=pid, stop_intent=StopIntent.QUARANTINE
                )
                actions += [Terminate(wid), Note("quarantine_stop_resumed", {"worker": wid})]
                adopted.add(wid)
                continue
            if wid in serving:
                # (any) -> READY: it served before the agent restarted and its unit says so.
                self.workers[wid] = self.workers[wid].enter(
                    Phase.READY,
                    now,
                    pid=pid,
                    launched_at=now,
                    ready_since=now,
                    ever_ready=True,
                    health_failures=0,
                )
            else:
                # (any) -> STARTING: a live process of ours; READY once its health answers.
                self.workers[wid] = self.workers[wid].enter(
                    Phase.STARTING, now, pid=pid, launched_at=now
                )
            adopted.add(wid)
        if held:
            actions.append(
                Note(
                    "workers_held",
                    {
                        "workers": sorted(held),
                        "why": "failed or stopped before the agent restarted",
                    },
                )
            )
        return Adoption(frozenset(adopted), frozenset(held), tuple(actions))

    @property
    def held_out(self) -> bool:
        """The host is held out of the gateway (`farmctl drain-host`)."""
        return self.held_out_since is not None

    def hold_out(self, held: bool, now: float) -> list[Action]:
        """Hold every worker of the host out of the gateway (`farmctl drain-host`), or let
        them back in (`undrain-host`). Nothing stops or restarts: a ready worker stays
        ready, out of the gateway (`wants_in_gateway`), until the hold ends; planned stops,
        restarts and rollouts go on as usual meanwhile (their waves do not wait for a
        gateway the workers may not join). Persisted in state.json by the agent."""
        if held == self.held_out:
            return []
        self.held_out_since = now if held else None
        for wid, s in self.workers.items():
            self.workers[wid] = replace(s, held_out=held)
        ids = sorted(self.workers)
        return [Note("host_held_out" if held else "host_back_in", {"workers": ids})]

    def gated(self) -> bool:
        """A rolling restart waits on its canary's verdict (issue 23)."""
        return any(r.gated for r in self.rolling)

    def release_gate(self, now: float) -> list[Action]:
        """The canary's verdict passed: the gated rolling restarts go on (their next
        waves from here, as `tick` issues them)."""
        self.rolling = tuple(replace(r, gated=False) for r in self.rolling)
        return self.tick(now)

    def drop_gated(self) -> None:
        """The canary's verdict failed (or its change was superseded): the gated rolling
        restarts are dropped, their later waves never issued; other restarts go on."""
        self.rolling = tuple(r for r in self.rolling if not r.gated)

    def restart_rolling(
        self,
        worker_ids: Sequence[int],
        reason: RestartReason,
        now: float,
        *,
        drain: bool = True,
        gated: bool = False,  # issue 23: hold the waves after the first (canary analysis)
    ) -> list[Action]:
        """Restart these workers: canary first, then waves of `startup.parallel`.

        One worker alone restarts at once. `drain` False skips the gateway drain.
        """
        ids = tuple(w for w in worker_ids if w in self.workers)
        if not ids:
            return []
        if len(ids) == 1:
            return self.handle(ids[0], RestartRequested(reason, drain), now)
        waves = plan_waves(ids, self.policy.startup.canary, self.policy.startup.parallel)
        self.rolling = (*self.rolling, RollingRestart(reason, waves, drain=drain, gated=gated))
        return self._plan(now)

    def reconfigure(self, policy: Policy, added: Sequence[int], removed: Sequence[int]) -> None:
        """A reload: the new policy; removed workers (already stopped) go, added ones arrive
        STOPPED (the caller starts them)."""
        self.policy = policy
        for wid in removed:
            self.workers.pop(wid, None)
        self.rolling = tuple(
            replace(
                r,
                waves=tuple(
                    left
                    for wave in r.waves
                    if (left := tuple(w for w in wave if w in self.workers))
                ),
                wave=tuple(w for w in r.wave if w in self.workers),
            )
            for r in self.rolling
        )
        for wid in added:
            self.workers.setdefault(wid, WorkerState(wid, held_out=self.held_out))

    def handle(self, worker_id: int, event: Event, now: float) -> list[Action]:
        """Feed one event about one worker."""
        step_before = self.workers[worker_id].oom_step
        actions = self._apply(worker_id, event, now)
        step_after = self.workers[worker_id].oom_step
        if self.policy.oom_all and step_after > step_before:
            actions += self._spread_oom_step(worker_id, step_after, now)
        return actions + self._plan(now)

    def _spread_oom_step(self, source: int, step: int, now: float) -> list[Action]:
        """scope = "all": every other worker takes the same OOM step.

        Running ones are restarted with it in a rolling restart (waves of `parallel`); the
        others take it at their next start.
        """
        running: list[int] = []
        for wid, s in self.workers.items():
            if wid == source or s.oom_step >= step:
                continue
            self.workers[wid] = replace(s, oom_step=step)
            if s.phase in RUNNING:
                running.append(wid)
        note = Note("oom_step_spread", {"worker": source, "step": step, "restart": running})
        if running:
            # The source is restarting already: the canary rule does not hold it back.
            waves = plan_waves(running, self.policy.startup.canary, self.policy.startup.parallel)
            self.rolling = (*self.rolling, RollingRestart(RestartReason.OOM, waves))
        return [note]

    def tick(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for w in list(self.workers):
            actions += self._apply(w, Tick(), now)
        return actions + self._plan(now)

    def stopped(self, worker_ids: Collection[int]) -> bool:
        """Each of `worker_ids` still configured runs nothing and starts nothing by itself:
        STOPPED, FAILED or QUARANTINED (what a wait for a stop waits for)."""
        return all(self.workers[w].phase in HELD for w in worker_ids if w in self.workers)

    def stopping(self) -> bool:
        """A stop is under way for some worker: it drains or its process tree is stopping."""
        return any(s.phase in LEAVING for s in self.workers.values())

    def reset_oom(self, worker_id: int) -> None:
        s = self.workers[worker_id]
        self.workers[worker_id] = replace(s, oom_step=0, failure_past=_reset(s))

    def restore(self, worker_id: int, state: WorkerState) -> None:
        """Put back a worker's remembered state (restarts, back-off, OOM step) at agent start."""
        if state.id != worker_id or worker_id not in self.workers:
            raise ValueError(f"worker {worker_id}: not a worker of this farm")
        self.workers[worker_id] = state

    # -- internals --------------------------------------------------------------------

    def _apply(self, worker_id: int, event: Event, now: float) -> list[Action]:
        decision = step(self.workers[worker_id], event, now, self.policy)
        self.workers[worker_id] = decision.state
        return _tag(worker_id, decision.actions)

    def _settled(self, worker: int) -> bool:
        """A worker of a rolling wave is done: serving again (and back in the gateway when
        there is one, unless its host is held out of it), or failed, or stopped."""
        s = self.workers.get(worker)
        if s is None or s.phase in HELD:
            return True
        return s.phase is Phase.READY and (
            self.policy.drain_timeout is None or s.in_gateway or s.held_out
        )

    def _advance_rolling(self, now: float) -> list[Action]:
        """Issue the next wave of each rolling restart whose current wave has settled."""
        actions: list[Action] = []
        kept: list[RollingRestart] = []
        for r in self.rolling:
            settled = all(self._settled(w) for w in r.wave)
            timeout_at = wave_timeout_due(r, self.policy)
            if timeout_at is not None and not settled and now < timeout_at:
                kept.append(r)
                continue
            if r.gated and r.wave:  # issue 23: the canary's verdict releases the next wave
                kept.append(r)
                continue
            if not r.waves:
                actions.append(Note("rolling_restart_done", {"reason": str(r.reason)}))
                continue  # the last wave settled (or timed out): this rolling restart is over
            wave, rest = r.waves[0], r.waves[1:]
            # next wave: the previous one serves again (or gave up, or ran out of time).
            kept.append(replace(r, waves=rest, wave=wave, wave_started=now))
            actions.append(Note("rolling_restart_wave", {"workers": list(wave)}))
            for w in wave:
                if w in self.workers:
                    actions += self._apply(w, RestartRequested(r.reason, r.drain), now)
        self.rolling = tuple(kept)
        return actions

    def _plan(self, now: float) -> list[Action]:
        """Advance rolling restarts and the rollout; give loading slots to PENDING workers."""
        actions: list[Action] = self._advance_rolling(now) if self.rolling else []
        canary = self.policy.startup.canary
        if self.rollout in (Rollout.CANARY, Rollout.HALTED) and canary is not None:
            c = self.workers[canary]
            if c.phase is Phase.READY:
                # CANARY/HALTED -> ROLLING: the canary serves (again, after a fix and a restart).
                self.rollout = Rollout.ROLLING
                self.rollout_reason = None
                actions.append(Note("rollout_canary_ready", {"canary": canary}))
            elif self.rollout is Rollout.CANARY and c.phase is Phase.QUARANTINED:
                # CANARY -> ROLLING: a failing GPU says nothing about the config; go on.
                self.rollout = Rollout.ROLLING
                actions.append(Note("rollout_canary_quarantined", {"canary": canary}))
            elif self.rollout is Rollout.CANARY and c.phase in (Phase.FAILED, Phase.STOPPED):
                self.rollout = Rollout.HALTED
                why = c.last_failure.summary if c.last_failure else "the canary was stopped"
                self.rollout_reason = f"canary worker {canary} {c.phase}: {why}"
                actions.append(
                    Note("rollout_halted", {"canary": canary, "why": self.rollout_reason})
                )
        if self.rollout is Rollout.IDLE:
            return actions
        loading = sum(1 for s in self.workers.values() if s.phase is Phase.STARTING)
        for wid in sorted(self.workers):
            s = self.workers[wid]
            if s.phase is not Phase.PENDING:
                continue
            if self.rollout in (Rollout.CANARY, Rollout.HALTED) and wid != canary:
                continue  # nothing but the canary loads until it is ready
            if loading >= max(1, self.policy.startup.parallel):
                break
            decision = launch(s, now)
            self.workers[wid] = decision.state
            actions += _tag(wid, decision.actions)
            loading += 1
        if self.rollout is Rollout.ROLLING and not any(
            s.phase in (Phase.PENDING, Phase.STARTING) for s in self.workers.values()
        ):
            self.rollout = Rollout.DONE
            ready = sum(1 for s in self.workers.values() if s.phase is Phase.READY)
            actions.append(Note("rollout_done", {"ready": ready, "workers": len(self.workers)}))
        return actions

    def next_deadline(self, now: float) -> float | None:
        """The earliest time a Tick could change something (back-off end, load deadline,
        drain budget, back-off reset, wave timeout)."""
        times: list[float] = []
        for s in self.workers.values():
            reset_at = backoff_reset_due(s, self.policy)
            if reset_at is not None:
                times.append(reset_at)
            if s.phase is Phase.BACKOFF and s.retry_at is not None:
                times.append(s.retry_at)
            load_at = load_deadline_due(s, self.policy)
            if load_at is not None:
                times.append(load_at)
            drain_at = drain_deadline_due(s, self.policy)
            if drain_at is not None:
                times.append(drain_at)
        for r in self.rolling:
            timeout_at = wave_timeout_due(r, self.policy)
            # Issue 23: a gated wave waits for a verdict, not time.
            if timeout_at is not None and not r.gated:
                times.append(timeout_at)
        return min(times) if times else None
