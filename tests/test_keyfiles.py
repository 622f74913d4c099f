"""Key files' permissions (issue 22, item 12): check-config and the doctor warn of a key
file another user can read or replace, as they would of the Hub token file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner

import asuser
from sglang_farm.cli.main import cli
from sglang_farm.config import load_spec
from sglang_farm.doctor.checks import CheckId, Observations, Status
from sglang_farm.doctor.gather import key_file_facts
from sglang_farm.doctor.rules import evaluate
from sglang_farm.gpus.snapshot import FleetSnapshot
from sglang_farm.spec import FarmSpec


def _config(folder: Path, admin: Path, api: Path) -> Path:
    config = folder / "farm.toml"
    config.write_text(
        "[workers]\ngpus = [0]\n[sglang]\nmodel_path = '/models/m'\n"
        f'[gateway]\nmode = "managed"\nadmin_key_file = "{admin}"\napi_key_file = "{api}"\n'
    )
    config.chmod(0o600)
    return config


def _keys(folder: Path) -> tuple[Path, Path]:
    """A root-owned admin key at 0644, and an API key written by nobody at 0600."""
    admin = folder / "admin.key"
    admin.write_text("k-admin\n")
    admin.chmod(0o644)
    api = folder / "api.key"
    asuser.nobody_python(
        "import os, sys; fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600);"
        " os.write(fd, b'k-api'); os.close(fd)",
        str(api),
    )
    return admin, api


def test_check_config_refuses_gateway_key_files_others_can_read_or_replace(
    shared_dir: Path,
) -> None:
    """The agent refuses these at start (`gateway.keyfile`): check-config fails on them
    (exit 1), so Ansible's `validate:` keeps the old config, and says the fix."""
    admin, api = _keys(shared_dir)
    config = _config(shared_dir, admin, api)
    result = CliRunner().invoke(cli, ["check-config", "--config", str(config)])
    assert result.exit_code == 1, result.output
    assert (
        f"error: [gateway] admin_key_file: refusing {admin}: {admin} is open to other users "
        f"(mode 0644); the agent refuses it at start; fix: chown root: {admin} && "
        f"chmod 0600 {admin}" in result.stderr
    )
    assert (
        f"error: [gateway] api_key_file: refusing {api}: {api} is owned by nobody "
        f"(uid {asuser.NOBODY_UID}), not by root or the agent's user" in result.stderr
    )
    assert "warning: [gateway]" not in result.stderr  # said once, as the error
    assert ": OK" not in result.stdout
    assert "k-admin" not in result.output and "k-api" not in result.output


def test_check_config_refuses_a_missing_gateway_key_file(tmp_path: Path) -> None:
    api = tmp_path / "api.key"
    api.write_text("k\n")
    api.chmod(0o600)
    config = _config(tmp_path, tmp_path / "absent.key", api)
    result = CliRunner().invoke(cli, ["check-config", "--config", str(config)])
    assert result.exit_code == 1, result.output
    absent = tmp_path / "absent.key"
    assert f"error: [gateway] admin_key_file: cannot read {absent}" in result.stderr


def test_root_only_key_files_get_no_warning(tmp_path: Path) -> None:
    admin, api = tmp_path / "admin.key", tmp_path / "api.key"
    for key in (admin, api):
        key.write_text("k\n")
        key.chmod(0o600)
    config = _config(tmp_path, admin, api)
    result = CliRunner().invoke(cli, ["check-config", "--config", str(config)])
    assert result.exit_code == 0, result.output
    assert "key_file" not in result.stderr


def _doctor_exposure(spec: FarmSpec) -> dict[str, Status]:
    obs = Observations(
        fleet=FleetSnapshot(taken_at=0.0, duration_s=0.0, nvml_up=False),
        env={},
        flags={},
        ports={},
        models={},
        key_files=key_file_facts(spec),
        agent_uid=os.geteuid(),
    )
    return {c.message: c.status for c in evaluate(spec, obs).checks if c.id is CheckId.EXPOSURE}


