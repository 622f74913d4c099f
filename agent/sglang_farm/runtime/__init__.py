"""Pure: the seam between the supervisor and whatever runs worker processes.

Two implementations obey it: `runtime.process` (child processes, each in its own
session) and `runtime.systemd` (units `sglang@N` over D-Bus). Both report what they
observe as `RuntimeEvent`s through the `emit` callback they are built with; neither
decides anything (the supervisor does).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Protocol

from sglang_farm.sglang.argv import Command
from sglang_farm.spec import FarmSpec


@dataclass(frozen=True, slots=True)
class Exited:
    """The worker's main process exited (or its unit left active/activating for failed/inactive)."""

    worker: int
    pid: int | None
    # Exit status: >= 0 an exit code, < 0 the signal number that killed it (-9 = SIGKILL).
    status: int | None
    # systemd's Result= ("exit-code", "signal", "oom-kill", "timeout", ...), or None.
    result: str | None = None


@dataclass(frozen=True, slots=True)
class Started:
    worker: int
    pid: int | None


@dataclass(frozen=True, slots=True)
class LogLine:
    worker: int
    text: str


RuntimeEvent = Exited | Started | LogLine
Emit = Callable[[RuntimeEvent], None]


@dataclass(frozen=True, slots=True)
class Running:
    """A worker found running when the agent starts (adoption)."""

    worker: int
    pid: int
    active: bool  # systemd: active (ready gate passed) vs activating
    # The command line it was started with (systemd: its main process's, else its unit's
    # ExecStart=), to compare with what the config now renders; None when unknown.
    argv: tuple[str, ...] | None = None


class Runtime(Protocol):
    """How worker processes are run. What differs between runtimes is a method here, so the
    agent never asks which runtime it has."""

    name: str
    # True under systemd: workers are units that keep running when the agent stops.
    # False for child processes: the agent stops them before it exits.
    workers_outlive_agent: bool

    async def prepare(self, spec: FarmSpec, commands: Mapping[int, Command]) -> frozenset[int]:
        """Make the next launch use these command lines (systemd: install the drop-ins).

        Called at agent start and before each launch. A no-op where `start` takes the
        command line itself. Returns the workers whose secrets (API key, env values) this
        call changed: one running was started with the old ones, which its argv cannot
        show (secrets are kept off it: docs/security.md).
        """
        ...

    async def confirm_ready(self, worker: int) -> bool:
        """After /health answered: does the runtime agree the worker is ready?

        systemd: the unit left `activating` for `active` (its readiness gate passed).
        Processes: always.
        """
        ...

    def exit_pending(self, worker: int) -> bool:
        """True while the worker's exit is known but not yet reported (its last log lines
        are awaited): a failed health probe then says nothing about a hang."""
        ...

    async def worker_pids(self, worker: int) -> frozenset[int]:
        """The live processes of the worker's own tree (empty when it is not running).

        The readiness rule asks this: only a socket held by one of these may make the
        worker ready (`portowner`). systemd: the processes of the unit's cgroup.
        Processes: the worker's session and process group, and its descendants.
        """
        ...

    async def start(self, worker: int, command: Command) -> None:
        """Launch the worker. Returns once launched (not once ready); emits Started."""
        ...

    async def stop(self, worker: int, timeout: float) -> None:
        """Stop the worker's whole process tree: SIGTERM, then SIGKILL after `timeout`.

        Returns when nothing of it is left; emits Exited.
        """
        ...

    async def adopt(self, configured: Collection[int] | None = None) -> Mapping[int, Running]:
        """Workers already running (systemd units survive the agent); empty for processes.

        `configured`: the config's worker ids; a running worker outside them is a stray,
        reported and stopped by the runtime, never adopted.
        """
        ...

    def log_tail(self, worker: int, lines: int) -> list[str]:
        """The worker's last output lines, oldest first."""
        ...

    async def close(self) -> None:
        """Release resources; does not stop workers under systemd, does under process."""
        ...


class GatewayRunner(Protocol):
    """What runs a managed gateway: a child of the agent (process runtime) or its own
    systemd unit (`sglang-farm-gateway.service`)."""

    async def start(self) -> None:
        """Make it run (idempotent); returns once it is launched, not once it answers."""
        ...

    async def close(self) -> None:
        """The agent is going away: a child is stopped, a unit is left running."""
        ...

    async def restart(self) -> None:
        """Stop the running gateway and start it again (issue 30: a rotated admin key,
        which smg reads only at its start)."""
        ...

    async def pids(self) -> frozenset[int]:
        """The gateway's own live processes (empty when it does not run): only a socket
        they hold is sent the admin key (`gateway.listener`)."""
        ...
