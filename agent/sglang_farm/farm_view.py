"""Pure: read-only views of the farm, as the control socket and the exporter see them.

The agent builds a new `FarmView` whenever something changes and swaps the reference;
readers (scrapes, `status` requests) only format it. No reader ever calls a worker,
NVML or systemd, so a hung worker can slow nothing but itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from sglang_farm.canary.view import RolloutVerdictView

# Re-exported: readers take the farm's view shapes from here.
from sglang_farm.gateway.status import GatewayStatus as GatewayStatus
from sglang_farm.sglang.failures import Failure
from sglang_farm.sglang.startup import Capacity, SlowPhase, StartPhase, StartTimeline
from sglang_farm.spec import FarmSpec
from sglang_farm.staging.state import StagingView
from sglang_farm.state_alerts import StateAlert
from sglang_farm.workers.phase import Phase, StopIntent
from sglang_farm.workers.phase_sets import set_aside
from sglang_farm.workers.supervisor import Rollout, WorkerState

__all__ = [
    "FarmView",
    "GatewayStatus",
    "Phase",
    "Quarantine",
    "RestartRecord",
    "Rollout",
    "WorkerView",
    "build_view",
]


@dataclass(frozen=True, slots=True)
class Quarantine:
    """Why a worker's GPU is set aside (docs/gpu-health.md)."""

    gpu: int
    reason: str  # "xid 79", "gpu lost", "pending row remaps", ...
    detail: str  # the XID catalog's meaning and action, or NVML's error
    since: float  # wall clock


@dataclass(frozen=True, slots=True)
class RestartRecord:
    at: float  # wall-clock seconds since the epoch
    reason: str  # a RestartReason value


@dataclass(frozen=True, slots=True)
class StartView:
    """A worker's latest start as readers see it (`sglang.startup`), in wall-clock time."""

    phase: StartPhase  # SERVED once the server said it is ready
    phase_since: float  # wall clock
    durations: Mapping[str, float]  # seconds of each phase that has ended
    capacity: Capacity | None = None
    in_progress: bool = False  # the worker is starting now and this is that start
    slow: tuple[SlowPhase, ...] = ()  # its phases well slower than its siblings'


def start_view(
    t: StartTimeline, mono_to_wall: float, *, starting: bool, slow: Sequence[SlowPhase] = ()
) -> StartView:
    return StartView(
        in_progress=starting and not t.done,
        phase=t.phase,
        phase_since=t.phase_since + mono_to_wall,
        durations=MappingProxyType({str(p): s for p, s in t.durations().items()}),
        capacity=t.capacity,
        slow=tuple(slow),
    )


@dataclass(frozen=True, slots=True)
class WorkerView:
    id: int
    gpus: tuple[int, ...]
    port: int
    base_url: str
    phase: Phase
    since: float  # wall-clock seconds since the epoch when `phase` was entered
    pid: int | None
    restarts: tuple[RestartRecord, ...] = ()  # most recent last, bounded
    restarts_by_reason: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    oom_events_by_kind: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    last_failure: Failure | None = None
    last_failure_at: float | None = None
    last_action: str | None = None  # what the farm did about the last failure
    # Why the last failure is the worker's past ("served": it has served since, "reset":
    # the operator reset it since); None: it is the present one (issue 31).
    failure_past: str | None = None
    oom_step: int = 0  # 0 = the configured flags; n = ladder step n in force
    oom_step_name: str | None = None
    last_load_seconds: float | None = None
    argv: tuple[str, ...] = ()
    in_gateway: bool = False  # the gateway confirmed it routes to this worker
    last_drain_seconds: float | None = None  # the last planned stop's drain
    busy: bool = False  # its last failed probe was excused: its counters were advancing
    quarantine: Quarantine | None = None  # set while its GPU is set aside
    quarantines_by_reason: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    start: StartView | None = None  # its latest start (None: adopted, or never launched)
    stop_intent: StopIntent | None = None  # why the farm is stopping it (WorkerState's)

    @property
    def ready(self) -> bool:
        return self.phase is Phase.READY

    @property
    def set_aside(self) -> bool:
        """Its GPU is set aside (`phase_sets.set_aside`: quarantined, or stopping to be)."""
        return set_aside(self.phase, self.stop_intent)


