"""The admission config the farm gives smg's priority scheduler (gateway.scheduler): its
YAML, how it is sized from the workers' max_running_requests, how `[gateway]
priority_user_share` is checked, and how it reaches smg (the launcher writes the file)."""

from __future__ import annotations

import os
import stat
from dataclasses import replace
from pathlib import Path

import pytest

from sglang_farm.config import load_spec
from sglang_farm.errors import ConfigError
from sglang_farm.gateway import launch, scheduler
from sglang_farm.gateway.managed import for_farm, launch_argv, problems
from sglang_farm.spec import GatewayRouting

yaml = pytest.importorskip("yaml")

FIELDS = {
    "reserved_floor",
    "reserved_per_slot",
    "queue_size",
    "queue_timeout_secs",
    "starvation_threshold_secs",
    "can_preempt",
}


def farm(gateway: str = "", workers: int = 8, max_running: int | None = 8) -> str:
    run = "" if max_running is None else f"max_running_requests = {max_running}\n"
    gpus = ", ".join(str(i) for i in range(workers))
    return (
        f'[workers]\ngpus = [{gpus}]\n\n[sglang]\nmodel_path = "/models/m"\n{run}\n'
        f'[gateway]\nmode = "managed"\n{gateway}'
    )


def test_the_yaml_names_every_class_and_field_and_holds_slots_for_default_alone() -> None:
    doc = yaml.safe_load(scheduler.scheduler_yaml(0.125, 8))
    assert set(doc) == {"classes"}
    assert set(doc["classes"]) == {"system", "interactive", "default", "bulk"}
    for name, c in doc["classes"].items():
        assert set(c) == FIELDS, name  # smg 1.13 refuses a class missing a field
        assert c["queue_timeout_secs"] > 0 and c["starvation_threshold_secs"] > 0
    d = doc["classes"]["default"]
    assert (d["reserved_floor"], d["reserved_per_slot"]) == (8, 0.125)
    for name in ("system", "interactive", "bulk"):
        c = doc["classes"][name]
        assert (c["reserved_floor"], c["reserved_per_slot"]) == (0, 0.0), name
    assert doc["classes"]["bulk"]["can_preempt"] is False
    assert doc["classes"]["interactive"]["can_preempt"] is True


@pytest.mark.parametrize(
    ("share", "slots", "held"),
    [
        (0.125, 64, 8),
        (0.125, 16, 2),
        (0.125, 4, 1),
        (0.3, 10, 3),
        (0.0, 64, 0),
        (0.5, 0, 1),
        (0.5, 100_000, scheduler.MAX_FLOOR),  # smg's start-up capacity, before any worker
    ],
)
def test_user_slots_are_the_share_rounded_up_and_at_least_one(
    share: float, slots: int, held: int
) -> None:
    assert scheduler.user_slots(share, slots) == held


def test_config_slots_count_an_unset_max_running_as_sglangs_unknown_figure() -> None:
    assert scheduler.config_slots([8, 8, None]) == 16 + scheduler.DEFAULT_MAX_RUNNING


@pytest.mark.parametrize("share", [-0.1, 1.0, 2.0, float("nan")])
def test_the_yaml_refuses_a_share_outside_0_to_1(share: float) -> None:
    with pytest.raises(ValueError, match="priority_user_share"):
        scheduler.scheduler_yaml(share, 1)


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("priority_user_share = 1", "fraction in [0, 1)"),
        ("priority_user_share = -0.5", "fraction in [0, 1)"),
        ("priority_user_share = 'an eighth'", "expected a number"),
    ],
)
def test_a_bad_share_names_its_key_and_what_to_write(line: str, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_spec(farm(line + "\n"), source="farm.toml")
    msg = str(err.value)
    assert "gateway.priority_user_share" in msg and says in msg, msg


def test_extra_args_may_not_name_the_scheduler_config() -> None:
    with pytest.raises(ConfigError) as err:
        load_spec(
            farm('extra_args = ["--priority-scheduler-config", "/tmp/x.yaml"]\n'),
            source="farm.toml",
        )
    assert "set priority_user_share instead" in str(err.value)


def test_the_managed_gateway_is_sized_from_the_workers_max_running_requests() -> None:
    spec = load_spec(farm("priority_scheduler = true\n"), source="farm.toml")
    gw = for_farm(spec)
    assert gw.user_slots == 16  # 1/4 of 8 workers x 8
    argv = launch_argv(gw, "/usr/bin/python3")
    head = argv[: argv.index("launch")]
    assert head[head.index("--scheduler-user-share") + 1] == "0.25"
    assert head[head.index("--scheduler-user-slots") + 1] == "16"
    assert "--priority-scheduler-enabled" in argv
    unset = for_farm(load_spec(farm("priority_scheduler = true\n", 2, None), source="f.toml"))
    assert unset.user_slots == scheduler.user_slots(0.25, 2 * scheduler.DEFAULT_MAX_RUNNING)


def test_without_the_scheduler_no_admission_config_is_written() -> None:
    gw = for_farm(load_spec(farm("priority_user_share = 0.25\n"), source="farm.toml"))
    argv = launch_argv(gw, "/usr/bin/python3")
    assert "--scheduler-user-share" not in argv
    assert "--priority-scheduler-enabled" not in argv


def test_a_gateway_built_without_slots_holds_one_for_users() -> None:
    spec = load_spec(farm("priority_scheduler = true\n"), source="farm.toml")
    gw = replace(for_farm(spec), user_slots=None)
    argv = launch_argv(gw, "/usr/bin/python3")
    assert argv[argv.index("--scheduler-user-slots") + 1] == "1"
    assert problems(replace(gw, routing=GatewayRouting(priority_user_share=1.0)))


def test_the_launcher_writes_the_yaml_where_only_its_user_can_write(tmp_path: Path) -> None:
    args = launch.smg_args(
        ["--scheduler-user-share", "0.25", "--scheduler-user-slots", "3", "launch", "--x"]
    )
    path = Path(args[args.index("--priority-scheduler-config") + 1])
    assert args[:2] == ["launch", "--x"]
    assert path.read_text() == scheduler.scheduler_yaml(0.25, 3)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert path.stat().st_uid == path.parent.stat().st_uid == os.getuid()


@pytest.mark.parametrize(
    "argv",
    [
        ["--scheduler-user-share", "0.1", "launch", "--priority-scheduler-config", "/tmp/y"],
        ["--scheduler-user-share", "1.5", "launch"],
        ["--scheduler-user-share", "0.1", "--scheduler-user-slots", "-1", "launch"],
        ["--scheduler-user-share", "0.1", "--scheduler-user-slots", "5000", "launch"],
    ],
)
def test_the_launcher_refuses_a_second_config_or_a_bad_value(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        launch.smg_args(argv)
