"""scripts/setup: the demo installs what the demo runs; the test command adds what tests need."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TEST_ONLY = {"lintian", "debhelper", "dh-python", "prometheus", "systemd-container", "dbus"}


def packages(which: str) -> set[str]:
    r = subprocess.run(
        [REPO / "scripts" / "setup", "--list", which], capture_output=True, text=True, check=True
    )
    return set(r.stdout.split())


def test_the_demo_installs_none_of_what_only_the_tests_need() -> None:
    demo = packages("demo")
    assert "libsystemd-dev" in demo  # pystemd builds from source
    assert not demo & TEST_ONLY


def test_the_test_set_is_the_demos_and_the_tests_own() -> None:
    demo, test = packages("demo"), packages("test")
    assert demo < test
    assert test >= TEST_ONLY


def test_the_demo_script_sets_up_the_demo_set_only() -> None:
    lines = (REPO / "scripts" / "demo").read_text().splitlines()
    assert "./scripts/setup demo" in lines


def test_an_unknown_set_is_refused_with_the_choices() -> None:
    setup = REPO / "scripts" / "setup"
    r = subprocess.run([setup, "--list", "gpu"], capture_output=True, text=True)
    assert r.returncode == 2
    assert "say 'demo' or 'test'" in r.stderr
