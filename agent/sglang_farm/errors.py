"""Pure: the farm's error tree. Adapters translate foreign errors into these with `raise ... from`.

FarmError
├── ConfigError        a config file that does not validate (all problems at once)
├── ProtocolError      a control-socket request or reply that does not parse
└── RuntimeFailure     systemd or a child process refused an operation
"""

from __future__ import annotations

from collections.abc import Sequence


class FarmError(Exception):
    """Base of every error the farm raises on purpose."""


class ConfigError(FarmError):
    """A config that does not validate. `problems` are complete, user-facing lines."""

    def __init__(self, source: str, problems: Sequence[str]) -> None:
        self.source = source
        self.problems = tuple(problems)
        n = len(self.problems)
        head = f"{source}: {n} problem{'s' if n != 1 else ''}"
        super().__init__("\n".join([head, *(f"  {p}" for p in self.problems)]))


class ProtocolError(FarmError):
    """A bad control-socket message; `code` is one of the protocol's error codes."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(f"{code}: {message}")


class RuntimeFailure(FarmError):
    """Starting, stopping or observing a worker failed in the runtime (systemd or process)."""

