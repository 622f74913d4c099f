"""reload_plan's diff, called directly (issue 27: no test held it): which workers
restart, arrive and go when a reload changes the config."""

from __future__ import annotations

from sglang_farm.reload_plan import ReloadPlan, plan_reload
from sglang_farm.sglang_argv import Command


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
