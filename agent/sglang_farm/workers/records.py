"""Pure: the supervisor's records: a worker's state, the policy it is judged by, why its
GPU is set aside, a rolling restart in flight. Read by the state machine (`machine`),
the time rules (`budgets`) and the planner (`supervisor`) alike."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum

from sglang_farm.sglang.failures import Failure, RestartReason
from sglang_farm.spec import FarmSpec, HealthPolicy, RestartPolicy, StartupPolicy
from sglang_farm.workers.phase import Phase, StopIntent


class FailurePast(StrEnum):
    """Why a worker's last failure is its past, not what ails it now (issue 31: `why`
    repeated a crash loop's "gave up" after the worker had served again)."""

    SERVED = "served"  # it has served (been ready) since
    RESET = "reset"  # the operator reset it since: reset-oom, a start or restart while failed


@dataclass(frozen=True, slots=True)
class GpuQuarantine:
    """Why a worker's GPU is set aside: `reason` short ("xid 79", "gpu lost"), `detail`
    the catalog's words or NVML's error, `at` the supervisor's clock."""

    gpu: int
    reason: str
    detail: str
    at: float = 0.0


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
