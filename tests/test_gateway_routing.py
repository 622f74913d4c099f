"""smg's routing opinions as `[gateway]` keys (issue 34 §3): parsed, checked with a message
that says what to write, rendered into the managed gateway's command line; and smg's
overload judgement read back from its worker list (`gateway.routing.overloaded`)."""

from __future__ import annotations

from dataclasses import replace
from textwrap import dedent

import pytest

from sglang_farm.config import load_spec
from sglang_farm.errors import ConfigError
from sglang_farm.gateway import routing
from sglang_farm.gateway.managed import ManagedGateway, from_spec, problems, smg_argv
from sglang_farm.gateway.smg import parse_members
from sglang_farm.spec import GatewayRouting

BASE = """\
[workers]
gpus = [0, 1]

[sglang]
model_path = "/models/m"

[gateway]
mode = "managed"
"""


def load(extra: str) -> GatewayRouting:
    return load_spec(BASE + dedent(extra), source="farm.toml").gateway.routing


def only_problem(extra: str) -> str:
    with pytest.raises(ConfigError) as info:
        load(extra)
    found = list(info.value.problems)
    assert len(found) == 1, found
    return found[0]


def flag_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_defaults_are_smgs_own_and_every_one_is_on_the_command_line() -> None:
    r = load("")
    assert r == GatewayRouting()
    assert (r.overload_waiting_requests, r.overload_token_usage) == (8, 0.8)
    assert (r.stall_secs, r.wedge_secs, r.stale_secs) == (2, 3, 15)
    assert (r.warmup_secs, r.warmup_blocks, r.warmup_share) == (60, 1024, 0.25)
    assert r.overload_protection and not r.overload_shed and not r.priority_scheduler
    gw = ManagedGateway("127.0.0.1", 8000, "cache_aware", 29000, routing=r)
    argv = smg_argv(gw)
    assert "--worker-overload-protection" in argv
    assert flag_value(argv, "--worker-overload-waiting-requests") == "8"
    assert flag_value(argv, "--worker-overload-token-usage") == "0.8"
    assert flag_value(argv, "--worker-stall-secs") == "2"
    assert flag_value(argv, "--worker-wedge-secs") == "3"
    assert flag_value(argv, "--worker-stale-secs") == "15"
    assert flag_value(argv, "--worker-warmup-secs") == "60"
    assert flag_value(argv, "--worker-warmup-blocks") == "1024"
    assert flag_value(argv, "--worker-warmup-share") == "0.25"
    for absent in (
        "--worker-overload-shed",
        "--disable-worker-overload-protection",
        "--priority-scheduler-enabled",
    ):
        assert absent not in argv


def test_every_key_reaches_the_managed_gateways_argv() -> None:
    r = load(
        """\
        overload_waiting_requests = 32
        overload_token_usage = 0.95
        overload_shed = true
        stall_secs = 5
        wedge_secs = 30
        stale_secs = 0
        warmup_secs = 0
        warmup_blocks = 64
        warmup_share = 0.5
        priority_scheduler = true
        """
    )
    spec = load_spec(BASE, source="farm.toml").gateway
    argv = smg_argv(from_spec(replace(spec, routing=r)))
    assert flag_value(argv, "--worker-overload-waiting-requests") == "32"
    assert flag_value(argv, "--worker-overload-token-usage") == "0.95"
    assert "--worker-overload-shed" in argv
    assert flag_value(argv, "--worker-stall-secs") == "5"
    assert flag_value(argv, "--worker-wedge-secs") == "30"
    assert flag_value(argv, "--worker-stale-secs") == "0"
    assert flag_value(argv, "--worker-warmup-secs") == "0"
    assert flag_value(argv, "--worker-warmup-blocks") == "64"
    assert flag_value(argv, "--worker-warmup-share") == "0.5"
    assert "--priority-scheduler-enabled" in argv


def test_overload_protection_off_is_smgs_disable_flag_and_no_thresholds() -> None:
    argv = routing.smg_flags(load("overload_protection = false\n"))
    assert "--disable-worker-overload-protection" in argv
    assert not any(a.startswith("--worker-overload-") for a in argv)


def test_the_loaded_config_renders_what_the_agent_runs() -> None:
    spec = load_spec(BASE + "warmup_share = 0.5\n", source="farm.toml").gateway
    argv = smg_argv(from_spec(spec))
    assert flag_value(argv, "--worker-warmup-share") == "0.5"


