"""Pure: which running workers load a model copy other than the one now at model_path,
and when the copy they leave behind may be removed.

A stage that replaced the copy leaves every worker that loaded (or loads) the previous
one on it: they roll to the new copy, and the previous copy, renamed aside by the
copier, goes once they have (`RemoveOldCopy`). A stage that found the copy already in
place can still leave workers behind: an agent restarted mid-reload adopts workers with
an unchanged command line that started before the copy was installed. The facts (when
the copy was installed, when each process started) are read by `staging.driver`; which
workers loaded the previous copy at all is the workers' phases (`workers.loading`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sglang_farm.spec import FarmSpec
from sglang_farm.staging.state import StageResult

# /proc's start is in clock ticks, and the wall clock may have been stepped since: a
# process that started this soon after the copy's install counts as started before it
# (one restart too many is harmless, one too few is not).
STARTED_SLACK_S = 0.5
# What removing the old copy waits for beyond the rolling restart's waves at most.
REMOVAL_SLACK_S = 60.0


@dataclass(frozen=True, slots=True)
class RemoveOldCopy:
    """Remove `path` once no rolling restart is under way, or after `wait_s` at most
    (Linux keeps the files a worker still has open until it closes them: removal after
    the waves' time is safe even for a worker that never restarted)."""

    path: Path
    wait_s: float
    target: Path  # model_path, where `path` goes back should the change be rolled back


def on_old_copy(
    result: StageResult,
    started: Mapping[int, float | None],
    installed: float | None,
    launched: Mapping[int, float] | None = None,
) -> list[int]:
    """Of the loading workers (`started`: worker -> when its process started, wall time,
    None: unknown), those on a copy other than the one at model_path: all of them when
    this stage replaced it; else those whose process started before the copy was
    `installed` (None: no recorded install, none).

    A process that started within `STARTED_SLACK_S` of the install is ambiguous by its
    start alone (the canary starts that soon after a stage): `launched` (worker -> when
    this farm launched that same process, wall time, from state.json) settles it: a
    launch at or after the install is on the copy in place."""
    if not result.current:
        return sorted(started)
    if installed is None:
        return []
    launched = launched or {}

    def stale(w: int, at: float | None) -> bool:
        if at is None or at >= installed + STARTED_SLACK_S:
            return False
        if at < installed - STARTED_SLACK_S:
            return True  # clearly before the swap
        return not (w in launched and launched[w] >= installed)

    return sorted(w for w, at in started.items() if stale(w, at))


def old_copy_removal(result: StageResult, spec: FarmSpec) -> RemoveOldCopy | None:
    """What becomes of the copy this stage swapped out (None: there is none): removed
    after the rolling restart onto the new one, which takes a wave's load, stop and drain
    time per worker at most."""
    if result.old_copy is None:
        return None
    per_wave = (
        spec.startup.load_timeout
        + spec.restart.stop_timeout
        + (spec.gateway.drain_timeout if spec.gateway.enabled else 0.0)
    )
    wait_s = per_wave * len(spec.workers) + REMOVAL_SLACK_S
    return RemoveOldCopy(result.old_copy, wait_s, result.target)
