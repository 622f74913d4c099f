"""I/O: the package under test, built once per test run for every module that installs it.

tests/test_deb.py and tests/test_ansible.py both install the .deb in systemd containers.
Building it costs about a minute with pip's cache warm (minutes cold: pystemd and lxml
compile), so the modules of one run share one build: under pytest-xdist the workers of a
run have the same PYTEST_XDIST_TESTRUNUID, and the first to ask builds into a folder
named after it (in TMPDIR: scripts/test's per-run folder, removed at its end) while the
others wait on its lock. Without xdist each asking module
builds its own (nothing to share, and no stale package from an earlier run). SF_DEB
names a package built beforehand instead.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BUILD_DEB = REPO / "packaging" / "build-deb"


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("SF_REQUIRE_SYSTEMD_CONTAINER") == "1":
        pytest.fail(f"{reason} (SF_REQUIRE_SYSTEMD_CONTAINER=1: this machine must run it)")
    pytest.skip(reason)


def _build(out: Path) -> Path:
    if shutil.which("dpkg-buildpackage") is None:
        _skip_or_fail("dpkg-buildpackage not found (apt-get install dpkg-dev debhelper)")
    deps = subprocess.run(
        ["dpkg-checkbuilddeps", str(REPO / "packaging" / "debian" / "control")],
        capture_output=True,
        text=True,
    )
    if deps.returncode != 0:
        _skip_or_fail(f"build dependencies missing: {deps.stderr.strip()}")
    r = subprocess.run(
        [str(BUILD_DEB), "--no-lint", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert r.returncode == 0, f"build-deb failed:\n{r.stdout}\n{r.stderr[-6000:]}"
    debs = sorted(out.glob("sglang-farm_*.deb"))
    assert len(debs) == 1, f"expected one .deb in {out}, found {debs}"
    return debs[0]


def package(private_dir: Path) -> Path:
    """The .deb: SF_DEB, this run's shared build, or a build of its own into private_dir."""
    given = os.environ.get("SF_DEB")
    if given:
        path = Path(given)
        assert path.is_file(), f"SF_DEB={given} is not a file"
        return path
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run:
        return _build(private_dir)
    shared = Path(tempfile.gettempdir()) / f"sf-deb-{run}"
    shared.mkdir(exist_ok=True)
    with (shared / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held while building: the others wait for it
        built = sorted(shared.glob("sglang-farm_*.deb"))
        if built:
            return built[0]
        return _build(shared)
