"""How the supervisor's notes read in the agent's log (issue 24 §1): their level, and the
one line a rollout ends with."""

from __future__ import annotations

from dataclasses import replace

from sglang_farm.config import load_spec
from sglang_farm.host.paths import DEFAULT_CONFIG_PATH
from sglang_farm.workers.notes import WARNINGS, note_level, rollout_summary

SPEC = load_spec(
    '[farm]\nname = "lab"\n[workers]\ngpus = [0]\n[sglang]\nmodel_path = "/models/m"\n',
    source="/srv/farm.toml",
)


def test_failures_are_warnings_and_the_rest_info() -> None:
    assert note_level("worker_gave_up") == "warning"
    assert note_level("rollout_halted") == "warning"
    assert note_level("worker_ready") == "info"
    assert note_level("rollout_done") == "info"
    assert all(note_level(e) == "warning" for e in WARNINGS)


def test_the_rollout_summary_names_the_front_door_and_the_next_command() -> None:
    assert rollout_summary(SPEC, "http://10.0.0.5:8080", 3, 4) == {
        "farm": "lab",
        "front_door": "http://10.0.0.5:8080",
        "next": "farmctl --config /srv/farm.toml status",
        "summary": "lab: 3/4 ready and routed · front door http://10.0.0.5:8080 · "
        "try: farmctl --config /srv/farm.toml status",
        "not_routed": [],
    }
    # Issue 31: with a gateway the count is what users get, or says who is not routed yet.
    out = rollout_summary(SPEC, "http://10.0.0.5:8080", 4, 4, [2, 3])
    assert out["not_routed"] == [2, 3]
    assert str(out["summary"]).startswith(
        "lab: 4/4 ready, the gateway does not route workers 2, 3 yet · front door"
    )
    held = rollout_summary(SPEC, "http://10.0.0.5:8080", 4, 4, [0, 1, 2, 3], held_out=True)
    assert "4/4 ready, the host held out of the gateway (farmctl undrain-host)" in str(
        held["summary"]
    )


def test_without_a_gateway_it_points_at_the_endpoints_and_skips_the_default_config() -> None:
    spec = replace(SPEC, source=DEFAULT_CONFIG_PATH)
    out = rollout_summary(spec, None, 1, 1)
    assert out["front_door"] is None and out["next"] == "farmctl status"
    assert out["summary"] == (
        "lab: 1/1 ready · no gateway: farmctl endpoints lists workers · try: farmctl status"
    )


def test_the_command_to_try_is_typed_as_from_where_the_farm_was_started() -> None:
    """Issue 31: the demo's line said `try: farmctl --config /abs/…/demo.toml status`; a
    checkout has no farmctl on its PATH: `.venv/bin/farmctl --config etc/…`."""
    from sglang_farm.workers.notes import as_typed, farmctl_command

    repo = "/home/me/sglang-farm"
    mine = f"{repo}/.venv/bin/farmctl"
    assert farmctl_command(mine, None, repo) == ".venv/bin/farmctl"
    assert farmctl_command(mine, "/usr/bin/farmctl", repo) == ".venv/bin/farmctl"
    assert farmctl_command(mine, mine, repo) == "farmctl"  # the PATH's is the agent's own
    assert farmctl_command(None, None, repo) == "farmctl"
    assert farmctl_command(mine, None, "/tmp") == mine  # not under it: the whole path
    assert as_typed(f"{repo}/etc/sglang-farm/demo.toml", repo) == "etc/sglang-farm/demo.toml"
    assert as_typed("/tmp/oom-demo.toml", repo) == "/tmp/oom-demo.toml"
    assert as_typed("/srv/farm.toml", "/") == "/srv/farm.toml"  # systemd's working directory
    demo = replace(SPEC, source=f"{repo}/etc/sglang-farm/demo.toml")
    out = rollout_summary(demo, None, 8, 8, farmctl=".venv/bin/farmctl", cwd=repo)
    assert out["next"] == ".venv/bin/farmctl --config etc/sglang-farm/demo.toml status"
