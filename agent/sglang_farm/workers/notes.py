"""Pure: how the supervisor's notes read in the agent's log.

The supervisor says what happened (`supervisor.Note`: an event name and its fields); the
agent logs it. What level each is logged at, and what the end of a rollout says beside
its counts (the farm, the one URL users call, the command to try next), are decided here
so that they can be tested without an agent.
"""

from __future__ import annotations

from sglang_farm.host.paths import DEFAULT_CONFIG_PATH
from sglang_farm.spec import FarmSpec

# Notes that mean a worker or the rollout needs a person's eye: logged as warnings.
WARNINGS = frozenset(
    {
        "worker_failed",
        "worker_gave_up",
        "canary_failed",
        "rollout_halted",
        "health_failed",
        "worker_terminating",
    }
)


def note_level(event: str) -> str:
    """The log level of a note: "warning" for those in `WARNINGS`, else "info"."""
    return "warning" if event in WARNINGS else "info"


def rollout_summary(
    spec: FarmSpec, front_door: str | None, ready: object, workers: object
) -> dict[str, object]:
    """What the rollout's end says beside its counts: the farm, the one URL users call
    (`front_door`, the gateway's; None without one), and the command to try next, as one
    line a person reads (`summary`)."""
    config = "" if spec.source == DEFAULT_CONFIG_PATH else f" --config {spec.source}"
    try_next = f"farmctl{config} status"
    door = (
        f"front door {front_door}" if front_door else "no gateway: farmctl endpoints lists workers"
    )
    return {
        "farm": spec.farm.name,
        "front_door": front_door,
        "next": try_next,
        "summary": f"{spec.farm.name}: {ready}/{workers} ready · {door} · try: {try_next}",
    }