@dataclass(frozen=True, slots=True)
class FarmView:
    name: str
    runtime: str  # "process" or "systemd"
    workers: tuple[WorkerView, ...]
    config_source: str
    started_at: float  # wall clock of the agent's start
    rollout: Rollout  # on the wire its value: "idle", "canary", "rolling", "done", "halted"
    rollout_reason: str | None = None  # why a rollout halted
    gateway: GatewayStatus | None = None  # None: no [gateway]
    staging: StagingView | None = None  # None: no [model]
    canary: RolloutVerdictView | None = None  # None: no canary analysis yet (issue 23)
    # Issue 26: rolling restarts under way (waves not all issued and settled).
    rolling: int = 0
    # Issue 26: since when (wall clock) the host is held out of the gateway (farmctl
    # drain-host); None: it is not.
    held_out_since: float | None = None
    # Fleet review #2: sha256 of the config text in force (None: not from a file).
    config_sha256: str | None = None
    # Issue 30: what is wrong with the farm's own state files (not saved, found damaged
    # or refused at start); empty when nothing is.
    state_alerts: tuple[StateAlert, ...] = ()
    state_save_failures: int = 0  # failed writes of state.json since the agent started

    def worker(self, worker_id: int) -> WorkerView:
        for w in self.workers:
            if w.id == worker_id:
                return w
        raise KeyError(worker_id)

    @property
    def ready_count(self) -> int:
        return sum(1 for w in self.workers if w.ready)


def build_view(
    spec: FarmSpec,
    workers: Mapping[int, WorkerState],
    *,
    runtime: str,
    rollout: Rollout,
    rollout_reason: str | None,
    started_at: float,
    mono_to_wall: float,
    argv: Mapping[int, Sequence[str]],
    gateway: GatewayStatus | None = None,
    staging: StagingView | None = None,
    canary: RolloutVerdictView | None = None,
    rolling: int = 0,
    held_out_since: float | None = None,
    starts: Mapping[int, StartTimeline] | None = None,
    slow_starts: Mapping[int, Sequence[SlowPhase]] | None = None,
    state_alerts: Sequence[StateAlert] = (),
    state_save_failures: int = 0,
) -> FarmView:
    """The farm as readers see it: the supervisor's states in wall-clock time, in config order.

    `mono_to_wall` converts the supervisor's monotonic times; `argv` is each worker's
    command line now (its OOM-ladder step applied); `held_out_since` is the supervisor's
    (monotonic) time of the host's drain.
    """
    views = []
    for ws in spec.workers:
        s = workers.get(ws.id) or WorkerState(ws.id)
        step = s.oom_step
        views.append(
            WorkerView(
                id=ws.id,
                gpus=ws.gpus,
                port=ws.port,
                base_url=ws.base_url,
                phase=s.phase,
                since=s.since + mono_to_wall if s.since else started_at,
                pid=s.pid,
                restarts=tuple(RestartRecord(at + mono_to_wall, r) for at, r in s.restarts),
                restarts_by_reason=MappingProxyType(dict(s.restarts_by_reason)),
                oom_events_by_kind=MappingProxyType(dict(s.oom_events)),
                last_failure=s.last_failure,
                last_failure_at=s.last_failure_at + mono_to_wall if s.last_failure_at else None,
                last_action=s.last_action,
                failure_past=str(s.failure_past) if s.failure_past is not None else None,
                oom_step=step,
                oom_step_name=spec.oom.steps[step - 1].name
                if 0 < step <= len(spec.oom.steps)
                else None,
                last_load_seconds=s.last_load_seconds,
                argv=tuple(argv.get(ws.id, ())),
                in_gateway=s.in_gateway,
                busy=s.busy,
                last_drain_seconds=s.last_drain_seconds,
                quarantine=Quarantine(
                    s.quarantine.gpu,
                    s.quarantine.reason,
                    s.quarantine.detail,
                    s.quarantine.at + mono_to_wall,
                )
                if s.quarantine is not None
                else None,
                quarantines_by_reason=MappingProxyType(dict(s.quarantines_by_reason)),
                stop_intent=s.stop_intent,
                start=start_view(
                    t,
                    mono_to_wall,
                    starting=s.phase is Phase.STARTING,
                    slow=(slow_starts or {}).get(ws.id, ()),
                )
                if (t := (starts or {}).get(ws.id)) is not None
                else None,
            )
        )
    return FarmView(
        name=spec.farm.name,
        runtime=runtime,
        workers=tuple(views),
        config_source=spec.source,
        config_sha256=spec.config_sha256 or None,
        started_at=started_at,
        rollout=rollout,
        rollout_reason=rollout_reason,
        gateway=gateway,
        staging=staging,
        canary=canary,
        rolling=rolling,
        held_out_since=held_out_since + mono_to_wall if held_out_since is not None else None,
        state_alerts=tuple(state_alerts),
        state_save_failures=state_save_failures,
    )
