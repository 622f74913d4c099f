"""The model stage's state machine (staging/state.py), transition by transition: what the
farm shows of a stage (status, `why`, metrics) and whether it holds the rollout, from
what the stage reported; no agent, no files, no clock."""

from __future__ import annotations

import sys
import textwrap
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType

import pytest

from sglang_farm.config import load_spec
from sglang_farm.spec import FarmSpec
from sglang_farm.staging.failure import StageError, StageFailureKind, unexpected
from sglang_farm.staging.progress import StageProgress
from sglang_farm.staging.state import (
    HOLDS_ROLLOUT,
    StageResult,
    StageState,
    StagingView,
    begun,
    failed,
    model_target,
    progressed,
    succeeded,
    waiting_for,
)

T0 = 1.8e9
GiB = 1 << 30


def spec(model: str = '[model]\nsource = "/srv/models/m"', *, gpus: str = "[0, 1]") -> FarmSpec:
    text = f"""
        [farm]
        python = "{sys.executable}"
        [workers]
        gpus = {gpus}
        [metrics]
        gpu_source = "none"
        [sglang]
        model_path = "/dev/shm/m"
        {model}
        """
    return load_spec(textwrap.dedent(text), source="farm.toml")


def view(state: StageState = StageState.STAGING, **kw: object) -> StagingView:
    base = StagingView("/srv/models/m", "/dev/shm/m", state, T0)
    return replace(base, **kw)  # type: ignore[arg-type]  # the test's own fields


def result(*, copied: int = 3 * GiB, total: int = 4 * GiB, current: bool = False) -> StageResult:
    return StageResult(Path("/dev/shm/m"), 2, copied, total, current, None, 12.5)


NO_SPACE = StageError(StageFailureKind.NO_SPACE, "3.0 GiB short", "grow /dev/shm")


# ---- the states --------------------------------------------------------------------------


def test_the_states_are_a_closed_set_in_the_metrics_order() -> None:
    assert [str(s) for s in StageState] == ["waiting", "staging", "done", "current", "failed"]


@pytest.mark.parametrize(
    ("state", "holds"),
    [
        (StageState.WAITING, True),
        (StageState.STAGING, True),
        (StageState.FAILED, True),
        (StageState.DONE, False),
        (StageState.CURRENT, False),
    ],
)
def test_only_a_copy_in_place_lets_the_rollout_start(state: StageState, holds: bool) -> None:
    assert view(state).blocks_rollout is holds
    assert (state in HOLDS_ROLLOUT) is holds


# ---- a (new) spec: WAITING ---------------------------------------------------------------


def test_without_model_there_is_no_stage() -> None:
    assert waiting_for(spec(""), None, now=T0) is None
    assert waiting_for(spec(""), view(StageState.DONE, stages_total=3), now=T0) is None


def test_a_spec_waits_with_its_source_revision_and_target() -> None:
    v = waiting_for(spec('[model]\nsource = "Qwen/Q"\nrevision = "v2"'), None, now=T0 + 1)
    assert v == StagingView("Qwen/Q@v2", "/dev/shm/m", StageState.WAITING, T0 + 1)
    assert v is not None and (v.bytes_done, v.bytes_total, v.last_copied_bytes) == (0, 0, 0)
    local = waiting_for(spec(), None, now=T0)
    assert local is not None and local.source == "/srv/models/m"


def test_a_new_spec_starts_again_with_the_totals_carried_over() -> None:
    failures = MappingProxyType({"no_space": 2})
    prev = view(
        StageState.FAILED,
        bytes_done=5,
        bytes_total=9,
        error="short",
        error_kind="no_space",
        fix="grow",
        last_copied_bytes=7,
        last_duration_s=4.0,
        staged_bytes_total=100,
        stages_total=3,
        failures_by_kind=failures,
    )
    v = waiting_for(spec(), prev, now=T0 + 5)
    assert v == StagingView(
        "/srv/models/m",
        "/dev/shm/m",
        StageState.WAITING,
        T0 + 5,
        last_duration_s=4.0,
        staged_bytes_total=100,
        stages_total=3,
        failures_by_kind=failures,
    )


def test_the_target_is_the_workers_model_path() -> None:
    assert model_target(spec()) == Path("/dev/shm/m")
    assert model_target(spec(gpus="[3]")) == Path("/dev/shm/m")  # a farm of one worker
    no_path = replace(spec(), workers=tuple(replace(w, flags={}) for w in spec().workers))
    with pytest.raises(ValueError, match="model_path"):
        model_target(no_path)


# ---- WAITING -> STAGING, and its progress ------------------------------------------------


def test_a_stage_begins_by_checking() -> None:
    w = view(StageState.WAITING, stages_total=2)
    assert begun(w) == replace(w, state=StageState.STAGING, step="checking")


def test_progress_shows_the_step_bytes_rate_and_time_left() -> None:
    v = progressed(view(step="checking"), StageProgress("copying", 1 * GiB, 4 * GiB, 2.0))
    assert v == view(step="copying", bytes_done=GiB, bytes_total=4 * GiB, rate=GiB / 2.0, eta_s=6.0)


