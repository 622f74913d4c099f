"""The batch service as a child of the agent (runtime/batch_child.py, issue 33): its command
line, the key file the agent makes for it, and the runner's start, restart after a
`kill -9`, record in `<state_dir>/children` and stop. The child here is a stand-in
process (a Python one-liner): the service itself is the walkthrough's
(tests/test_batch_walkthrough.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import sys
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from sglang_farm.runtime.batch_child import (
    KILLED_RESTART_S,
    RECORD,
    ChildBatch,
    batch_argv,
    ensure_key,
    next_start,
)
from sglang_farm.runtime.children import ChildRecords, record_file
from sglang_farm.runtime.gateway_child import RESTART_INITIAL_S
from sglang_farm.spec import FarmSpec

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_argv_runs_the_batch_service_module_isolated_on_the_agents_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    argv = batch_argv("etc/demo.toml", "/venv/bin/python3")
    # The path is made absolute: the child must read the agent's file whatever its cwd.
    assert argv == [
        "/venv/bin/python3",
        "-I",
        "-m",
        "sglang_farm.batch",
        "--config",
        str(tmp_path / "etc" / "demo.toml"),
    ]
    assert batch_argv("/etc/x.toml")[0] == sys.executable


def test_the_key_is_made_once_0600_and_never_rewritten(tmp_path: Path) -> None:
    path = tmp_path / "state" / "batch-api.key"
    assert ensure_key(path) is True
    key = path.read_text()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(key.strip()) >= 40 and key.endswith("\n") and " " not in key.strip()
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert ensure_key(path) is False
    assert path.read_text() == key
    # Another start makes another key elsewhere: random, not derived.
    other = tmp_path / "other.key"
    ensure_key(other)
    assert other.read_text() != key


def test_a_planted_link_is_not_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    link = tmp_path / "batch-api.key"
    link.symlink_to(victim)
    assert ensure_key(link) is False
    assert victim.read_text() == "precious\n"
    dangling = tmp_path / "dangling.key"
    dangling.symlink_to(tmp_path / "would-be-created")
    assert ensure_key(dangling) is False
    assert not (tmp_path / "would-be-created").exists()


STAND_IN = "import os, sys, time; print('up', os.getpid(), flush=True); time.sleep(600)"


def _text(path: Path) -> str:
    """A file's text, "" while it is not there (a record between forget and record)."""
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


async def _wait_for(pred: object, what: str, timeout: float = 60.0) -> None:
    assert callable(pred)
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"never {what} within {timeout} s")
        await asyncio.sleep(0.05)


async def test_the_child_is_recorded_restarted_after_kill_9_and_stopped(tmp_path: Path) -> None:
    records = ChildRecords(tmp_path / "children")
    waits: list[float] = []

    async def sleep(delay: float) -> None:  # the back-off, counted, barely waited
        waits.append(delay)
        await asyncio.sleep(0.01)

    log_path = tmp_path / "batch.log"
    child = ChildBatch([sys.executable, "-c", STAND_IN], log_path, records=records, sleep=sleep)
    with capture_logs() as logs:
        await child.start()
        await _wait_for(lambda: child.pid is not None, "started")
        first = child.pid
        assert first is not None
        record = tmp_path / "children" / record_file(RECORD)
        await _wait_for(lambda: str(first) in _text(record), "recorded")
        await _wait_for(lambda: f"up {first}" in _text(log_path), "its output in the log")
        os.kill(first, signal.SIGKILL)
        await _wait_for(lambda: child.pid not in (None, first), "restarted")
        second = child.pid
        assert second is not None
        await _wait_for(lambda: str(second) in _text(record), "the new pid recorded")
        await _wait_for(lambda: f"up {second}" in _text(log_path), "its output in the log")
        # killed again at once: the service lost nothing, so no back-off grows
        os.kill(second, signal.SIGKILL)
        await _wait_for(lambda: child.pid not in (None, second), "restarted again")
        second = child.pid
        assert second is not None
        await _wait_for(lambda: f"up {second}" in _text(log_path), "its output in the log")
        await child.close()
    assert waits == [KILLED_RESTART_S, KILLED_RESTART_S]
    events = [e["event"] for e in logs]
    assert events.count("batch_service_started") == 3
    exited = next(e for e in logs if e["event"] == "batch_service_exited")
    assert exited["status"] == -signal.SIGKILL and exited["retry_in_s"] == KILLED_RESTART_S
    assert "resumes every batch from its store" in exited["hint"]
    assert events[-1] == "batch_service_stopped"
    # Stopped: the process is gone and off the record.
    with pytest.raises(ProcessLookupError):
        os.kill(second, 0)
    assert not record.exists()
    text = log_path.read_text()
    assert f"up {first}" in text and f"up {second}" in text
    assert stat.S_IMODE(log_path.stat().st_mode) == 0o640


