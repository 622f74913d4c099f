"""The gateways' admin key file (issue 26: external gateways take a key too): given to
every gateway of `[gateway] urls`, and refused when another user could read or replace
it (`gateway.keyfile`), as the Hub token file is."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

import asuser
from sglang_farm.config import load_spec
from sglang_farm.errors import ConfigError
from sglang_farm.gateway.keyfile import read_gateway_key
from sglang_farm.service import build_gateway
from sglang_farm.spec import FarmSpec

A, B = "http://127.0.0.1:8000", "http://127.0.0.1:8001"
HEAD = "[workers]\ngpus = [0, 1]\n[sglang]\nmodel_path = '/models/m'\n[gateway]\n"


def _load(gateway: str) -> FarmSpec:
    return load_spec(HEAD + gateway, source="farm.toml")


def _external(key: Path, urls: str = f'url = "{A}"') -> FarmSpec:
    """External mode with the admin key in `key`; one gateway unless `urls` says more."""
    return _load(f'mode = "external"\n{urls}\nadmin_key_file = "{key}"\n')


def test_a_private_admin_key_is_given_to_every_gateway(tmp_path: Path) -> None:
    key = tmp_path / "gateway.key"
    key.write_text("k-0123\n")
    key.chmod(0o600)
    front = build_gateway(_external(key, f'urls = ["{A}", "{B}"]'), "process")
    assert front is not None
    clients = (front.client, *front.more)
    assert [c.url for c in clients] == [A, B]
    assert all(c._headers == {"Authorization": "Bearer k-0123"} for c in clients)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o602])
def test_an_admin_key_others_can_read_or_write_is_refused(tmp_path: Path, mode: int) -> None:
    key = tmp_path / "gateway.key"
    key.write_text("k-0123\n")
    key.chmod(mode)
    with pytest.raises(ConfigError) as info:
        build_gateway(_external(key), "process")
    (problem,) = info.value.problems
    assert f"open to other users (mode {mode:04o})" in problem
    assert f"chown root: {key} && chmod 0600 {key}" in problem and "k-0123" not in problem


def test_an_admin_key_of_another_user_is_refused(shared_dir: Path) -> None:
    key = shared_dir / "gateway.key"
    asuser.nobody_python(
        "import os, sys; fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600);"
        " os.write(fd, b'k-planted'); os.close(fd)",
        str(key),
    )
    assert os.stat(key).st_uid == asuser.NOBODY_UID
    with pytest.raises(ConfigError) as info:
        build_gateway(_external(key), "process")
    assert f"owned by nobody (uid {asuser.NOBODY_UID})" in info.value.problems[0]


# --- the file checked is the file read (issue 26 review) -------------------------------


def _racing_open(monkeypatch: pytest.MonkeyPatch, then: Callable[[str], object]) -> None:
    """`os.open` that runs `then(path)` right after the file is opened: another process
    changing the path between the agent's open and its checks."""
    real = os.open

    def racing(path: str, flags: int, mode: int = 0o777, **kw: object) -> int:
        fd = real(path, flags, mode)
        then(path)
        return fd

    monkeypatch.setattr(os, "open", racing)


def test_a_key_file_that_vanishes_once_opened_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = tmp_path / "gateway.key"
    key.write_text("k-0123\n")
    key.chmod(0o600)
    _racing_open(monkeypatch, os.unlink)
    with pytest.raises(ConfigError) as info:
        read_gateway_key(str(key), "admin_key_file")
    (problem,) = info.value.problems
    assert f"refusing {key}: it was removed or replaced while the agent read it" in problem


def test_a_key_file_replaced_once_opened_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key, other = tmp_path / "gateway.key", tmp_path / "other.key"
    for p in (key, other):
        p.write_text(f"k-{p.stem}\n")
        p.chmod(0o600)
    _racing_open(monkeypatch, lambda path: os.replace(other, path))
    with pytest.raises(ConfigError) as info:
        read_gateway_key(str(key), "admin_key_file")
    assert "removed or replaced while the agent read it" in info.value.problems[0]


def test_a_key_in_another_users_folder_is_refused_even_if_it_vanishes_once_opened(
    shared_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """nobody's folder holds a root-owned 0600 key; nobody removes it right after the
    agent opened it. The way was nobody's: refused, whatever happens to the path after."""
    folder = asuser.nobody_owned(shared_dir, "keys")
    key = folder / "gateway.key"
    key.write_text("k-0123\n")
    key.chmod(0o600)
    _racing_open(
        monkeypatch,
        lambda path: asuser.nobody_python("import os, sys; os.unlink(sys.argv[1])", path),
    )
    with pytest.raises(ConfigError) as info:
        read_gateway_key(str(key), "admin_key_file")
    assert "nobody" in info.value.problems[0], info.value.problems
