"""Pure: the farm-level commands the core takes (`Supervisor.submit`), in its vocabulary.

The operator's commands (`operations`), a reload (`reloader`), the canary analysis
(`canary.driver`) and the agent's own start-up hand these to one entry, `Agent.submit`:
the core decides what each does, the agent carries out the actions and publishes the
view, in one place. Events about one worker stay `events` (`Agent.feed`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from sglang_farm.sglang.failures import RestartReason
from sglang_farm.spec import FarmSpec
from sglang_farm.workers.records import Policy, WorkerState


@dataclass(frozen=True, slots=True)
class Start:
    """Want these workers running; from idle or a halt, a rollout begins. `fresh`: an
    operator's start resets the back-off (a restarted agent's own start keeps it)."""

    workers: Sequence[int]
    fresh: bool = True


@dataclass(frozen=True, slots=True)
class Stop:
    """Stop these workers (drained first with a gateway, unless `drain` is False)."""

    workers: Sequence[int]
    drain: bool = True


@dataclass(frozen=True, slots=True)
class RestartRolling:
    """Restart these workers: canary first, then waves of `parallel`. `gated`: the waves
    after the canary's wait for its verdict (`ReleaseGate`, `RollBack`)."""

    workers: Sequence[int]
    reason: RestartReason
    drain: bool = True
    gated: bool = False


@dataclass(frozen=True, slots=True)
class Release:
    """Start these quarantined workers again: their GPUs passed their checks."""

    workers: Sequence[int]


@dataclass(frozen=True, slots=True)
class HoldOut:
    """The host held out of the gateway (`farmctl drain-host`), or let back in."""

    held: bool


@dataclass(frozen=True, slots=True)
class ReleaseGate:
    """The canary's verdict passed: the gated waves go on."""


@dataclass(frozen=True, slots=True)
class RollBack:
    """The canary's change failed (or was superseded): the gated waves are dropped and the
    canary (None: none runs the change) restarts onto the accepted config with the OOM
    step it had before the change, unless an operator's stop stands."""

    canary: int | None
    oom_step: int


@dataclass(frozen=True, slots=True)
class ResetOom:
    """The operator reset the worker's OOM ladder (`farmctl reset-oom`)."""

    worker: int


@dataclass(frozen=True, slots=True)
class Reconfigure:
    """`spec` in force (a reload's, a canary rollback's): its policy; removed workers
    (already stopped) go, added ones arrive STOPPED (a `Start` starts them)."""

    spec: FarmSpec
    added: Sequence[int] = ()
    removed: Sequence[int] = ()


FarmCommand = (
    Start
    | Stop
    | RestartRolling
    | Release
    | HoldOut
    | ReleaseGate
    | RollBack
    | ResetOom
    | Reconfigure
)


class FarmEntry(Protocol):
    """The agent's one way in, as the modules that change the farm see it (the agent
    implements it; `operations.Farm` and `reloader.Farm` add what else each needs): the
    config and policy in force, the workers' states read-only, and `submit`."""

    @property
    def spec(self) -> FarmSpec: ...

    @property
    def policy(self) -> Policy: ...

    def states(self) -> Mapping[int, WorkerState]: ...

    def submit(self, command: FarmCommand) -> None: ...
