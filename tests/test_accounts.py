"""A user or group the host lacks: refused by the agent under systemd, warned of by
check-config (a missing group in the agent's drop-in stops its next start, 216/GROUP)."""

from __future__ import annotations

import grp
import pwd
from pathlib import Path

import pytest
from click.testing import CliRunner

from sglang_farm.cli.main import cli
from sglang_farm.config import load_spec
from sglang_farm.doctor.accounts import missing_accounts
from sglang_farm.errors import ConfigError
from sglang_farm.service import load_config

# The scenarios through the CLI and `load_config` read this host's own databases: they
# name accounts every host the tests run on has (root, and nobody with its group, which
# tests/asuser.py needs too) and one no host has.
NOBODY = "sf-no-such-account"


def host_accounts() -> tuple[str, str]:
    """nobody and its primary group ("nogroup" on Debian, "nobody" elsewhere)."""
    entry = pwd.getpwnam("nobody")
    return entry.pw_name, grp.getgrgid(entry.pw_gid).gr_name


def config(user: str, farm_group: str, control_group: str) -> str:
    return (
        "[farm]\n"
        f'user = "{user}"\n'
        f'group = "{farm_group}"\n'
        "[control]\n"
        f'group = "{control_group}"\n'
        "[workers]\ngpus = [0, 1]\n"
        '[sglang]\nmodel_path = "/models/m"\n'
    )


def problems(user: str, farm_group: str, control_group: str, known: set[str]) -> list[str]:
    spec = load_spec(config(user, farm_group, control_group), source="farm.toml")
    return missing_accounts(spec, user_exists=known.__contains__, group_exists=known.__contains__)


def test_every_missing_account_is_named_with_its_key_and_its_fix() -> None:
    got = problems("svc", "workers", "ops", {"other"})
    assert len(got) == 3
    assert got[0].startswith("[farm] user 'svc' does not exist on this host")
    assert "217/USER" in got[0] and "useradd --system --gid workers" in got[0]
    assert got[1].startswith("[control] group 'ops' does not exist on this host")
    assert "216/GROUP" in got[1] and "groupadd --system ops" in got[1]
    assert "the workers (Group=)" not in got[1]
    assert got[2].startswith("[farm] group 'workers' does not exist")
    assert "the workers (Group=)" in got[2]


def test_one_group_named_by_both_keys_is_one_problem_naming_both() -> None:
    got = problems("svc", "ops", "ops", {"svc"})
    assert got == [
        "[control] group and [farm] group 'ops' does not exist on this host: systemd would "
        "refuse to start the agent from its next start on (its unit's SupplementaryGroups=) "
        "and the workers (Group=), status 216/GROUP; create it (`groupadd --system ops`) or "
        "set [control] group and [farm] group to an existing group"
    ]


def test_existing_accounts_and_root_are_no_problem() -> None:
    assert problems("svc", "workers", "ops", {"svc", "workers", "ops"}) == []
    assert problems("root", "root", "root", set()) == []


def _write(tmp_path: Path, control_group: str) -> Path:
    user, group = host_accounts()
    path = tmp_path / "farm.toml"
    path.write_text(config(user, group, control_group))
    return path


def test_the_agent_under_systemd_refuses_a_group_the_host_lacks(tmp_path: Path) -> None:
    """At start and at every reload (both load the config through `load_config`)."""
    path = _write(tmp_path, NOBODY)
    with pytest.raises(ConfigError) as exc:
        load_config(str(path), None, "systemd")
    assert exc.value.problems == (
        f"{path}: [control] group {NOBODY!r} does not exist on this host: systemd would refuse to "
        "start the agent from its next start on (its unit's SupplementaryGroups=), status "
        f"216/GROUP; create it (`groupadd --system {NOBODY}`) or set [control] group to an "
        "existing group",
    )
    # The process runtime names no group in any unit: the same config loads.
    assert load_config(str(path), None, "process").control.group == NOBODY
    _, group = host_accounts()
    assert load_config(str(_write(tmp_path, group)), None, "systemd").farm.user == "nobody"


def test_check_config_warns_of_a_group_the_host_lacks_and_passes(tmp_path: Path) -> None:
    path = _write(tmp_path, NOBODY)
    result = CliRunner().invoke(cli, ["check-config", "--config", str(path)])
    assert result.exit_code == 0, result.output
    assert f"warning: under systemd: [control] group {NOBODY!r} does not exist" in result.stderr
    _, group = host_accounts()
    ok = CliRunner().invoke(cli, ["check-config", "--config", str(_write(tmp_path, group))])
    assert ok.exit_code == 0 and "under systemd" not in ok.stderr