def test_the_doctor_warns_of_the_same_key_files(shared_dir: Path) -> None:
    admin, api = _keys(shared_dir)
    spec = load_spec(_config(shared_dir, admin, api).read_text(), source="farm.toml")
    found = _doctor_exposure(spec)
    assert (
        found[
            f"[gateway] admin_key_file {admin} is open to other users (mode 0644): "
            "only its owner may read a key"
        ]
        is Status.WARN
    )
    owned = [m for m in found if m.startswith(f"[gateway] api_key_file {api} is owned by uid")]
    assert owned and found[owned[0]] is Status.WARN


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620])
def test_any_group_or_other_bit_on_the_hub_token_file_is_warned_of(
    tmp_path: Path, mode: int
) -> None:
    token = tmp_path / "hub.token"
    token.write_text("hf_x\n")
    token.chmod(mode)
    spec = load_spec(
        "[workers]\ngpus = [0]\n[sglang]\nmodel_path = '/models/m'\n"
        f'[model]\nsource = "org/m"\ntoken_file = "{token}"\n',
        source="farm.toml",
    )
    found = _doctor_exposure(spec)
    assert (
        found[
            f"[model] token_file {token} is open to other users (mode {mode:04o}): "
            "only its owner may read a key"
        ]
        is Status.WARN
    )


CREDENTIALS = (
    '[farm]\nenv = { HF_TOKEN = "hf_secret", TOKENIZERS_PARALLELISM = "false" }\n'
    '[workers]\ngpus = [0, 1]\n[workers.overrides.1]\nsglang = { api_key = "k-secret" }\n'
    "[sglang]\nmodel_path = '/models/m'\n"
)


def test_check_config_fails_on_credentials_in_a_file_every_user_can_read(
    shared_dir: Path,
) -> None:
    """Issue 30, item 7: check-config only warned of credentials in a world-readable
    farm.toml, so Ansible's `validate:` passed a 0644 file holding an api_key. It fails,
    naming the file, the key paths and the fix; nobody really could read that file."""
    etc = shared_dir / "etc"  # as /etc: root's, open to all
    etc.mkdir()
    etc.chmod(0o755)
    config = etc / "farm.toml"
    config.write_text(CREDENTIALS)
    config.chmod(0o644)
    assert "hf_secret" in asuser.as_nobody(["cat", str(config)]).stdout  # the claim is true
    result = CliRunner().invoke(cli, ["check-config", "--config", str(config)])
    assert result.exit_code == 1, result.output
    assert (
        f"error: {config} holds credentials (farm.env.HF_TOKEN, "
        "workers.overrides.1.sglang.api_key) and every local user can read it (mode 0644)"
    ) in result.stderr
    assert f"fix: chgrp sglang-farm {config} && chmod 0640 {config}" in result.stderr
    assert "hf_secret" not in result.output and "k-secret" not in result.output
    assert "OK" not in result.stdout
    # Fixed as it says: nobody reads it no more, and the check passes.
    config.chmod(0o640)
    assert asuser.as_nobody(["cat", str(config)], check=False).returncode != 0
    result = CliRunner().invoke(cli, ["check-config", "--config", str(config)])
    assert result.exit_code == 0 and "every local user" not in result.stderr, result.output
    # 0644 in a folder only root may enter (Ansible's `validate:` copy): no one else's.
    config.chmod(0o644)
    etc.chmod(0o700)
    assert asuser.as_nobody(["cat", str(config)], check=False).returncode != 0
    result = CliRunner().invoke(cli, ["check-config", "--config", str(config)])
    assert result.exit_code == 0 and "every local user" not in result.stderr, result.output


def test_an_env_name_is_a_credential_by_its_words() -> None:
    from sglang_farm.doctor.host_rules import is_secret_name

    for name in ("HF_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY", "DB_PASSWD", "HFTOKEN"):
        assert is_secret_name(name), name
    for name in ("TOKENIZERS_PARALLELISM", "SGLANG_SIM_FAIL_AFTER", "NCCL_DEBUG", "KEYRING"):
        assert not is_secret_name(name), name
