"""Stale model copies (staging/stale.py): which running workers are on a copy other than
the one at model_path, and when the copy a stage swapped out may be removed; pure, from
the facts the agent reads (/proc, the copy's install time)."""

from __future__ import annotations

import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from sglang_farm.config import load_spec
from sglang_farm.spec import FarmSpec
from sglang_farm.staging.stale import (
    REMOVAL_SLACK_S,
    STARTED_SLACK_S,
    RemoveOldCopy,
    old_copy_removal,
    on_old_copy,
)
from sglang_farm.staging.state import StageResult
from sglang_farm.workers.loading import loading
from sglang_farm.workers.phase import Phase
from sglang_farm.workers.supervisor import WorkerState

INSTALLED = 1.8e9
OLD = Path("/dev/shm/.m.old-1234")


def result(*, current: bool, old_copy: Path | None = None) -> StageResult:
    return StageResult(Path("/dev/shm/m"), 0, 0, 10, current, old_copy, 1.0)


def spec(*, gateway: bool = False, workers: int = 3) -> FarmSpec:
    text = f"""
        [farm]
        python = "{sys.executable}"
        [workers]
        gpus = {list(range(workers))}
        [startup]
        load_timeout = "2m"
        [restart]
        stop_timeout = "10s"
        [metrics]
        gpu_source = "none"
        [sglang]
        model_path = "/dev/shm/m"
        [model]
        source = "/srv/models/m"
        """
    s = load_spec(textwrap.dedent(text), source="farm.toml")
    mode = "external" if gateway else "off"
    return replace(s, gateway=replace(s.gateway, mode=mode, drain_timeout=30.0))


# ---- which workers load a copy ------------------------------------------------------------


def test_workers_whose_process_loaded_or_loads_a_copy() -> None:
    states = {i: WorkerState(i, phase=p) for i, p in enumerate(Phase)}
    held = {Phase.STARTING, Phase.READY, Phase.UNHEALTHY, Phase.DRAINING, Phase.BACKOFF}
    assert loading(states) == sorted(i for i, p in enumerate(Phase) if p in held)
    assert loading({5: WorkerState(5, Phase.READY), 2: WorkerState(2, Phase.STARTING)}) == [2, 5]


# ---- which of them are on an old copy -----------------------------------------------------


def test_a_stage_that_replaced_the_copy_leaves_every_loading_worker_on_the_old() -> None:
    started = {4: None, 1: INSTALLED + 100.0, 2: INSTALLED - 5.0}
    assert on_old_copy(result(current=False), started, None) == [1, 2, 4]
    assert on_old_copy(result(current=False), started, INSTALLED) == [1, 2, 4]


def test_with_the_copy_in_place_only_processes_older_than_its_install_are_stale() -> None:
    started = {
        0: INSTALLED - 30.0,  # started before the swap: loads the previous copy
        1: INSTALLED + 0.49,  # within the slack (half a second): counted as before
        2: INSTALLED + 0.5,  # at the slack's end: on the copy in place
        3: INSTALLED + 600.0,
        4: None,  # unknown (gone, /proc unreadable): never restarted on a guess
    }
    assert on_old_copy(result(current=True), started, INSTALLED) == [0, 1]


def test_a_copy_with_no_recorded_install_restarts_no_one() -> None:
    assert on_old_copy(result(current=True), {0: INSTALLED - 30.0}, None) == []


def test_no_loading_worker_no_stale_one() -> None:
    assert on_old_copy(result(current=False), {}, INSTALLED) == []
    assert on_old_copy(result(current=True), {}, INSTALLED) == []


# ---- when the old copy goes ----------------------------------------------------------------


def test_without_an_old_copy_nothing_is_removed() -> None:
    assert old_copy_removal(result(current=True), spec()) is None
    assert old_copy_removal(result(current=False), spec()) is None


def test_the_old_copy_goes_after_the_waves_at_most() -> None:
    # Per worker: a wave's load (2 min) and stop (10 s); 3 workers; then the slack.
    assert old_copy_removal(result(current=False, old_copy=OLD), spec()) == RemoveOldCopy(
        OLD, (120.0 + 10.0) * 3 + REMOVAL_SLACK_S, Path("/dev/shm/m")
    )
    assert REMOVAL_SLACK_S == 60.0


@pytest.mark.parametrize(("gateway", "drain"), [(True, 30.0), (False, 0.0)])
def test_with_a_gateway_each_wave_drains_first(gateway: bool, drain: float) -> None:
    action = old_copy_removal(result(current=False, old_copy=OLD), spec(gateway=gateway, workers=2))
    assert action is not None and action.wait_s == (120.0 + 10.0 + drain) * 2 + 60.0


def test_a_worker_this_farm_launched_after_the_install_is_not_stale_however_soon() -> None:
    # The canary starts within the slack of the copy's install (the stage ends, the rollout
    # launches it at once): its /proc start alone would count it as before. The launch the
    # agent recorded for that very process (state.json) says it came after: not stale.
    started = {0: INSTALLED + 0.1, 1: INSTALLED + 0.1, 2: INSTALLED - 30.0}
    launched = {0: INSTALLED + 0.05, 2: INSTALLED + 1.0}  # 1: no record (an older agent)
    assert on_old_copy(result(current=True), started, INSTALLED, launched) == [1, 2]
    # A launch recorded before the install is no excuse either.
    assert on_old_copy(
        result(current=True), {0: INSTALLED + 0.1}, INSTALLED, {0: INSTALLED - 2}
    ) == [0]
    # A launch at the install's very second is on the copy in place ("at or after": the
    # mutant on_old_copy.stale/GtE->Gt@0#2 called it stale).
    assert on_old_copy(result(current=True), {0: INSTALLED + 0.1}, INSTALLED, {0: INSTALLED}) == []
    # The slack's edge is still within it: the recorded launch settles it (the mutant
    # on_old_copy.stale/Lt->LtE@0#1 counted a process started exactly the slack before the
    # install as clearly before the swap).
    edge = INSTALLED - STARTED_SLACK_S
    assert on_old_copy(result(current=True), {0: edge}, INSTALLED, {0: INSTALLED + 0.05}) == []
