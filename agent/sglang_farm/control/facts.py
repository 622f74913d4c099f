"""Pure: the facts about a worker that farmctl renders instead of judging state names.

The agent sends each as a key of the worker's result (`has_process`, `failure_shown`,
`state_timed`, a phase message's `ends_wait`, the stage's `failed`); farmctl reads the
key, and falls back on the same rule here over the object's `state` only where the key is
absent (an agent older than the key). So the phases' wire values are named here, beside
the wire, and not in farmctl (tests/test_control_facts.py holds them to the supervisor's
`Phase`). Imports nothing: farmctl imports it on every run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

# Phases with no process: the GPU's figure is not the worker's (the last poll may predate
# the stop).
NO_PROCESS: Final = frozenset({"stopped", "pending", "backoff", "quarantined", "failed"})
# Phases whose last failure is the worker's news (it failed, or is coming back from it).
FAILURE_SHOWN: Final = frozenset({"failed", "backoff", "starting", "unhealthy"})
# Phases a wait-ready ends on: its final reply reports them, not a progress line.
ENDS_WAIT: Final = frozenset({"ready", "failed", "quarantined"})
# Phases that last until something finishes or an operator acts: said with how long.
TIMED: Final = frozenset({"draining", "quarantined"})
# The model stage's failed state (staging.state.StageState.FAILED).
STAGE_FAILED: Final = "failed"


def _sent(obj: Mapping[str, Any], key: str, rule: bool) -> bool:
    said = obj.get(key)
    return said if isinstance(said, bool) else rule


def has_process(state: str) -> bool:
    return state not in NO_PROCESS


def failure_shown(state: str, failure: object, failure_past: object) -> bool:
    """Whether `status` notes the last failure: there is one, it is not past (issue 31:
    served or reset since), and the phase is about it."""
    return bool(failure) and not failure_past and state in FAILURE_SHOWN


def ends_wait(state: str) -> bool:
    return state in ENDS_WAIT


def state_timed(state: str) -> bool:
    return state in TIMED


def has_process_of(w: Mapping[str, Any]) -> bool:
    return _sent(w, "has_process", has_process(str(w.get("state"))))


def failure_shown_of(w: Mapping[str, Any]) -> bool:
    rule = failure_shown(str(w.get("state")), w.get("last_failure"), w.get("failure_past"))
    return _sent(w, "failure_shown", rule)


def ends_wait_of(p: Mapping[str, Any]) -> bool:
    return _sent(p, "ends_wait", ends_wait(str(p.get("state"))))


def state_timed_of(w: Mapping[str, Any]) -> bool:
    return _sent(w, "state_timed", state_timed(str(w.get("state"))))


def stage_failed_of(sg: Mapping[str, Any]) -> bool:
    return _sent(sg, "failed", sg.get("state") == STAGE_FAILED)
