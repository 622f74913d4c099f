"""Folders the farm finds on the host (issue 22, item 11): a state or socket folder another
user made is refused by the agent, and farmctl never talks to a socket another user could
have put there. The other user's steps run as nobody."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

import asuser
from fake_ops import FakeOps
from sglang_farm.cli.ctl.exits import Exit
from sglang_farm.cli.farmctl import cli as farmctl
from sglang_farm.control.server import ControlServer
from sglang_farm.errors import ControlSocketError
from sglang_farm.host.securepath import folder_problem, judge, socket_problem

pytestmark = pytest.mark.anyio

ROOT = 0
NOBODY = asuser.NOBODY_UID


# --- the pure judge ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("uid", "mode", "own", "bad"),
    [
        (ROOT, stat.S_IFDIR | 0o755, True, False),
        (ROOT, stat.S_IFDIR | 0o1777, False, False),  # /tmp on the way: others add, not replace
        (ROOT, stat.S_IFDIR | 0o1777, True, True),  # the farm's own folder: no other writer
        (ROOT, stat.S_IFDIR | 0o777, False, True),
        (ROOT, stat.S_IFDIR | 0o775, False, True),  # group-writable is other users too
        (NOBODY, stat.S_IFDIR | 0o700, False, True),
        (NOBODY, stat.S_IFDIR | 0o755, True, True),
    ],
)
def test_a_folder_is_trusted_only_when_no_other_user_can_replace_names(
    uid: int, mode: int, own: bool, bad: bool
) -> None:
    problem = judge("/d", uid, mode, {ROOT}, own=own, owner=f"uid {uid}")
    assert (problem is not None) == bad, problem


# --- the agent: state folder and socket folder ----------------------------------------------


def _config(folder: Path, state_dir: Path) -> Path:
    config = folder / "farm.toml"
    config.write_text(
        textwrap.dedent(
            f"""\
            [farm]
            python = "{sys.executable}"
            module = "sglang_farm.sim"
            user = "root"
            group = "root"
            state_dir = "{state_dir}"
            [workers]
            gpus = [0]
            base_port = 1
            [sglang]
            model_path = "/models/m"
            [control]
            socket = "{folder}/root-only/control.sock"
            [metrics]
            listen = "127.0.0.1:0"
            gpu_source = "fake"
            """
        )
    )
    return config


def test_the_agent_refuses_a_state_folder_another_user_made(shared_dir: Path) -> None:
    state = asuser.nobody_owned(shared_dir, "state", 0o755)
    config = _config(shared_dir, state)
    run = _run_agent(config)
    assert run.returncode == 1, run.stdout + run.stderr
    assert (
        f"refusing the state folder {state}: {state} is owned by nobody (uid {NOBODY}), "
        "not by root or the agent's user" in run.stderr
    ), run.stderr
    assert f"chown root:root {state} && chmod 0755 {state}" in run.stderr
    assert "[farm] state_dir" in run.stderr
    assert list(state.iterdir()) == []  # nothing written there


def test_check_config_warns_of_the_folders_the_agent_would_refuse(shared_dir: Path) -> None:
    from sglang_farm.cli.main import cli

    state = asuser.nobody_owned(shared_dir, "state", 0o755)
    result = CliRunner().invoke(cli, ["check-config", "--config", str(_config(shared_dir, state))])
    assert result.exit_code == 0, result.output
    assert (
        f"warning: the agent would stop: refusing the state folder {state}: {state} is owned "
        f"by nobody (uid {NOBODY})" in result.stderr
    )


def test_a_shared_folder_is_refused_as_the_state_folder_even_with_its_sticky_bit(
    shared_dir: Path,
) -> None:
    problem = folder_problem(str(shared_dir), "the state folder", "[farm] state_dir")
    assert problem is not None
    assert "mode 1777) can be written by other users (sticky bit or not)" in problem


def test_a_missing_state_folder_under_a_root_folder_is_fine(tmp_path: Path) -> None:
    assert folder_problem(str(tmp_path / "new" / "state"), "the state folder", "k") is None


def test_a_link_another_user_made_on_the_way_is_refused(shared_dir: Path) -> None:
    mine = shared_dir / "root-only"
    mine.mkdir(mode=0o755)
    link = shared_dir / "state-link"
    asuser.as_nobody(["ln", "-s", str(mine), str(link)])
    problem = folder_problem(str(link), "the state folder", "[farm] state_dir")
    assert problem is not None and f"{link} is a symbolic link made by nobody" in problem


async def test_the_control_socket_is_not_created_in_a_folder_another_user_owns(
    shared_dir: Path,
) -> None:
    folder = asuser.nobody_owned(shared_dir, "run", 0o755)
    srv = ControlServer(FakeOps(1), str(folder / "control.sock"), None, version="x")
    with pytest.raises(ControlSocketError) as err:
        await srv.start()
    assert f"refusing the control socket's folder {folder}: " in str(err.value)
    assert "[control] socket" in str(err.value)
    assert not (folder / "control.sock").exists()


# --- farmctl -------------------------------------------------------------------------------

_FAKE_AGENT = r"""
import os, socket, sys
path = sys.argv[1]
try:
    os.unlink(path)
