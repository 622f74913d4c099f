"""Pure: the canary analysis of a rolling change, as a state machine (issue 23).

A reload that changes what workers run restarts them in waves (supervisor.plan_waves),
the canary alone first. With `[rollout] analysis_window` > 0 the rolling restart is
*gated*: its next wave is not issued until this machine says so.

    WAITING    the canary restarts onto the change; ready -> with `[rollout] eval`, the
               eval gate first (the canary kept out of the gateway meanwhile); then
               (once in the gateway, when there is one) -> ANALYSING, the caller
               scrapes the window's start
    ANALYSING  the window runs; at its end the caller scrapes again and judges
               (canary.verdict.judge); `conclude` turns the verdict into what to do:
               a window that ended short of traffic (nothing failed) is extended by
               another window, up to `[rollout] max_extensions`, and judged again on
               the figures from the window's start; then `on_inconclusive` applies

A crash, OOM, hang, wedge or failed health check of the canary from the moment its
restart is issued fails the change at once (`observe` returns `Fail`): the change
caused it, so it is no OOM-ladder step. A canary whose GPU is quarantined (or being
stopped for it) says nothing about the change: inconclusive. An operator's stop ends the
analysis with no verdict (`Stopped`); an operator's restart of the canary in its window
starts the analysis over (a new window once it serves again). The caller
(canary/driver.py) does the I/O: the scrapes, the supervisor's gate, the rollback, the
record in the state directory.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from sglang_farm.canary import record
from sglang_farm.canary.verdict import (
    CanaryPolicy,
    Check,
    LivenessEvent,
    LivenessKind,
    Outcome,
    liveness_event,
)
from sglang_farm.sglang.commands import worker_commands
from sglang_farm.sglang.failures import Failure
from sglang_farm.spec import FarmSpec, RolloutSpec
from sglang_farm.workers.phase import Phase, StopIntent
from sglang_farm.workers.phase_sets import LEAVING, set_aside

__all__ = [
    "Analysis",
    "CanaryObs",
    "EndWindow",
    "Fail",
    "Inconclusive",
    "Resolution",
    "RunEval",
    "StartWindow",
    "Stopped",
    "Wait",
    "conclude",
    "policy",
    "resolve",
    "spec_change",
    "starved_of_traffic",
]


def policy(r: RolloutSpec) -> CanaryPolicy:
    """The verdict's thresholds from `[rollout]` (its keys carry CanaryPolicy's names)."""
    return CanaryPolicy(
        min_requests=r.min_requests,
        itl_max_ratio=r.itl_max_ratio,
        ttft_max_ratio=r.ttft_max_ratio,
        confidence=r.confidence,
        error_floor=r.error_floor,
        error_max_ratio=r.error_max_ratio,
        min_errors=r.min_errors,
    )


def spec_change(spec: FarmSpec, caps: Mapping[int, tuple[int, int]] | None = None) -> str:
    """The hash (record.change_hash) of what the workers of `spec` would run: each
    worker's argv, environment and interpreter at the configured flags (OOM-ladder step
    0: a ladder step is the farm's reaction, not the operator's change) and the model
    revision. Ports and GPUs are in the argv, so moving a worker is a change too."""
    revision = spec.model.revision if spec.model is not None else None
    commands = worker_commands(spec, {}, caps or {})
    return record.change_hash(
        {
            "workers": {
                str(w): record.workload(c.argv, c.env_dict, spec.farm.python, revision)
                for w, c in commands.items()
            }
        }
    )


@dataclass(frozen=True, slots=True)
class CanaryObs:
    """What the supervisor says of the canary now (from its WorkerState)."""

    phase: Phase
    in_gateway: bool
    busy: bool = False  # its failed probe was excused: its counters were advancing
    # An operator's stop (or the agent's shutdown) is under way: not the change's doing.
    stopping: bool = False
    last_failure: Failure | None = None
    last_failure_at: float | None = None  # the supervisor's clock
    # Why the supervisor is stopping it (WorkerState.stop_intent): an operator's stop,
    # a restart (an operator's, or a config restart), its GPU set aside, or a failure.
    stop_intent: StopIntent | None = None


@dataclass(frozen=True, slots=True)
class Analysis:
    """One change under analysis. Times are the supervisor's (monotonic) clock."""

    change: str  # the candidate's hash (spec_change)
    canary: int
    window_s: float
    issued_at: float  # the canary's restart onto the change was issued
    failure_mark: float | None  # the canary's last_failure_at then: a later one is the change's
    window_start: float | None = None  # None: still WAITING
    # `[rollout] eval`: the canary answers the eval set before it takes traffic.
    needs_eval: bool = False
    evaluated: bool = False  # the eval gate passed (or had nothing to compare with)
    # `[rollout] max_extensions`: windows that end short of traffic are extended this
    # many times at most; `extensions`: how many so far.
    max_extensions: int = 0
    extensions: int = 0

    @property
    def analysing(self) -> bool:
        return self.window_start is not None

    @property
    def span_s(self) -> float:
        """The analysis's length so far: its window and each extension of it."""
        return self.window_s * (1 + self.extensions)

    @property
    def ends_at(self) -> float | None:
        return None if self.window_start is None else self.window_start + self.span_s


@dataclass(frozen=True, slots=True)
class Wait:
    """Nothing to do yet; `why`, when the view should say why (else it stays as it is)."""

    why: str = ""


@dataclass(frozen=True, slots=True)
class StartWindow:
    """The canary serves: scrape the canary and the baseline now (the window's start)."""


@dataclass(frozen=True, slots=True)
class RunEval:
    """The canary is ready but kept out of the gateway: run the eval gate now."""


