"""Pure: the model stage as a state machine: its closed set of states, the view the farm
shows of it (`StagingView`: status, `why`, metrics) and the transitions from one view to
the next on what the stage reports (a progress report, its result, its failure, a new
`[model]`).

Why here: whether the rollout waits, what status says and what the metrics count follow
from these transitions alone, so each is tested on its own (tests/test_staging_state.py);
the I/O that runs a stage (`staging.driver`) only feeds them what happened.

    waiting_for(spec) ─▶ WAITING ─begun─▶ STAGING ─succeeded─▶ DONE (copied) | CURRENT (in place)
                                           │ ▲ progressed
                                           └─┴─failed─▶ FAILED (holds the rollout), or, for
                                                  a reload whose copy in place still serves,
                                                  that stage's view with this one's error

A new spec (a reload) starts again at WAITING with the totals carried over.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from types import MappingProxyType

from sglang_farm.spec import FarmSpec
from sglang_farm.staging.failure import StageError, StageFailureKind
from sglang_farm.staging.progress import StageProgress


class StageState(StrEnum):
    """Where the stage is; the metrics' state set lists them in this order."""

    WAITING = "waiting"  # configured, not begun (the agent is starting)
    STAGING = "staging"  # under way: the rollout waits
    DONE = "done"  # the copy is in place (this stage copied it)
    CURRENT = "current"  # the copy was already exactly the source: nothing was copied
    FAILED = "failed"  # no worker starts until a stage succeeds (`farmctl start`, a reload)


# The states in which no worker may start: the copy is not (known to be) in place.
HOLDS_ROLLOUT = frozenset({StageState.WAITING, StageState.STAGING, StageState.FAILED})


@dataclass(frozen=True, slots=True)
class StageResult:
    target: Path
    copied_files: int
    copied_bytes: int
    total_bytes: int
    current: bool  # the staged copy was already exactly the source: nothing was done
    old_copy: Path | None  # the previous copy, renamed aside, still to be removed
    seconds: float
    origin: str = ""


@dataclass(frozen=True, slots=True)
class StagingView:
    """The model stage ([model], docs/staging.md): the one in progress or the last one,
    and the totals the metrics count. The rollout waits while `state` is "staging";
    after "failed" no worker starts until a stage succeeds (`farmctl start`, a reload)."""

    source: str  # [model] source (and revision)
    target: str  # the workers' model_path
    state: StageState
    since: float  # wall clock: when `state` was entered
    step: str | None = None  # while staging: "checking", "downloading", "copying", "warming"
    bytes_done: int = 0
    bytes_total: int = 0
    rate: float | None = None  # bytes/s of the step under way
    eta_s: float | None = None
    error: str | None = None  # failed: what, where, by how much
    error_kind: str | None = None  # failed: a staging.failure.StageFailureKind value
    fix: str | None = None  # failed: what to do
    last_copied_bytes: int = 0  # the last completed stage's copied bytes (0: it was current)
    last_duration_s: float | None = None
    # Since the agent started (the exporter's counters):
    staged_bytes_total: int = 0
    stages_total: int = 0
    failures_by_kind: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def blocks_rollout(self) -> bool:
        return self.state in HOLDS_ROLLOUT


def model_target(spec: FarmSpec) -> Path:
    """The workers' model path (config guarantees one absolute path for all with [model])."""
    path = spec.workers[0].flags.get("model_path")
    if not isinstance(path, str):
        raise ValueError("[model] needs [sglang] model_path")  # config rejects this first
    return Path(path)


def waiting_for(spec: FarmSpec, prev: StagingView | None, *, now: float) -> StagingView | None:
    """The view for a (new) spec, not begun: `prev`'s totals carried over; None without
    [model] (the farm does not stage its model)."""
    m = spec.model
    if m is None:
        return None
    source = m.source + (f"@{m.revision}" if m.revision else "")
    fresh = StagingView(source, str(model_target(spec)), StageState.WAITING, now)
    if prev is None:
        return fresh
    return replace(
        fresh,
        staged_bytes_total=prev.staged_bytes_total,
        stages_total=prev.stages_total,
        failures_by_kind=prev.failures_by_kind,
        last_duration_s=prev.last_duration_s,
    )


def begun(view: StagingView) -> StagingView:
    """WAITING -> STAGING: the stage checks what is in place first."""
    return replace(view, state=StageState.STAGING, step="checking")


def progressed(view: StagingView, p: StageProgress) -> StagingView:
    """STAGING -> STAGING: a progress report; one that arrives after the stage ended (the
    report crossed the result on its way from the copying thread) changes nothing."""
    if view.state is not StageState.STAGING:
        return view
    return replace(
        view,
        step=p.step,
        bytes_done=p.bytes_done,
        bytes_total=p.bytes_total,
        rate=p.rate,
        eta_s=p.eta_s,
    )


def succeeded(view: StagingView, result: StageResult, *, now: float) -> StagingView:
    """STAGING -> DONE | CURRENT: the copy is in place; the error of an earlier stage is
    cleared and the totals count this one."""
    return replace(
        view,
        state=StageState.CURRENT if result.current else StageState.DONE,
        since=now,
        step=None,
        bytes_done=result.copied_bytes,
        bytes_total=result.total_bytes,
        rate=None,
        eta_s=None,
        error=None,
        error_kind=None,
        fix=None,
        last_copied_bytes=result.copied_bytes,
        last_duration_s=result.seconds,
        staged_bytes_total=view.staged_bytes_total + result.copied_bytes,
        stages_total=view.stages_total + 1,
    )


def failed(
    view: StagingView,
    error: StageError,
    *,
    now: float,
    duration_s: float,
    serving: StagingView | None = None,
) -> StagingView:
    """STAGING -> FAILED, with what failed and what to do; counted by kind unless the agent
    cancelled it (it is stopping). `serving`: the stage whose copy stays in place (a
    reload's): while that copy serves, the view stays that stage's, with this one's error,
    and never shows the farm as held."""
    failures = dict(view.failures_by_kind)
    if error.kind is not StageFailureKind.CANCELLED:
        failures[str(error.kind)] = failures.get(str(error.kind), 0) + 1
    if serving is not None and not serving.blocks_rollout:
        shown = serving  # the copy in place still serves (status: "reload REJECTED")
    else:
        shown = replace(
            view,
            state=StageState.FAILED,
            since=now,
            step=None,
            rate=None,
            eta_s=None,
            last_duration_s=duration_s,
        )
    return replace(
        shown,
        error=error.message,
        error_kind=str(error.kind),
        fix=error.fix,
        failures_by_kind=MappingProxyType(failures),
    )
