"""farmctl's exit codes and the errors that carry them: one line on stderr, no traceback.

Apart from the verbs because every verb raises them and the numbers are a contract
(docs/control-protocol.md), read by orchestrators, not a detail of one command.
"""

from __future__ import annotations

import sys
from enum import IntEnum
from typing import IO, Any

import click


class Exit(IntEnum):
    """farmctl's exit codes (stable; documented in docs/control-protocol.md)."""

    OK = 0
    FAILED = 1  # the agent refused the command or the operation failed
    USAGE = 2  # bad command line, unknown worker, unreadable --config
    NOT_RUNNING = 3  # the named worker is not running / ended failed
    UNREACHABLE = 4  # no agent answers at the socket
    ROLLED_BACK = 5  # reload: the canary failed its analysis and was put back (docs/canary.md)
    HELD = 6  # reload: the change is held (too little traffic to judge, or rejected before)
    TIMED_OUT = 7  # wait, drain-host: time ran out (something is still under way)
    HALTED = 8  # wait: the rollout is halted, or the model stage failed
    DRAINED = 9  # wait: the host is held out of the gateway (drain-host)
    RESTART_NEEDED = 10  # reload: valid, but only an agent restart applies it ([gateway])
    UNCONFIRMED = 11  # drain-host: a gateway that does not answer may still route to the host


class FarmctlError(click.ClickException):
    """An expected error: one line on stderr, no traceback. Subclasses set the exit code."""

    exit_code = Exit.FAILED

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(f"farmctl: {self.format_message()}", file=file or sys.stderr)


class Failed(FarmctlError):
    exit_code = Exit.FAILED


class BadUsage(FarmctlError):
    exit_code = Exit.USAGE


class NotRunning(FarmctlError):
    exit_code = Exit.NOT_RUNNING


class Unreachable(FarmctlError):
    exit_code = Exit.UNREACHABLE


class RolledBack(FarmctlError):
    exit_code = Exit.ROLLED_BACK


class Held(FarmctlError):
    exit_code = Exit.HELD


class RestartNeeded(FarmctlError):
    exit_code = Exit.RESTART_NEEDED


class TimedOut(FarmctlError):
    exit_code = Exit.TIMED_OUT


class Unconfirmed(FarmctlError):
    exit_code = Exit.UNCONFIRMED


class Halted(FarmctlError):
    exit_code = Exit.HALTED


class HostDrained(FarmctlError):
    exit_code = Exit.DRAINED
