"""Pure: the events the supervisor is fed about one worker (`machine.step` takes them).

The vocabulary the runtime, the probes and the watchers speak to the core: modules that
report (gpu_health, liveness, drain, progress...) import this, not the supervisor.
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_farm.sglang.failures import Failure, RestartReason


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
class RolledBack:
    """The canary put back on the accepted config after its change failed: the OOM step
    it had before the change, and a restart onto the accepted command (drained first),
    unless an operator's stop stands."""

    oom_step: int


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
    | RolledBack
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
