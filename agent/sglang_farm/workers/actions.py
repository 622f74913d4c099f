"""Pure: the actions the supervisor returns for the agent to carry out (launch, stop,
watch a drain, log a note)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Launch:
    """Start the worker's process with the command line of its current OOM step."""

    worker: int


@dataclass(frozen=True, slots=True)
class Terminate:
    """Stop the worker's whole process tree (SIGTERM, SIGKILL after the stop timeout)."""

    worker: int


@dataclass(frozen=True, slots=True)
class Drain:
    """Watch the worker drain: out of the gateway, then no request running or queued;
    report `Drained`. (The supervisor stops it anyway when the drain budget is spent.)"""

    worker: int


@dataclass(frozen=True, slots=True)
class Note:
    """A fact to log: a snake_case `event` and its `fields` (the agent adds worker and gpu)."""

    event: str
    fields: Mapping[str, object] = field(default_factory=dict)


Action = Launch | Terminate | Drain | Note
