"""The descriptor budget (issue 22, item 13): the servers' caps follow the limit, and the
process runtime raises its soft limit to the hard one."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sglang_farm.host.fdbudget import (
    CONTROL_MAX,
    EXPORTER_MAX,
    MIN_CAP,
    UNLIMITED_TARGET,
    control_client_cap,
    exporter_pending_cap,
    nofile_target,
    usable,
)

INF = -1  # resource.RLIM_INFINITY on Linux


@pytest.mark.parametrize("nofile", [64, 256, 1024, 4096, 65536, 1 << 20])
def test_both_servers_together_hold_at_most_a_quarter_of_the_limit(nofile: int) -> None:
    control, exporter = control_client_cap(nofile), exporter_pending_cap(nofile)
    if nofile >= 8 * MIN_CAP:
        assert control + exporter <= nofile // 4
    assert MIN_CAP <= control <= CONTROL_MAX and MIN_CAP <= exporter <= EXPORTER_MAX


def test_the_caps_follow_the_limit() -> None:
    assert control_client_cap(1024) == 128  # the login shell's soft limit
    assert control_client_cap(65536) == CONTROL_MAX  # the unit's LimitNOFILE=
    assert exporter_pending_cap(1024) == 128
    assert exporter_pending_cap(65536) == EXPORTER_MAX
    assert control_client_cap(1024) < control_client_cap(4096)


def test_the_soft_limit_is_raised_to_the_hard_one() -> None:
    assert nofile_target(1024, 524288, INF) == 524288
    assert nofile_target(524288, 524288, INF) is None
    assert nofile_target(1024, INF, INF) == UNLIMITED_TARGET
    assert nofile_target(INF, INF, INF) is None
    assert nofile_target(2 << 20, INF, INF) is None  # never lowered
    assert usable(INF, INF) == UNLIMITED_TARGET and usable(1024, INF) == 1024


_RAISE = r"""
import resource
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 4096))
from sglang_farm.control.server import ControlServer
from sglang_farm.service import raise_nofile
raise_nofile()
print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
print(ControlServer(None, "/nonexistent/s", None, version="x").max_clients)
"""


def test_the_agent_raises_its_limit_and_sizes_the_control_socket_from_it() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _RAISE], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out[-2:] == ["4096", str(control_client_cap(4096))]
