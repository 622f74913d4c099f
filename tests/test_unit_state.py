"""Pure: a worker unit's observed states into Started/Exited (`runtime.unit_state`), and
the command line of a process (`runtime.unit_procs.proc_argv`); no D-Bus, no pystemd."""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

from sglang_farm.runtime import Exited, Started
from sglang_farm.runtime.unit_procs import proc_argv
from sglang_farm.runtime.unit_state import (
    CLD_EXITED,
    CLD_KILLED,
    Tracked,
    UnitState,
    exec_start_argv,
    exit_status,
    observe,
    units_of,
    worker_of,
)
from sglang_farm.runtime.unit_syntax import worker_unit as unit_name


def test_exit_status_maps_killed_to_negative_signal() -> None:
    assert exit_status(CLD_KILLED, 9) == -9
    assert exit_status(CLD_EXITED, 3) == 3
    assert exit_status(0, 0) is None


def test_unit_names_round_trip() -> None:
    assert unit_name(3) == "sglang@3.service"
    assert worker_of("sglang@3.service") == 3
    assert worker_of("sglang@x.service") is None
    assert worker_of("sglang-farm.service") is None


_ACT = UnitState("activating", "start-post", main_pid=100)


def test_new_main_pid_while_activating_is_started() -> None:
    tracked, events = observe(0, None, _ACT)
    assert events == [Started(0, 100)]
    assert tracked.live_pid == 100
    _, again = observe(0, tracked, UnitState("active", "running", main_pid=100))
    assert again == []


def test_sigkilled_main_process_is_exited_with_minus_nine() -> None:
    tracked = Tracked(_ACT, live_pid=100)
    failed = UnitState(
        "failed",
        "failed",
        0,
        exec_main_pid=100,
        exec_main_code=CLD_KILLED,
        exec_main_status=9,
        result="signal",
    )
    tracked, events = observe(0, tracked, failed)
    assert events == [Exited(0, 100, -9, "signal")]
    # The same state again (a second signal for the same change) adds nothing.
    assert observe(0, tracked, failed)[1] == []


def test_replaced_main_pid_reports_exit_then_start() -> None:
    tracked = Tracked(UnitState("active", "running", main_pid=100), live_pid=100)
    restarted = UnitState("activating", "start", main_pid=200, exec_main_pid=200)
    _, events = observe(0, tracked, restarted)
    assert events == [Exited(0, 100, None, "success"), Started(0, 200)]


def test_exec_failure_without_seen_pid_is_exited() -> None:
    prev = Tracked(UnitState("activating", "start"))
    failed = UnitState(
        "failed",
        "failed",
        0,
        exec_main_pid=55,
        exec_main_code=CLD_EXITED,
        exec_main_status=203,
        result="exit-code",
    )
    assert observe(0, prev, failed)[1] == [Exited(0, 55, 203, "exit-code")]


def test_stale_snapshot_does_not_restart_an_exited_pid() -> None:
    tracked = Tracked(UnitState("failed", "failed"), live_pid=None, ended_pid=100)
    stale = UnitState("active", "running", main_pid=100)
    assert observe(0, tracked, stale)[1] == []


def test_silent_seed_tracks_running_unit_without_events() -> None:
    tracked, events = observe(0, None, UnitState("active", "running", main_pid=7), silent=True)
    assert events == [] and tracked.live_pid == 7


def test_exec_start_argv_is_the_commands_argv() -> None:
    props = {"ExecStart": [(b"/usr/bin/python3", [b"/usr/bin/python3", b"-m", b"x"], False, 0)]}
    assert exec_start_argv(props) == ("/usr/bin/python3", "-m", "x")
    assert exec_start_argv({}) is None
    assert exec_start_argv({"ExecStart": []}) is None


def test_units_of_rendered_files() -> None:
    files = [
        PurePosixPath("sglang@3.service.d/50-farm.conf"),
        PurePosixPath("sglang@3.service.d/60-x.conf"),
        PurePosixPath("sglang-farm.service.d/50-farm.conf"),
        PurePosixPath("sglang-farm-gateway.service"),
    ]
    assert units_of(files) == [
        "sglang-farm-gateway.service",
        "sglang-farm.service",
        "sglang@3.service",
    ]


def test_proc_argv_is_the_processes_command_line() -> None:
    assert proc_argv(os.getpid()) == tuple(
        Path("/proc/self/cmdline").read_bytes().rstrip(b"\0").decode().split("\0")
    )
    assert proc_argv(2**22 + 1) is None  # above pid_max: never a process