@pytest.mark.parametrize(
    ("line", "key", "says"),
    [
        (
            "overload_waiting_requests = 0",
            "overload_waiting_requests",
            "overload_protection = false",
        ),
        ("overload_waiting_requests = 2.5", "overload_waiting_requests", "expected an integer"),
        ("overload_token_usage = 0", "overload_token_usage", "in (0, 1]"),
        ("overload_token_usage = 1.2", "overload_token_usage", "in (0, 1]"),
        ("overload_token_usage = '80%'", "overload_token_usage", "expected a number"),
        ("overload_protection = 'yes'", "overload_protection", "expected true or false"),
        ("stall_secs = 0", "stall_secs", "whole seconds >= 1"),
        ("stall_secs = 1.5", "stall_secs", "whole seconds as an integer"),
        ("wedge_secs = '3s'", "wedge_secs", "whole seconds as an integer"),
        ("wedge_secs = 0", "wedge_secs", "whole seconds >= 1"),
        ("stale_secs = -1", "stale_secs", "0 switches the check off"),
        ("warmup_secs = -5", "warmup_secs", "0 switches the warm-up slice off"),
        ("warmup_blocks = 0", "warmup_blocks", "warmup_secs = 0"),
        ("warmup_share = 1.5", "warmup_share", "fraction in 0..1"),
        ("warmup_share = nan", "warmup_share", "fraction in 0..1"),
        ("priority_scheduler = 1", "priority_scheduler", "expected true or false"),
    ],
)
def test_a_bad_value_names_the_key_its_line_and_what_to_write(
    line: str, key: str, says: str
) -> None:
    msg = only_problem(line + "\n")
    assert f"gateway.{key}" in msg
    assert "line 9" in msg or ":9" in msg, msg  # BASE has 8 lines: the key is on line 9
    assert says in msg, msg


def test_shed_without_protection_says_which_to_change() -> None:
    msg = only_problem("overload_protection = false\noverload_shed = true\n")
    assert "gateway.overload_shed" in msg
    assert "overload_protection = true" in msg


@pytest.mark.parametrize(
    ("arg", "key"),
    [
        ("--worker-overload-waiting-requests=4", "overload_waiting_requests"),
        ("--disable-worker-overload-protection", "overload_protection"),
        ("--worker-warmup-share", "warmup_share"),
        ("--priority-scheduler-enabled", "priority_scheduler"),
    ],
)
def test_extra_args_may_not_set_what_a_key_sets(arg: str, key: str) -> None:
    msg = only_problem(f'extra_args = ["{arg}"]\n')
    assert "gateway.extra_args" in msg
    assert f"set {key} instead" in msg, msg
    gw = ManagedGateway("127.0.0.1", 8000, "cache_aware", 29000, extra_args=(arg,))
    assert problems(gw) == []  # no routing given: a test's gateway may pass anything
    refused = problems(replace(gw, routing=GatewayRouting()))
    assert any(f"[gateway] {key}" in p for p in refused), refused


def test_a_bad_routing_value_refuses_the_argv() -> None:
    gw = ManagedGateway(
        "127.0.0.1", 8000, "cache_aware", 29000, routing=GatewayRouting(warmup_share=2.0)
    )
    with pytest.raises(ValueError, match="warmup_share"):
        smg_argv(gw)


def test_external_gateway_keys_parse_as_the_farms_assumption() -> None:
    text = BASE.replace('mode = "managed"', 'mode = "external"\nurl = "http://10.0.0.5:8000"')
    spec = load_spec(text + "overload_waiting_requests = 16\n", source="farm.toml")
    assert spec.gateway.routing.overload_waiting_requests == 16


def _load(waiting: list[int], usage: list[float]) -> dict[str, object]:
    return {
        "loads": [
            {"dp_rank": i, "num_waiting_reqs": w, "token_usage": u}
            for i, (w, u) in enumerate(zip(waiting, usage, strict=True))
        ]
    }


def judged(engine_load: object, r: GatewayRouting) -> bool:
    return routing.overloaded(*routing.engine_figures(engine_load), r)


def test_overloaded_reads_smgs_engine_load_as_smg_judges_it() -> None:
    r = GatewayRouting()
    assert not judged(_load([7], [0.79]), r)
    assert judged(_load([8], [0.0]), r)  # at or above
    assert judged(_load([4, 4], [0.0, 0.0]), r)  # summed over DP ranks
    assert judged(_load([0], [0.8]), r)
    assert judged(_load([0, 0], [0.9, 0.7]), r)  # mean over ranks
    assert not judged(_load([0, 0], [0.9, 0.5]), r)
    assert not judged(_load([12], [0.99]), replace(r, overload_protection=False))
    assert judged(_load([3], [0.0]), replace(r, overload_waiting_requests=3))
    for unknown in (None, {}, {"loads": "x"}, {"loads": [None, {"num_waiting_reqs": True}]}):
        assert routing.engine_figures(unknown) == (None, None)
        assert not judged(unknown, r)
    assert (
        routing.overload_reason(12, 0.5, r) == "12 requests waiting (overload_waiting_requests 8)"
    )


def test_smgs_worker_list_gives_each_members_figures() -> None:
    body = {
        "workers": [
            {
                "id": "a",
                "url": "http://h:1/",
                "status": "ready",
                "engine_load": _load([3, 9], [0.5, 0.7]),
            },
            {"id": "b", "url": "http://h:2", "status": "ready"},
        ]
    }
    a, b = parse_members(body)
    assert a.waiting == 12 and a.token_usage == pytest.approx(0.6)
    assert (b.waiting, b.token_usage) == (None, None)


def test_every_key_has_a_reason_and_a_flag() -> None:
    assert set(routing.KEYS) == set(routing.REASONS)
    assert len(routing.KEYS) == 12
    assert all(flag.startswith("--") for flag in routing.FLAGS)