@dataclass(frozen=True, slots=True)
class EndWindow:
    """The window is over: scrape again and judge."""


@dataclass(frozen=True, slots=True)
class Fail:
    """The canary failed its liveness: roll back at once."""

    event: LivenessEvent


@dataclass(frozen=True, slots=True)
class Stopped:
    """The canary is being stopped on purpose (an operator, the agent's shutdown): the
    analysis ends with no verdict and nothing recorded; a reload judges the change again."""


@dataclass(frozen=True, slots=True)
class Inconclusive:
    """Nothing can be said about the change (the canary's GPU was set aside)."""

    why: str


Step = Wait | RunEval | StartWindow | EndWindow | Fail | Stopped | Inconclusive

WINDOW_OVER_UNHEALTHY = (
    "the window is over but the canary misses its health probes: judged once it answers, "
    "rolled back if the supervisor restarts it for them ([health] failure_threshold)"
)

_GONE = (Phase.BACKOFF, Phase.FAILED, Phase.STOPPED, Phase.STOPPING)


def observe(a: Analysis, c: CanaryObs, now: float, *, gateway: bool) -> tuple[Analysis, Step]:
    """The analysis after looking at the canary `now`; `gateway`: the farm has one, so the
    canary must be routed to before its window starts."""
    after = 0.0 if a.window_start is None else max(0.0, now - a.window_start)
    leaving = c.phase in LEAVING
    if c.stopping or (leaving and c.stop_intent is StopIntent.STOP):
        return a, Stopped()
    if set_aside(c.phase, c.stop_intent):
        # Its GPU is set aside (draining or stopping for it, or already aside): says
        # nothing about the change, whatever the process did on its way out.
        return a, Inconclusive(f"canary worker {a.canary}'s GPU was set aside (quarantined)")
    new_failure = c.last_failure_at is not None and (
        a.failure_mark is None or c.last_failure_at > a.failure_mark
    )
    if c.last_failure is not None and new_failure:
        return a, Fail(liveness_event(c.last_failure, after))
    if leaving and c.stop_intent is StopIntent.RESTART and a.window_start is not None:
        # Restarted on purpose (`farmctl restart`) in its window: not the change's doing.
        # The analysis starts over: a new window once it serves again, and a failure
        # from here on is the change's.
        return (
            replace(a, window_start=None, failure_mark=c.last_failure_at, extensions=0),
            Wait(),
        )
    if a.window_start is None:
        if c.phase in (Phase.FAILED, Phase.STOPPED):
            detail = f"the canary is {c.phase} before it served"
            return a, Fail(LivenessEvent(LivenessKind.CRASHED, 0.0, detail))
        if c.phase is Phase.READY and a.needs_eval and not a.evaluated:
            return a, RunEval()
        if c.phase is Phase.READY and (c.in_gateway or not gateway):
            return replace(a, window_start=now), StartWindow()
        return a, Wait()
    if c.phase in _GONE:
        detail = f"the canary left serving ({c.phase})"
        return a, Fail(LivenessEvent(LivenessKind.CRASHED, after, detail))
    if a.ends_at is not None and now >= a.ends_at:
        if c.phase is Phase.UNHEALTHY and not c.busy:
            # Missed probes are the supervisor's to judge, in the window as before it and
            # for every worker (`[health] failure_threshold` in a row restart it, and that
            # restart fails the change above): no verdict on a canary that is not
            # answering; it answers again (then judged) or is restarted (then failed).
            return a, Wait(WINDOW_OVER_UNHEALTHY)
        return a, EndWindow()
    return a, Wait()


def kept_out_of_gateway(a: Analysis | None) -> frozenset[int]:
    """The workers the gateways must not route to, whatever their phase: the canary
    while its eval gate has not passed, so it takes no traffic before it does."""
    if a is None or not a.needs_eval or a.evaluated:
        return frozenset()
    return frozenset((a.canary,))


class Resolution(StrEnum):
    PROMOTE = "promote"  # release the gate: the next waves proceed
    ROLLBACK = "rollback"  # the canary back on the accepted config, the other waves dropped
    HOLD = "hold"  # neither: the farm stays as it is (canary on the change) and alerts


def resolve(outcome: Outcome, on_inconclusive: str) -> Resolution:
    """What a verdict means for the rollout; an inconclusive one follows
    `[rollout] on_inconclusive` ("hold" | "rollback" | "promote")."""
    if outcome is Outcome.PROMOTE:
        return Resolution.PROMOTE
    if outcome is Outcome.ROLLBACK:
        return Resolution.ROLLBACK
    return Resolution(on_inconclusive)


def starved_of_traffic(checks: Sequence[Check]) -> bool:
    """The verdict was inconclusive for too little traffic (`min_requests` on either side),
    which its failed "traffic" check says; not for a /metrics that could not be read."""
    return any(c.name == "traffic" and c.passed is False for c in checks)


def conclude(
    a: Analysis, outcome: Outcome, checks: Sequence[Check], on_inconclusive: str
) -> Analysis | Resolution:
    """What the verdict at the end of `a`'s window means: the analysis extended by another
    window (returned: the next end is `ends_at`, the figures still from `window_start`)
    when the window ended short of traffic with nothing failed and fewer than
    `max_extensions` extensions so far, since a freshly restarted canary can be starved
    by the gateway's routing for a while; otherwise the Resolution (`resolve`)."""
    extend = (
        outcome is Outcome.INCONCLUSIVE
        and starved_of_traffic(checks)
        and a.extensions < a.max_extensions
    )
    if extend:
        return replace(a, extensions=a.extensions + 1)
    return resolve(outcome, on_inconclusive)
