"""The batch service's shipped unit (units/sglang-farm-batch.service, issue 33) and how the
Debian package ships it: part of the farm's target, its own user in the farm's group, its
own state directory, hardened (every directive explained, exposure at most 1.5), and the
package installing the unit, the wrapper it runs and the user it names.

Under a real systemd: tests/test_systemd_batch.py."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path, PurePosixPath

import pytest

from sglang_farm.runtime.units import STATIC_UNITS, render, static_unit

ROOT = Path(__file__).resolve().parent.parent
UNIT = "sglang-farm-batch.service"
DEB = ROOT / "packaging" / "debian"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")


def directives(text: str) -> dict[str, list[str]]:
    """`Key=value` lines by key (a key may repeat), comments and sections left out."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith(("#", "[")) and "=" in line:
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


def test_the_unit_is_shipped_static_and_rendered_with_the_others() -> None:
    assert UNIT in STATIC_UNITS
    text = static_unit(UNIT)
    assert text == (ROOT / "agent" / "sglang_farm" / "units" / UNIT).read_text()
    from demospec import demo_spec

    assert render(demo_spec(n=1))[PurePosixPath(UNIT)] == text
    assert PurePosixPath(UNIT) not in render(demo_spec(n=1), static=False)


def test_it_belongs_to_the_farms_target_and_keeps_its_state_in_its_own_directory() -> None:
    d = directives(static_unit(UNIT))
    assert d["PartOf"] == ["sglang-farm.target"]
    assert d["WantedBy"] == ["sglang-farm.target"]
    assert "sglang-farm.service" in d["After"][0].split()
    assert d["StateDirectory"] == ["sglang-farm-batch"]
    assert d["StateDirectoryMode"] == ["0700"]
    # The default [batch] state_dir is that directory.
    from sglang_farm.spec import BatchSpec

    assert BatchSpec().state_dir == "/var/lib/sglang-farm-batch"
    assert d["ExecStart"] == ["/usr/bin/sglang-farm-batch --config /etc/sglang-farm/farm.toml"]


def test_it_runs_unprivileged_as_the_packages_user_in_the_farms_group() -> None:
    d = directives(static_unit(UNIT))
    assert d["User"] == ["sglang-farm-batch"] and d["Group"] == ["sglang-farm-batch"]
    assert "DynamicUser" not in d
    assert d["CapabilityBoundingSet"] == [""] and d["NoNewPrivileges"] == ["yes"]
    sysusers = (DEB / "sglang-farm.sysusers").read_text().splitlines()
    entries = [ln.split() for ln in sysusers if ln and not ln.startswith("#")]
    users = [e for e in entries if e[:2] == ["u", "sglang-farm-batch"]]
    assert len(users) == 1 and users[0][2] == "-"
    assert ["m", "sglang-farm-batch", "sglang-farm"] in entries


_SELF_EXPLAINED = ("Description", "Documentation")


def test_every_directive_is_explained_by_a_comment_in_its_paragraph() -> None:
    # A paragraph: the lines between blank lines. Description=/Documentation= say
    # what they are; every other directive has a comment above it in its paragraph.
    text = static_unit(UNIT)
    unexplained = []
    for para in re.split(r"\n\s*\n", text):
        lines = [ln for ln in para.splitlines() if not ln.startswith("[")]
        seen_comment = False
        for ln in lines:
            if ln.startswith("#"):
                seen_comment = True
            elif "=" in ln and not seen_comment and ln.split("=", 1)[0] not in _SELF_EXPLAINED:
                unexplained.append(ln)
    assert unexplained == []


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed")
def test_exposure_is_at_most_1_5(tmp_path: Path) -> None:
    assert SYSTEMD_ANALYZE is not None
    (tmp_path / UNIT).write_text(static_unit(UNIT))
    r = subprocess.run(
        [
            SYSTEMD_ANALYZE,
            "security",
            "--offline=true",
            "--threshold=15",
            "--no-pager",
            str(tmp_path / UNIT),
        ],
        env={**os.environ, "SYSTEMD_LOG_COLOR": "0"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    last = (r.stdout.strip().splitlines() or [""])[-1]
    score = float(last.rsplit(":", 1)[-1].split()[0]) if ":" in last else 99.0
    assert r.returncode == 0 and score <= 1.5, (last, r.stderr)


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify_accepts_it(tmp_path: Path) -> None:
    assert SYSTEMD_ANALYZE is not None
    stub = tmp_path / "sglang-farm-batch"
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    units = tmp_path / "units"
    units.mkdir()
    (units / UNIT).write_text(static_unit(UNIT).replace("/usr/bin/sglang-farm-batch", str(stub)))
    (units / "sglang-farm.target").write_text(static_unit("sglang-farm.target"))
    (units / "sglang-farm.service").write_text(static_unit("sglang-farm.service"))
    r = subprocess.run(
        [SYSTEMD_ANALYZE, "verify", "--man=no", str(units / UNIT)],
        env={**os.environ, "SYSTEMD_UNIT_PATH": f"{units}:", "SYSTEMD_LOG_COLOR": "0"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    # The agent's unit names /usr/bin/sglang-farm, absent here: only this unit is judged.
    problems = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith(UNIT)]
    assert problems == [], r.stdout + r.stderr


def test_the_package_installs_the_unit_the_wrapper_and_stops_it_on_remove() -> None:
    install = (DEB / "sglang-farm.install").read_text().splitlines()
    assert f"agent/sglang_farm/units/{UNIT} lib/systemd/system/" in install
    assert "packaging/bin/sglang-farm-batch usr/bin/" in install
    wrapper = ROOT / "packaging" / "bin" / "sglang-farm-batch"
    assert os.access(wrapper, os.X_OK)
    text = wrapper.read_text()
    assert "/usr/lib/sglang-farm/venv/bin/python3 -I" in text
    assert "from sglang_farm.batch.main import main" in text
    assert UNIT in (DEB / "sglang-farm.prerm").read_text()
    assert "rm -rf /var/lib/sglang-farm-batch" in (DEB / "sglang-farm.postrm").read_text()
    # Installed disabled and not started, like the rest of the farm.
    assert "dh_installsystemd --no-enable --no-start" in (DEB / "rules").read_text()
