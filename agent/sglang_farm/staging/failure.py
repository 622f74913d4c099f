"""Pure: why a stage failed, as data: what, where, by how much, and what to do.

The agent keeps the last one in the farm view (`farmctl status`, `farmctl why N`) and
counts it by `kind` in the metrics; workers are not started while it stands.
"""

from __future__ import annotations

from enum import StrEnum

from sglang_farm.errors import FarmError


class StageFailureKind(StrEnum):
    NO_SPACE = "no_space"  # the target cannot hold the model plus headroom
    SOURCE_MISSING = "source_missing"  # the source directory or a file in it is gone
    BAD_SOURCE = "bad_source"  # the source is not a model directory (or its SHA256SUMS is bad)
    CHECKSUM_MISMATCH = "checksum_mismatch"  # a copied file's sha256 is not the source's
    SIZE_MISMATCH = "size_mismatch"  # a copied file's size is not the source's
    HUB_ERROR = "hub_error"  # the Hub refused or could not be reached
    CREDENTIALS = "credentials"  # the token file is missing, unreadable or readable by others
    IO_ERROR = "io_error"  # any other OSError while copying
    CANCELLED = "cancelled"  # the agent is stopping


class StageError(FarmError):
    """A stage that did not complete. `message`: what and where; `fix`: what to do."""

    def __init__(self, kind: StageFailureKind, message: str, fix: str) -> None:
        self.kind = kind
        self.message = message
        self.fix = fix
        super().__init__(f"{message}; {fix}")


def unexpected(exc: Exception, source: str, target: str, *, hub: bool) -> StageError:
    """A stage that raised something other than StageError, as a failed stage (never one
    left "staging" forever with the rollout waiting on it): an OSError outside the copy
    proper (the mount table, the walk) is an I/O error; anything else (a library's own
    error, a defect) is the Hub's when the source is on the Hub, else an I/O error."""
    if isinstance(exc, OSError):
        return StageError(
            StageFailureKind.IO_ERROR,
            f"staging {source} into {target} failed: {exc.strerror or exc}",
            "fix the cause (permissions, the disk), then `farmctl start all`",
        )
    return StageError(
        StageFailureKind.HUB_ERROR if hub else StageFailureKind.IO_ERROR,
        f"staging {source} into {target} failed: {type(exc).__name__}: {exc}",
        "check [model] and the agent's log (journalctl -u sglang-farm) for the "
        "cause, then `farmctl start all`",
    )
