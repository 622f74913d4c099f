"""Pure: what the farm says about its own state files when it cannot trust or write them
(issue 30, items 5, 6 and 9).

One `StateAlert` per problem: `state.json` not saved (a full disk: an agent restart would
forget a drain or a quarantine), found damaged at start (its safety holds then fail
closed or are announced as dropped), or `canary.json` refused or damaged (kept aside,
never overwritten). `farmctl status` shows each (`state_alerts`), and the metrics
count them (docs/metrics.md, `sglang_farm_state_*`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class AlertKind(StrEnum):
    NOT_SAVED = "not_saved"  # the latest write failed: what changed since is not on disk
    UNREADABLE = "unreadable"  # found damaged at the agent's start; kept aside
    REFUSED = "refused"  # another user could have written it; kept aside, never read


@dataclass(frozen=True, slots=True)
class StateAlert:
    file: str  # the state file's path
    kind: AlertKind
    error: str  # why, in the words of the OS or the parser
    since: float  # wall clock: the first failure of a run of them, or the agent's start
    kept: str | None = None  # where the damaged or refused file was put aside
    then: str = ""  # what the farm did about it, and what to do

    def line(self) -> str:
        """One line for `farmctl status` and the log: what, where, what to do."""
        what = {
            AlertKind.NOT_SAVED: "is not being saved",
            AlertKind.UNREADABLE: "was unreadable at the agent's start",
            AlertKind.REFUSED: "was refused at the agent's start",
        }[self.kind]
        kept = f"; kept aside as {self.kept}" if self.kept else ""
        then = f"; {self.then}" if self.then else ""
        return f"state file {self.file} {what} ({self.error}){kept}{then}"