@pytest.mark.parametrize("state", [s for s in StageState if s is not StageState.STAGING])
def test_a_late_progress_report_changes_nothing(state: StageState) -> None:
    v = view(state, bytes_done=1, bytes_total=2)
    assert progressed(v, StageProgress("copying", 5, 10, 1.0)) is v


# ---- STAGING -> DONE | CURRENT -------------------------------------------------------------


def test_a_stage_that_copied_is_done_and_counted() -> None:
    v = view(
        step="copying",
        bytes_done=1,
        rate=3.0,
        eta_s=9.0,
        error="before",
        error_kind="no_space",
        fix="grow",
        staged_bytes_total=GiB,
        stages_total=1,
    )
    assert succeeded(v, result(), now=T0 + 20) == view(
        StageState.DONE,
        since=T0 + 20,
        bytes_done=3 * GiB,
        bytes_total=4 * GiB,
        last_copied_bytes=3 * GiB,
        last_duration_s=12.5,
        staged_bytes_total=4 * GiB,
        stages_total=2,
    )


def test_a_copy_already_in_place_is_current_and_counted_as_a_stage() -> None:
    v = succeeded(view(), result(copied=0, current=True), now=T0 + 1)
    assert v.state is StageState.CURRENT
    assert (v.stages_total, v.staged_bytes_total, v.last_copied_bytes) == (1, 0, 0)


# ---- STAGING -> FAILED -----------------------------------------------------------------------


def test_a_failed_stage_holds_the_farm_and_says_what_and_what_to_do() -> None:
    v = view(step="copying", bytes_done=GiB, bytes_total=4 * GiB, rate=1.0, eta_s=3.0)
    shown = failed(v, NO_SPACE, now=T0 + 30, duration_s=7.5)
    assert shown == view(
        StageState.FAILED,
        since=T0 + 30,
        bytes_done=GiB,
        bytes_total=4 * GiB,
        error="3.0 GiB short",
        error_kind="no_space",
        fix="grow /dev/shm",
        last_duration_s=7.5,
        failures_by_kind={"no_space": 1},
    )
    assert shown.blocks_rollout
    again = failed(begun(shown), NO_SPACE, now=T0 + 40, duration_s=1.0)
    assert again.failures_by_kind == {"no_space": 2}


def test_a_cancelled_stage_is_not_counted_as_a_failure() -> None:
    stop = StageError(StageFailureKind.CANCELLED, "the agent is stopping", "nothing")
    v = failed(view(failures_by_kind=MappingProxyType({"no_space": 1})), stop, now=T0, duration_s=1)
    assert v.state is StageState.FAILED and v.error_kind == "cancelled"
    assert v.failures_by_kind == {"no_space": 1}


def test_a_reload_whose_stage_fails_shows_the_serving_copy_with_the_error() -> None:
    serving = view(StageState.DONE, since=T0 - 100, last_copied_bytes=5, stages_total=1)
    under_way = begun(replace(serving, source="/srv/models/v2", state=StageState.WAITING))
    v = failed(under_way, NO_SPACE, now=T0, duration_s=2.0, serving=serving)
    assert v == replace(
        serving,
        error="3.0 GiB short",
        error_kind="no_space",
        fix="grow /dev/shm",
        failures_by_kind={"no_space": 1},
    )
    assert not v.blocks_rollout


def test_a_reload_after_a_failed_stage_that_fails_again_still_holds_the_farm() -> None:
    held = failed(view(), NO_SPACE, now=T0, duration_s=1.0)
    v = failed(begun(held), NO_SPACE, now=T0 + 9, duration_s=2.0, serving=held)
    assert v.state is StageState.FAILED and v.since == T0 + 9 and v.last_duration_s == 2.0
    assert v.failures_by_kind == {"no_space": 2}


# ---- an unexpected error: a failed stage, never one left staging ----------------------------


def test_an_os_error_outside_the_copy_is_an_io_error_naming_the_cause() -> None:
    e = unexpected(PermissionError(13, "Permission denied"), "/src", "/dst", hub=True)
    assert e.kind is StageFailureKind.IO_ERROR
    assert e.message == "staging /src into /dst failed: Permission denied"
    assert "permissions, the disk" in e.fix
    bare = unexpected(OSError("no strerror"), "/src", "/dst", hub=False)
    assert bare.message == "staging /src into /dst failed: no strerror"


@pytest.mark.parametrize(("hub", "kind"), [(True, "hub_error"), (False, "io_error")])
def test_any_other_error_is_the_hubs_or_an_io_error(hub: bool, kind: str) -> None:
    e = unexpected(KeyError("siblings"), "Qwen/Q", "/dst", hub=hub)
    assert e.kind == kind
    assert e.message == "staging Qwen/Q into /dst failed: KeyError: 'siblings'"
    assert "journalctl -u sglang-farm" in e.fix
