"""The version has one source: pyproject.toml. Everything that reports one agrees with it."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import sglang_farm

ROOT = Path(__file__).resolve().parent.parent


def pyproject_version() -> str:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return str(tomllib.load(f)["project"]["version"])


def test_package_version_is_pyprojects() -> None:
    assert sglang_farm.__version__ == pyproject_version()


def test_debian_changelog_names_the_same_version() -> None:
    first = (ROOT / "packaging/debian/changelog").read_text().splitlines()[0]
    assert f"({pyproject_version()})" in first


def test_both_commands_report_it() -> None:
    bindir = Path(sys.executable).parent
    # farmctl version prints its own version even when no agent answers (then exits 1).
    for argv in (["sglang-farm", "--version"], ["farmctl", "--socket", "/nonexistent", "version"]):
        out = subprocess.run(
            [str(bindir / argv[0]), *argv[1:]], capture_output=True, text=True, check=False
        ).stdout
        assert pyproject_version() in out, (argv, out)


def test_no_module_hard_codes_a_version() -> None:
    hits = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "agent/sglang_farm").rglob("*.py")
        if "__version__ = " in p.read_text()
    ]
    assert hits == []
