"""Pure: the supervisor's budgets and time rules: how long a stop or a wave may take, the
back-off delay, and when each deadline a tick acts on is due (one rule for the tick and
`Supervisor.next_deadline`)."""

from __future__ import annotations

import math

from sglang_farm.spec import RestartPolicy
from sglang_farm.workers.phase import Phase
from sglang_farm.workers.records import Policy, RollingRestart, WorkerState

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