def test_a_killed_service_comes_back_at_once_and_one_failing_by_itself_backs_off() -> None:
    """A kill -9 (an operator's, the OOM killer's) says nothing about the next start and
    costs no result: the service is started again at once, and the back-off starts over.
    A service that ends by itself before it has run a minute backs off, doubling."""
    killed = -signal.SIGKILL
    assert next_start(None, 5.0, killed) == (KILLED_RESTART_S, None)
    assert next_start(8.0, 5.0, killed) == (KILLED_RESTART_S, None)  # the back-off starts over
    assert KILLED_RESTART_S < RESTART_INITIAL_S
    waits: list[float] = []
    state: float | None = None
    for _ in range(3):  # a start that fails: exit 2 within a second
        wait, state = next_start(state, 0.5, 2)
        waits.append(wait)
    assert waits == [1.0, 2.0, 4.0]
    assert next_start(4.0, 3600.0, 1) == (1.0, 1.0)  # a crash after a long run: from 1 s
    assert next_start(4.0, 0.5, None)[0] == 8.0  # could not be run at all (no status)
    assert next_start(4.0, 0.5, -signal.SIGSEGV)[0] == 8.0  # a crash of its own


async def test_a_service_that_cannot_be_run_says_why_once_per_step(tmp_path: Path) -> None:
    waits: list[float] = []
    parked = asyncio.Event()

    async def sleep(delay: float) -> None:
        waits.append(delay)
        if len(waits) == 3:
            parked.set()
            await asyncio.Event().wait()

    child = ChildBatch([str(tmp_path / "no-such-python")], tmp_path / "batch.log", sleep=sleep)
    with capture_logs() as logs:
        await child.start()
        await asyncio.wait_for(parked.wait(), 60)
        await child.close()
    assert waits == [1, 2, 4]
    loud = [e for e in logs if e["log_level"] == "warning"]
    assert [e["event"] for e in loud] == ["batch_service_not_started"] * 3
    assert "no-such-python" in loud[0]["error"]


async def test_a_planted_log_link_is_refused_with_the_services_name(tmp_path: Path) -> None:
    (tmp_path / "batch.log").symlink_to(tmp_path / "elsewhere")
    waits: list[float] = []
    parked = asyncio.Event()

    async def sleep(delay: float) -> None:
        waits.append(delay)
        parked.set()
        await asyncio.Event().wait()

    child = ChildBatch([sys.executable, "-c", STAND_IN], tmp_path / "batch.log", sleep=sleep)
    with capture_logs() as logs:
        await child.start()
        await asyncio.wait_for(parked.wait(), 60)
        await child.close()
    loud = next(e for e in logs if e["event"] == "batch_service_not_started")
    assert loud["error"].startswith(f"batch service log {tmp_path / 'batch.log'} is a symbolic")
    assert not (tmp_path / "elsewhere").exists()


# -- the agent's choice: service.build_batch --------------------------------------------------


def _demo_spec(tmp_path: Path, **batch: object) -> FarmSpec:
    from farmtoml import rewritten
    from sglang_farm.config import load_spec

    root = Path(__file__).resolve().parent.parent
    text = rewritten(
        (root / "etc/sglang-farm/demo.toml").read_text(),
        farm={"state_dir": str(tmp_path / "state")},
        batch={"api_key_file": str(tmp_path / "keys" / "batch.key"), **batch},
    )
    return load_spec(text, source=str(tmp_path / "demo.toml"), agent_python=sys.executable)


def test_the_demo_runs_the_batch_service_in_the_process_runtime_only(tmp_path: Path) -> None:
    from sglang_farm.service import build_batch

    spec = _demo_spec(tmp_path)
    assert build_batch(spec, "systemd", "/etc/demo.toml") is None  # its own unit there
    assert not (tmp_path / "keys").exists()
    with capture_logs() as logs:
        child = build_batch(spec, "process", "/etc/demo.toml")
    assert isinstance(child, ChildBatch)
    key = tmp_path / "keys" / "batch.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert [e["event"] for e in logs] == ["batch_key_created"]
    # The next start keeps the key it made.
    made = key.read_text()
    with capture_logs() as logs:
        assert build_batch(spec, "process", "/etc/demo.toml") is not None
    assert key.read_text() == made and logs == []
    off = _demo_spec(tmp_path, enabled=False)
    assert build_batch(off, "process", "/etc/demo.toml") is None


def test_a_key_that_cannot_be_made_is_said_and_the_farm_runs_without_the_service(
    tmp_path: Path,
) -> None:
    from sglang_farm.service import build_batch

    (tmp_path / "keys").write_text("a file where the key's folder should be\n")
    spec = _demo_spec(tmp_path)
    with capture_logs() as logs:
        assert build_batch(spec, "process", "/etc/demo.toml") is None
    (said,) = [e for e in logs if e["event"] == "batch_not_started"]
    assert said["log_level"] == "error" and said["file"] == str(tmp_path / "keys" / "batch.key")
    assert "api_key_file" in said["fix"]