except FileNotFoundError:
    pass
s = socket.socket(socket.AF_UNIX)
s.bind(path)
os.chmod(path, 0o777)
s.listen()
print("LISTENING", flush=True)
conn, _ = s.accept()
print("GOT", conn.recv(65536).decode(errors="replace").strip(), flush=True)
conn.sendall(b'{"id": 1, "ok": true, "result": {"message": "from the attacker"}}\n')
"""


def _swapped_socket(path: Path) -> subprocess.Popen[str]:
    fake = asuser.popen_as_nobody([sys.executable, "-I", "-c", _FAKE_AGENT, str(path)])
    assert fake.stdout is not None
    line = fake.stdout.readline()
    assert line == "LISTENING\n", (line, fake.communicate(timeout=5))
    return fake


@pytest.mark.parametrize("where", ["nobody's folder", "a shared sticky folder"])
def test_farmctl_does_not_talk_to_a_socket_another_user_put_there(
    shared_dir: Path,
    where: str,
) -> None:
    folder = (
        asuser.nobody_owned(shared_dir, "run", 0o777) if where == "nobody's folder" else shared_dir
    )
    path = folder / "control.sock"
    fake = _swapped_socket(path)
    try:
        result = CliRunner().invoke(farmctl, ["--socket", str(path), "restart", "1"])
        assert result.exit_code == Exit.FAILED, result.output
        assert f"not talking to {path}: " in result.stderr
        assert "another user may have put it there" in result.stderr
        assert "from the attacker" not in result.output
    finally:
        fake.kill()
        out, _ = fake.communicate(timeout=10)
    assert "GOT" not in out  # the attacker never saw the command


def test_farmctl_talks_to_the_agents_socket_in_a_root_folder(tmp_path: Path) -> None:
    assert socket_problem(str(tmp_path / "absent.sock")) is None
    folder = tmp_path / "run"
    folder.mkdir(mode=0o755)
    path = folder / "control.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        assert socket_problem(str(path)) is None
    assert os.geteuid() == ROOT


def test_folders_the_farm_makes_are_0755_whatever_the_umask(tmp_path: Path) -> None:
    from sglang_farm.host.securepath import make_folders

    old = os.umask(0o002)
    try:
        make_folders(str(tmp_path / "a" / "b" / "state"))
    finally:
        os.umask(old)
    for p in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "state"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o755, p
    assert folder_problem(str(tmp_path / "a" / "b" / "state"), "the state folder", "k") is None


def test_the_doctor_warns_of_the_folders_the_agent_would_refuse(shared_dir: Path) -> None:
    from sglang_farm.config import load_spec
    from sglang_farm.doctor.checks import CheckId, Observations, Status
    from sglang_farm.doctor.gather import farm_folder_problems
    from sglang_farm.doctor.rules import evaluate
    from sglang_farm.gpus.snapshot import FleetSnapshot

    state = asuser.nobody_owned(shared_dir, "state", 0o755)
    spec = load_spec(_config(shared_dir, state).read_text(), source="farm.toml")
    obs = Observations(
        fleet=FleetSnapshot(taken_at=0.0, duration_s=0.0, nvml_up=False),
        env={},
        flags={},
        ports={},
        models={},
        folder_problems=farm_folder_problems(spec),
    )
    found = [
        c
        for c in evaluate(spec, obs).checks
        if c.id is CheckId.EXPOSURE and c.message.startswith(f"refusing the state folder {state}: ")
    ]
    assert [c.status for c in found] == [Status.WARN]


def _run_agent(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            *(sys.executable, "-m", "sglang_farm.cli.main", "run", "--config", str(config)),
            *("--runtime", "process", "--log-format", "json"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_agent_refuses_a_config_another_user_could_have_written(
    shared_dir: Path,
    tmp_path: Path,
) -> None:
    """The config names the interpreter and module the agent (root) runs: one another user
    wrote (the README's copy of the demo in /tmp, once) or may still change is theirs."""
    text = _config(tmp_path, tmp_path / "state").read_text()
    theirs = shared_dir / "farm.toml"
    asuser.as_nobody(["tee", str(theirs)], input=text)
    run = _run_agent(theirs)
    assert run.returncode == 1, run.stdout + run.stderr
    assert (
        f"refusing the config {theirs}: {theirs} is owned by nobody (uid {NOBODY}), "
        "not by root or the agent's user" in run.stderr
    ), run.stderr
    loose = tmp_path / "loose.toml"
    loose.write_text(text)
    loose.chmod(0o666)
    run = _run_agent(loose)
    assert run.returncode == 1 and "can be written by other users" in run.stderr, run.stderr
    assert not (tmp_path / "state").exists()  # refused before anything was made
