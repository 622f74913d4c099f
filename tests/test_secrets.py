"""Secrets (issue 15, item 4): `[farm] env` values and SGLang's API key never appear in a
world-readable file or on any command line, and the worker still requires its key."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from keyed_spec import API_KEY, TOKEN, _free_port, _wait_healthy, keyed_spec
from sglang_farm.config import load_spec
from sglang_farm.runtime.unit_files import write_secrets
from sglang_farm.runtime.unit_secrets import (
    credentials_dir,
    env_file_path,
    env_file_text,
    key_file_path,
    render_secrets,
)
from sglang_farm.runtime.units import render
from sglang_farm.sglang.argv import API_KEY_ENV, build_command
from sglang_farm.sglang.commands import worker_commands


def test_rendered_units_hold_no_secret_value_and_name_where_systemd_gets_them() -> None:
    spec = keyed_spec()
    files = render(spec)
    for path, text in files.items():
        assert API_KEY not in text, path
        assert TOKEN not in text, path
    dropin = files[next(p for p in files if str(p) == "sglang@1.service.d/50-farm.conf")]
    assert f"EnvironmentFile={env_file_path(spec, 1)}\n" in dropin
    assert f"LoadCredential=api-key:{key_file_path(spec, 1)}\n" in dropin
    # The farm's own variables stay visible; the config's are only named in a comment.
    assert 'Environment="CUDA_VISIBLE_DEVICES=1"' in dropin
    assert "HF_TOKEN" in dropin and 'Environment="HF_TOKEN' not in dropin
    assert "\n    --api-key" not in dropin  # no such argv word (the launcher adds it)


def test_a_config_variable_never_reaches_a_drop_in_during_a_canary_analysis() -> None:
    """During an analysis the units are rendered from the candidate config while the
    baseline workers run the accepted config's commands: a variable the candidate dropped
    (HF_TOKEN) is still a config variable of the command that carries it, so its value goes
    to the root-only env file, never into the world-readable drop-in (review B7)."""
    accepted = keyed_spec()
    candidate = load_spec(
        f"""
[farm]
python = "{sys.executable}"
module = "sglang_farm.sim"
user = "root"
group = "root"
env = {{ OTHER = "1" }}

[workers]
gpus = [0, 1]
host = "127.0.0.1"
base_port = 30000

