"""Pure: how the supervisor's notes read in the agent's log.

The supervisor says what happened (`supervisor.Note`: an event name and its fields); the
agent logs it. What level each is logged at, and what the end of a rollout says beside
its counts (the farm, the one URL users call, the command to try next), are decided here
so that they can be tested without an agent.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

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


# Issue 31: with a gateway, the rollout's end is said once the gateway routes every ready
# worker (smg lists a worker about 3 s after it is added), or after this long, naming
# the ones it does not route yet.
ROUTED_WAIT_S = 30.0


def as_typed(path: str, cwd: str) -> str:
    """`path` as a person in `cwd` types it: relative when it lies under `cwd`
    (`etc/sglang-farm/demo.toml` in a checkout), else as it is (also from `/`, where
    systemd runs the agent: `srv/farm.toml` is typed nowhere)."""
    if not os.path.isabs(path) or not os.path.isabs(cwd) or cwd == "/":
        return path
    rel = os.path.relpath(path, cwd)
    return path if rel == ".." or rel.startswith("../") else rel


def farmctl_command(beside_agent: str | None, on_path: str | None, cwd: str) -> str:
    """How to call farmctl, as the line to try says: `farmctl` when the one on the PATH
    is the agent's own (`on_path`, resolved, equals `beside_agent`) or the agent has none
    beside it; else the agent's own as typed from `cwd` (`.venv/bin/farmctl` in a
    checkout, where no farmctl is on the PATH: issue 31)."""
    if beside_agent is None or on_path == beside_agent:
        return "farmctl"
    return as_typed(beside_agent, cwd)


def _ids(ids: Sequence[int]) -> str:
    return f"worker{'s' if len(ids) != 1 else ''} {', '.join(str(i) for i in ids)}"


def rollout_summary(
    spec: FarmSpec,
    front_door: str | None,
    ready: object,
    workers: object,
    not_routed: Sequence[int] = (),
    *,
    held_out: bool = False,
    farmctl: str = "farmctl",
    cwd: str = "",
) -> dict[str, object]:
    """What the rollout's end says beside its counts: the farm, the one URL users call
    (`front_door`, the gateway's; None without one), and the command to try next, as one
    line a person reads (`summary`). With a gateway the count is what users get: ready
    and routed, or which ready workers the gateway does not route yet (`not_routed`), or
    that the host is held out of it (`held_out`: farmctl drain-host). The command to try
    is typed as from `cwd` (`farmctl`: how to call it; the config relative to `cwd`)."""
    shown = as_typed(spec.source, cwd)
    config = "" if spec.source == DEFAULT_CONFIG_PATH else f" --config {shown}"
    try_next = f"{farmctl}{config} status"
    door = (
        f"front door {front_door}" if front_door else "no gateway: farmctl endpoints lists workers"
    )
    count = f"{ready}/{workers} ready"
    if front_door and held_out:
        count += ", the host held out of the gateway (farmctl undrain-host)"
    elif front_door and not not_routed:
        count += " and routed"
    elif front_door:
        count += f", the gateway does not route {_ids(not_routed)} yet"
    out: dict[str, object] = {
        "farm": spec.farm.name,
        "front_door": front_door,
        "next": try_next,
        "summary": f"{spec.farm.name}: {count} · {door} · try: {try_next}",
    }
    if front_door:
        out["not_routed"] = list(not_routed)
    return out
