"""reload_plan, called directly (issue 27: no test held it): which workers restart,
arrive and go when a reload changes the config, whether it is refused or stages the
model first (issue 24), and what starts and restarts after."""

from __future__ import annotations

import sys
import textwrap

import pytest

from sglang_farm.config import load_spec
from sglang_farm.sglang.argv import Command
from sglang_farm.spec import FarmSpec
from sglang_farm.staging.failure import StageError, StageFailureKind
from sglang_farm.workers.reload_plan import (
    ModelChange,
    Refused,
    ReloadEffects,
    ReloadPlan,
    model_change,
    plan_reload,
    reload_effects,
    stage_refused,
)


def cmd(*argv: str, key: str | None = None, **env: str) -> Command:
    return Command(argv, tuple(sorted(env.items())), key)


def test_only_a_changed_command_line_restarts_a_worker() -> None:
    old = {0: cmd("a"), 1: cmd("b"), 2: cmd("c", CUDA_VISIBLE_DEVICES="2")}
    new = {0: cmd("a"), 1: cmd("b", "--x"), 2: cmd("c", CUDA_VISIBLE_DEVICES="3")}
    assert plan_reload(old, new) == ReloadPlan(changed=(1, 2), added=(), removed=())


def test_a_changed_api_key_restarts_a_worker() -> None:
    assert plan_reload({0: cmd("a", key="k1")}, {0: cmd("a", key="k2")}).changed == (0,)


def test_workers_that_arrive_and_go_are_named_in_order() -> None:
    old = {5: cmd("a"), 1: cmd("b"), 3: cmd("c")}
    new = {3: cmd("c2"), 7: cmd("d"), 2: cmd("e")}
    assert plan_reload(old, new) == ReloadPlan(changed=(3,), added=(2, 7), removed=(1, 5))


def test_an_unchanged_config_changes_nothing() -> None:
    same = {0: cmd("a"), 1: cmd("b")}
    assert plan_reload(same, dict(same)) == ReloadPlan((), (), ())


# ---- refuse, restage or keep (issue 24: the decision `Agent._reload` carries out) ---------


MODEL = '[model]\nsource = "/srv/models/m"'
GATEWAY = '[gateway]\nmode = "external"\nurl = "http://10.0.0.9:30000"'


def spec(model: str = MODEL, *, model_path: str = "/dev/shm/m", gateway: str = "") -> FarmSpec:
    text = f"""
        [farm]
        python = "{sys.executable}"
        [workers]
        gpus = [0, 1]
        [metrics]
        gpu_source = "none"
        [sglang]
        model_path = "{model_path}"
        {model}
        {gateway}
        """
    return load_spec(textwrap.dedent(text), source="farm.toml")


def test_a_changed_gateway_is_refused_with_what_to_do() -> None:
    for old, new in [(spec(), spec(gateway=GATEWAY)), (spec(gateway=GATEWAY), spec())]:
        assert model_change(old, new, stage_holds=False) == Refused(
            (
                "farm.toml: [gateway] changed; a reload does not apply it: restart the agent "
                "(systemctl restart sglang-farm) to apply [gateway] changes",
            ),
            restart_needed=True,  # farmctl reload exits 10: an orchestrator restarts the agent
        )
    # Refused before anything is staged, even with a new model.
    new = spec('[model]\nsource = "/srv/models/v2"', gateway=GATEWAY)
    assert isinstance(model_change(spec(), new, stage_holds=True), Refused)


def test_a_refusal_of_the_config_itself_needs_no_agent_restart() -> None:
    refused = stage_refused(spec(), StageError(StageFailureKind.NO_SPACE, "full", "free space"))
    assert not refused.restart_needed


def test_the_same_model_keeps_the_copy_in_place() -> None:
    assert model_change(spec(), spec(), stage_holds=False) is ModelChange.KEEP
    assert model_change(spec(""), spec(""), stage_holds=False) is ModelChange.KEEP
    assert model_change(spec(""), spec(""), stage_holds=True) is ModelChange.KEEP


@pytest.mark.parametrize(
    "new",
    [
        spec('[model]\nsource = "/srv/models/v2"'),  # a new source
        spec('[model]\nsource = "/srv/models/m"\nheadroom = 0'),  # any [model] change
        spec(model_path="/dev/shm/other"),  # the same source into another model_path
    ],
)
def test_a_changed_model_or_target_is_staged_first(new: FarmSpec) -> None:
    assert model_change(spec(), new, stage_holds=False) is ModelChange.RESTAGE


def test_a_model_new_to_the_farm_is_staged() -> None:
    assert model_change(spec(""), spec(), stage_holds=False) is ModelChange.RESTAGE


def test_a_failed_stage_is_staged_again_by_any_reload() -> None:
    assert model_change(spec(), spec(), stage_holds=True) is ModelChange.RESTAGE


def test_a_model_removed_from_the_config_is_no_longer_staged() -> None:
    assert model_change(spec(), spec(""), stage_holds=False) is ModelChange.DROP
    assert model_change(spec(), spec(""), stage_holds=True) is ModelChange.DROP


def test_a_stage_that_fails_refuses_the_reload_naming_what_and_what_to_do() -> None:
    err = StageError(StageFailureKind.SOURCE_MISSING, "/srv/v2 does not exist", "fix [model]")
    assert stage_refused(spec(), err) == Refused(
        ("farm.toml: [model] not staged: /srv/v2 does not exist; fix [model]",)
    )


# ---- what starts and restarts once the new config is in force ----------------------------


PLAN = ReloadPlan(changed=(4,), added=(7,), removed=(2,))


def test_only_changed_workers_restart_and_new_ones_start() -> None:
    e = reload_effects(PLAN, copy_replaced=False, loading=[0, 1, 4], held=False, workers=[0, 7])
    assert e == ReloadEffects(start=(7,), restart=(4,))


def test_a_replaced_copy_restarts_every_worker_that_loaded_the_previous_one() -> None:
    e = reload_effects(PLAN, copy_replaced=True, loading=[5, 0, 4, 7], held=False, workers=[0])
    # 7 is new: it starts on the new copy, it does not restart.
    assert e == ReloadEffects(start=(7,), restart=(0, 4, 5))


def test_a_rollout_held_by_a_failed_stage_begins_for_every_worker() -> None:
    e = reload_effects(PLAN, copy_replaced=True, loading=[], held=True, workers=[0, 1, 7])
    assert e == ReloadEffects(start=(0, 1, 7), restart=(4,))


def test_a_reload_that_changes_nothing_starts_and_restarts_nothing() -> None:
    e = reload_effects(
        ReloadPlan((), (), ()), copy_replaced=False, loading=[0], held=False, workers=[0]
    )
    assert e == ReloadEffects((), ())