[sglang]
model_path = "sim/m"
""",
        source="/etc/sglang-farm/farm.toml",
        gpu_count=2,
    )
    # As the agent renders them mid-analysis: the canary (0) on the candidate, worker 1 on
    # the accepted config.
    commands = {0: worker_commands(candidate, {})[0], 1: worker_commands(accepted, {})[1]}
    files = render(candidate, commands=commands, static=False)
    for path, text in files.items():
        assert TOKEN not in text, path
        assert API_KEY not in text, path
    dropin = files[next(p for p in files if str(p) == "sglang@1.service.d/50-farm.conf")]
    assert f"EnvironmentFile={env_file_path(candidate, 1)}\n" in dropin
    assert 'Environment="CUDA_VISIBLE_DEVICES=1"' in dropin
    # The value still reaches worker 1, through its root-only file.
    secrets = render_secrets(candidate, commands)
    assert f'HF_TOKEN="{TOKEN}"\n' in secrets["sglang@1.env"].decode()
    assert "HF_TOKEN" not in secrets["sglang@0.env"].decode()


def test_secret_files_are_root_only_and_hold_the_values(tmp_path: Path) -> None:
    spec = keyed_spec(state_dir=str(tmp_path / "state"))
    folder = Path(credentials_dir(spec))
    changes = write_secrets(folder, render_secrets(spec))
    assert changes.written == (
        "sglang@0.api-key",
        "sglang@0.env",
        "sglang@1.api-key",
        "sglang@1.env",
    )
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    for entry in folder.iterdir():
        assert stat.S_IMODE(entry.stat().st_mode) == 0o600, entry
    assert (folder / "sglang@0.api-key").read_bytes() == API_KEY.encode()
    assert f'HF_TOKEN="{TOKEN}"\n' in (folder / "sglang@1.env").read_text()
    # A worker no longer configured: its files go; a foreign file stays.
    (folder / "sglang@7.env").write_text("X=1\n")
    (folder / "notes.txt").write_text("mine\n")
    again = write_secrets(folder, render_secrets(spec))
    assert again.removed == ("sglang@7.env",) and not again.written
    assert (folder / "notes.txt").exists()


def test_env_file_escapes_what_systemd_would_otherwise_read_differently(tmp_path: Path) -> None:
    tricky = 'a "quoted" $HOME `x` \\ value'
    text = env_file_text([("TRICKY", tricky), ("NL", "a\nb")])
    assert 'TRICKY="a \\"quoted\\" \\$HOME \\`x\\` \\\\ value"\n' in text
    assert 'NL="a\nb"\n' in text
    with pytest.raises(ValueError, match="NUL"):
        env_file_text([("X", "a\0b")])
    with pytest.raises(ValueError, match="name"):
        env_file_text([("A-B", "1")])


def test_a_keyed_workers_argv_holds_no_key_and_runs_the_launcher() -> None:
    spec = keyed_spec()
    cmd = build_command(spec.farm, spec.workers[0])
    assert API_KEY not in " ".join(cmd.argv)
    assert cmd.argv[1] == "-c" and "--model-path" in cmd.argv[3:]
    assert cmd.api_key == API_KEY
    assert API_KEY not in repr(cmd)
    # A changed key is a changed command (reload restarts the worker).
    other = build_command(spec.farm, spec.workers[0], {**spec.workers[0].flags, "api_key": "k2"})
    assert other != cmd and other.argv == cmd.argv


def test_the_launcher_refuses_to_start_without_a_key() -> None:
    spec = keyed_spec()
    cmd = build_command(spec.farm, spec.workers[0])
    env = {k: v for k, v in os.environ.items() if k not in (API_KEY_ENV, "CREDENTIALS_DIRECTORY")}
    r = subprocess.run(cmd.argv, env=env, capture_output=True, text=True, timeout=30, check=False)
    assert r.returncode == 1
    assert "needs an API key and none was handed over" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_keyed_launcher_reads_the_systemd_credential(tmp_path: Path) -> None:
    spec = keyed_spec(port=_free_port())
    cmd = build_command(spec.farm, spec.workers[0])
    (tmp_path / "api-key").write_text(API_KEY)
    env = {**os.environ, **cmd.env_dict, "CREDENTIALS_DIRECTORY": str(tmp_path)}
    env.pop(API_KEY_ENV, None)
    port = spec.workers[0].port
    proc = subprocess.Popen(cmd.argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_healthy(port)
        url = f"http://127.0.0.1:{port}/v1/models"
        assert httpx.get(url).status_code == 401
        ok = httpx.get(url, headers={"Authorization": f"Bearer {API_KEY}"})
        assert ok.status_code == 200
    finally:
        proc.kill()
        proc.wait()


def test_doctor_warns_when_a_config_holding_secrets_is_world_readable() -> None:
    from sglang_farm.doctor.checks import Status
    from sglang_farm.doctor.host_rules import config_secrets_check

    spec = keyed_spec()
    check = config_secrets_check(spec, 0o644)
    assert check is not None and check.status is Status.WARN
    assert "api_key" in check.message and "0644" in check.message
    assert f"chmod 0640 {spec.source}" in check.fix
    assert config_secrets_check(spec, 0o640) is None
    assert config_secrets_check(spec, None) is None


def test_secret_files_replaced_or_removed_name_their_workers_new_ones_do_not() -> None:
    """Only a secret that was there before and changed tells of a worker started with the
    old one; a file written for the first time (an upgrade) restarts nobody."""
    from sglang_farm.runtime.unit_files import UnitChanges, secrets_changed_workers

    changes = UnitChanges(
        written=("sglang@1.api-key", "sglang@2.env", "sglang@7.env"),
        removed=("sglang@4.api-key",),
        unchanged=("sglang@0.env",),
    )
    existed = {"sglang@1.api-key", "sglang@2.env", "sglang@0.env"}
    assert secrets_changed_workers(changes, existed) == {1, 2, 4}
    assert secrets_changed_workers(changes, set()) == {4}
