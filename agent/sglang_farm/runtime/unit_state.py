"""Pure: what the farm knows of a worker's systemd unit, and the events a change implies.

`observe` folds each observed `UnitState` (the properties D-Bus reports: active and sub
state, main PID, how the last main process ended) into `Tracked` and returns the
`Started`/`Exited` events it implies; snapshots may skip states or arrive stale.
Unit names back to workers (`worker_of`, `units_of`; the other way is
`unit_syntax.worker_unit`), property dicts into a `UnitState` (`unit_state_from`,
`exec_start_argv`): no D-Bus, no pystemd, tested in milliseconds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from sglang_farm.runtime import Exited, RuntimeEvent, Started

# siginfo si_code values systemd reports as ExecMainCode (waitid(2)).
CLD_EXITED, CLD_KILLED, CLD_DUMPED = 1, 2, 3

_RUNNING_STATES = frozenset({"activating", "active", "reloading"})
_DOWN_STATES = frozenset({"inactive", "failed"})


@dataclass(frozen=True, slots=True)
class UnitState:
    """The properties of one worker unit that the farm reads."""

    active_state: str = "inactive"
    sub_state: str = "dead"
    main_pid: int = 0
    exec_main_pid: int = 0
    exec_main_code: int = 0  # 0 while running; CLD_* once the main process exited
    exec_main_status: int = 0
    result: str = "success"
    n_restarts: int = 0

    @property
    def running(self) -> bool:
        return self.active_state in _RUNNING_STATES and self.main_pid > 0

    @property
    def exit_status(self) -> int | None:
        """The last main process's exit: >= 0 exit code, < 0 killing signal, None if unknown."""
        return exit_status(self.exec_main_code, self.exec_main_status)


@dataclass(frozen=True, slots=True)
class Tracked:
    """What the loop knows of one unit: its last state and which main PID is reported live."""

    state: UnitState
    live_pid: int | None = None  # Started emitted, Exited not yet
    ended_pid: int | None = None  # the last PID Exited was emitted for


def exit_status(code: int, status: int) -> int | None:
    """Map systemd's ExecMainCode/ExecMainStatus to the farm's status (CLD_KILLED 9 -> -9)."""
    if code == CLD_EXITED:
        return status
    if code in (CLD_KILLED, CLD_DUMPED):
        return -status
    return None


def worker_of(unit: str, prefix: str = "sglang") -> int | None:
    """`sglang@3.service` -> 3; None for any other unit."""
    head = f"{prefix}@"
    if not (unit.startswith(head) and unit.endswith(".service")):
        return None
    inst = unit[len(head) : -len(".service")]
    return int(inst) if inst.isdecimal() else None


def observe(
    worker: int, prev: Tracked | None, new: UnitState, *, silent: bool = False
) -> tuple[Tracked, list[RuntimeEvent]]:
    """Fold one observed unit state into what is known; return the events it implies.

    Snapshots may skip intermediate states (systemd coalesces signals and we read
    the newest properties), and may arrive stale; each rule copes with both.
    `silent` seeds the state (agent start, adoption) without events.
    """
    live = prev.live_pid if prev is not None else None
    ended = prev.ended_pid if prev is not None else None
    events: list[RuntimeEvent] = []
    if live is not None:
        if new.exec_main_pid == live and new.exec_main_code != 0:
            # running -> exited: systemd recorded how this very process ended.
            events.append(Exited(worker, live, new.exit_status, new.result))
            ended, live = live, None
        elif new.main_pid != live and (new.main_pid != 0 or new.active_state in _DOWN_STATES):
            # running -> gone without its exit record (a newer run replaced it already).
            events.append(Exited(worker, live, None, new.result))
            ended, live = live, None
    elif (
        prev is not None
        and prev.state.active_state in _RUNNING_STATES | {"deactivating"}
        and new.active_state in _DOWN_STATES
        and new.exec_main_pid not in (0, ended)
        and new.exec_main_pid != prev.state.exec_main_pid
    ):
        # activating -> failed before a MainPID was ever seen (exec failed at once).
        events.append(Exited(worker, new.exec_main_pid, new.exit_status, new.result))
        ended = new.exec_main_pid
    if live is None and new.running and new.main_pid != ended:
        # -> a new main process while activating/active: a (re)start of the worker.
        events.append(Started(worker, new.main_pid))
        live = new.main_pid
    return Tracked(new, live, ended), ([] if silent else events)


def unit_state_from(unit_props: Mapping[str, Any], service_props: Mapping[str, Any]) -> UnitState:
    """Build a UnitState from GetAll() dicts (str keys; bytes values decoded here)."""

    def s(v: Any, default: str) -> str:
        return v.decode() if isinstance(v, bytes) else (v if isinstance(v, str) else default)

    def i(v: Any) -> int:
        return int(v) if isinstance(v, int) else 0

    return UnitState(
        active_state=s(unit_props.get("ActiveState"), "inactive"),
        sub_state=s(unit_props.get("SubState"), "dead"),
        main_pid=i(service_props.get("MainPID")),
        exec_main_pid=i(service_props.get("ExecMainPID")),
        exec_main_code=i(service_props.get("ExecMainCode")),
        exec_main_status=i(service_props.get("ExecMainStatus")),
        result=s(service_props.get("Result"), "success"),
        n_restarts=i(service_props.get("NRestarts")),
    )


def exec_start_argv(service_props: Mapping[str, Any]) -> tuple[str, ...] | None:
    """The argv of the unit's (last) ExecStart= from a Service GetAll() dict, or None.

    The property is `a(sasbttttuii)`: per command, the path, the argv, and run-time
    fields; a worker's drop-in has exactly one command.
    """
    commands = service_props.get("ExecStart")
    if not isinstance(commands, list | tuple) or not commands:
        return None
    entry = commands[-1]
    if not isinstance(entry, list | tuple) or len(entry) < 2:
        return None
    argv = entry[1]
    if not isinstance(argv, list | tuple):
        return None
    return tuple(a.decode() if isinstance(a, bytes) else str(a) for a in argv)


def units_of(files: Iterable[PurePosixPath]) -> list[str]:
    """The unit names rendered files belong to: `sglang@3.service.d/50-farm.conf` ->
    `sglang@3.service`, a whole unit file -> itself; sorted, without duplicates."""
    names = {p.parts[0].removesuffix(".d") for p in files if p.parts}
    return sorted(n for n in names if n.endswith((".service", ".target")))
