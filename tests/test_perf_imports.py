"""Structural: what `farmctl status` imports (issue 17: import only what a command needs).

Never timed here: the figures are `python -m bench`'s. These tests say which modules a
plain `farmctl status` must not load, each one a measured cost (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# Loaded by `farmctl --socket S status` up to the call that reaches the agent.
_PROBE = r"""
import json, sys
sys.argv = ["farmctl", "--socket", sys.argv[1], "status"]
from sglang_farm.cli import farmctl
try:
    farmctl.main()
except SystemExit:
    pass
print(json.dumps(sorted(sys.modules)), file=sys.stderr)
"""


def _modules_of_farmctl_status() -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, "/nonexistent/farm.sock"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    last = out.stderr.strip().splitlines()[-1]
    return set(json.loads(last))


@pytest.fixture(scope="module")
def loaded() -> set[str]:
    return _modules_of_farmctl_status()


@pytest.mark.parametrize(
    "module",
    [
        "dataclasses",  # ~10 ms: farmctl's Ctl and the wire's Reply are plain classes
        "sglang_farm.control.codec",  # ~8 ms of dataclass and enum creation: `wire` instead
        "importlib.metadata",  # ~30 ms: the version is looked up only by `version`
        "httpx",
        "structlog",
        "prometheus_client",
        "tomllib",  # only with --config
        "sglang_farm.spec",
        "sglang_farm.config",
    ],
)
def test_farmctl_status_does_not_import(loaded: set[str], module: str) -> None:
    assert module not in loaded


def test_farmctl_status_reaches_the_agent_through_the_lean_client(loaded: set[str]) -> None:
    assert {"click", "socket", "sglang_farm.control.client", "sglang_farm.control.wire"} <= loaded
