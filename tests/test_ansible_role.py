"""The sglang_farm role's farm.toml task (issue 30, item 7), without a container.

farm.toml may hold credentials (`[sglang] api_key`, a token in `[farm] env`): the role
writes it root:<the farm's group> 0640, never shows it in `--diff`, and check-config (its
`validate:`) fails on credentials in a file every local user can read. The statics read
the role's YAML; the run plays that very task with the venv's ansible-playbook on this
host (connection local), into a folder of the test's. tests/test_ansible.py has the
fleet run in systemd containers.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]  # (PyYAML, with ansible: no stubs installed)

REPO = Path(__file__).resolve().parent.parent
ROLE = REPO / "deploy" / "ansible" / "roles" / "sglang_farm"
BIN = Path(sys.executable).parent  # the venv's ansible-playbook and sglang-farm
SECRET = "k-role-secret-0123"


def _farm_toml_task() -> dict[str, Any]:
    tasks = yaml.safe_load((ROLE / "tasks" / "main.yml").read_text())
    (task,) = [t for t in tasks if "ansible.builtin.template" in t]
    assert task["ansible.builtin.template"]["dest"] == "/etc/sglang-farm/farm.toml"
    return dict(task)


def test_the_role_writes_farm_toml_0640_for_the_farms_group_and_never_diffs_it() -> None:
    task = _farm_toml_task()
    args = task["ansible.builtin.template"]
    assert (args["owner"], args["group"], args["mode"]) == (
        "root",
        "{{ sglang_farm_config_group }}",
        "0640",
    )
    assert task["diff"] is False
    assert args["validate"] == "sglang-farm check-config --config %s"
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    group = defaults["sglang_farm_config_group"]
    assert "control" in group and "sglang-farm" in group  # [control] group, its default


@pytest.fixture
def open_folder() -> Iterator[Path]:
    """A folder every user can reach, as /etc (pytest's tmp_path is under a 0700 one)."""
    d = Path(tempfile.mkdtemp(prefix="sf-role-", dir="/var/tmp"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _play(folder: Path, task: dict[str, Any], config: dict[str, Any]) -> Path:
    """A play on localhost running `task` (the role's, its dest moved into `folder`)."""
    task["ansible.builtin.template"]["src"] = str(ROLE / "templates" / "farm.toml.j2")
    task["ansible.builtin.template"]["dest"] = str(folder / "farm.toml")
    task.pop("notify", None)
    play = [
        {
            "hosts": "localhost",
            "connection": "local",
            "gather_facts": False,
            "vars": {
                "ansible_python_interpreter": sys.executable,
                "sglang_farm_farm_toml": config,
                "sglang_farm_config_group": "root",  # the host has no sglang-farm group
            },
            "tasks": [task],
        }
    ]
    path = folder / "play.yml"
    path.write_text(json.dumps(play))
    return path


def _run(play: Path, tmp: Path) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PATH": f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "LC_ALL": "C.UTF-8",
        "ANSIBLE_HOME": str(tmp / "ansible-home"),
        "ANSIBLE_LOCAL_TEMP": str(tmp / "ansible-local"),
        "ANSIBLE_REMOTE_TEMP": str(tmp / "ansible-remote"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_RETRY_FILES_ENABLED": "0",
        "ANSIBLE_LOCALHOST_WARNING": "0",
        "ANSIBLE_INVENTORY_UNPARSED_WARNING": "0",
    }
    return subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", "localhost,", "--diff", str(play)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_roles_task_writes_a_keyed_farm_toml_private_and_validated(
    open_folder: Path, tmp_path: Path
) -> None:
    if not (BIN / "ansible-playbook").exists():
        pytest.skip("ansible-playbook is not in the venv (the dev extra)")
    config = {
        "farm": {"name": "role-test", "env": {"HF_TOKEN": SECRET}},
        "workers": {"gpus": [0]},
        "sglang": {"model_path": "/models/m", "api_key": SECRET},
    }
    r = _run(_play(open_folder, _farm_toml_task(), config), tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    out = open_folder / "farm.toml"
    st = out.stat()
    assert (st.st_mode & 0o7777, st.st_uid, st.st_gid) == (0o640, 0, 0)
    assert SECRET in out.read_text()
    assert SECRET not in r.stdout + r.stderr  # --diff shows nothing of it
    # Ansible's own validate: the same file at 0644 fails the check, so it is not written.
    out.chmod(0o644)
    check = subprocess.run(
        [str(BIN / "sglang-farm"), "check-config", "--config", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 1 and "every local user can read it" in check.stderr


def _tasks_by_module(tasks: list[dict[str, Any]], module: str) -> list[dict[str, Any]]:
    """Every task of `module` in a task list, the tasks of its blocks included."""
    found: list[dict[str, Any]] = []
    for t in tasks:
        found += _tasks_by_module(t.get("block", []), module)
        if module in t:
            found.append(t)
    return found


def test_the_drain_plan_asks_about_farm_toml_with_main_ymls_very_arguments() -> None:
    """drain.yml asks, in check mode, whether main.yml's farm.toml task would change. With
    other arguments (before: root:root 0644, main.yml's old ones) it said "changed" on
    every run: an unchanged host reported changed=1 and was drained (test_ansible.py's
    rerun test)."""
    main = _farm_toml_task()
    drain = yaml.safe_load((ROLE / "tasks" / "drain.yml").read_text())
    (plan,) = [
        t
        for t in _tasks_by_module(drain, "ansible.builtin.template")
        if t["ansible.builtin.template"]["dest"] == "/etc/sglang-farm/farm.toml"
    ]
    assert plan["check_mode"] is True
    assert plan["diff"] is False  # --diff never prints farm.toml, in the plan neither
    want = {k: v for k, v in main["ansible.builtin.template"].items() if k != "validate"}
    assert plan["ansible.builtin.template"] == want
