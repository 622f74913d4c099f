"""The process runtime's children never outlive the agent (issue 22 item 5).

Real processes throughout: `kill -9` of a real agent with simulator workers and smg
leaves nothing (PR_SET_PDEATHSIG); a leftover the death signal could not catch, on
record, is stopped by the next agent, which then brings every worker up; a reused pid
and a record planted in a folder that is not the agent's own are never acted on.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from asuser import as_nobody, nobody_owned
from farmproc import Farm, farm_config, free_port_block, marked_pids, new_marker
from sglang_farm.runtime.children import (
    ChildRecord,
    ChildRecords,
    ProcFacts,
    boot_id,
    leftover,
    proc_facts,
)


def _wait_gone(marker: str, timeout: float = 15.0) -> list[int]:
    end = time.monotonic() + timeout
    left = marked_pids(marker)
    while left and time.monotonic() < end:
        time.sleep(0.1)
        left = marked_pids(marker)
    return left


# -- the pure rule -----------------------------------------------------------------------------


def _rec(**kw: object) -> ChildRecord:
    base: dict[str, object] = dict(
        what="worker 3", pid=4242, start=1000, boot="b1", agent_pid=77, agent_start=10
    )
    base.update(kw)
    return ChildRecord(**base)  # type: ignore[arg-type]


def test_only_the_very_process_on_record_whose_agent_is_gone_is_a_leftover() -> None:
    alive = ProcFacts(start=1000, pgrp=4242, ppid=1, zombie=False)
    assert leftover(_rec(), alive, None, "b1")
    # The pid was reused: another start time.
    assert not leftover(_rec(), ProcFacts(1001, 4242, 1, False), None, "b1")
    # Another boot: pids start over.
    assert not leftover(_rec(), alive, None, "b2")
    assert not leftover(_rec(), None, None, "b1")  # gone
    assert not leftover(_rec(), ProcFacts(1000, 4242, 1, True), None, "b1")  # a zombie
    # Its agent still runs (a second agent on the same state folder): not ours to stop.
    assert not leftover(_rec(), alive, ProcFacts(10, 77, 1, False), "b1")
    # The agent's pid was reused by something else: the agent is gone.
    assert leftover(_rec(), alive, ProcFacts(11, 77, 1, False), "b1")


# -- records on disk ---------------------------------------------------------------------------

_DEAD_AGENT = textwrap.dedent(
    """
    import os, subprocess, sys
    from pathlib import Path
    from sglang_farm.runtime.children import ChildRecords, proc_facts
    folder, what, *argv = sys.argv[1:]
    p = subprocess.Popen(argv, start_new_session=True, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ChildRecords(Path(folder)).record(what, p.pid, proc_facts(p.pid).start)
    print(p.pid)
    """
)


def _left_by_a_dead_agent(folder: Path, what: str, argv: list[str], env: dict[str, str]) -> int:
    """Start `argv` in a session of its own from an agent that then exits (no death signal:
    what a subreaper or a credential change would let survive), on record as `what`."""
    out = subprocess.run(
        [sys.executable, "-c", _DEAD_AGENT, str(folder), what, *argv],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **env},
    )
    return int(out.stdout)


def _holder(port: int) -> list[str]:
    """A process that holds `port` and has a child in its group (SGLang's scheduler)."""
    code = (
        "import socket, subprocess, sys, time\n"
        "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        f"s.bind(('127.0.0.1', {port})); s.listen()\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "time.sleep(600)\n"
    )
    return [sys.executable, "-c", code]


def test_a_recorded_leftover_is_stopped_with_its_group_and_a_reused_pid_is_not(
    tmp_path: Path,
) -> None:
    marker = new_marker()
    env = {"SGLANG_FARM_TEST_MARKER": marker}
    folder = tmp_path / "children"
    port = free_port_block(1)
    pid = _left_by_a_dead_agent(folder, "worker 0", _holder(port), env)
    # A bystander whose pid is on record with another start time: a reused pid.
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        facts = proc_facts(bystander.pid)
        assert facts is not None
        rec = ChildRecord("worker 1", bystander.pid, facts.start - 1, boot_id(), 1, 0)
        (folder / "worker-1.json").write_text(
            json.dumps({k: getattr(rec, k) for k in rec.__slots__})
        )
        os.chmod(folder / "worker-1.json", 0o600)
        deadline = time.monotonic() + 10
        while len(marked_pids(marker)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(marked_pids(marker)) == 2  # the holder and its child

        stopped = ChildRecords(folder).stop_leftovers()

        assert [(r.what, r.pid) for r in stopped] == [("worker 0", pid)]
        assert marked_pids(marker) == []
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free again
        assert bystander.poll() is None  # never signalled
        assert list(folder.iterdir()) == []  # the records are spent
    finally:
        bystander.kill()
        bystander.wait()
        for p in marked_pids(marker):
            os.kill(p, signal.SIGKILL)


def test_records_in_a_folder_another_user_owns_are_never_acted_on(shared_dir: Path) -> None:
    """nobody plants a record naming a root process (its pid and start time are public in
    /proc): the agent refuses the folder and the process lives."""
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        facts = proc_facts(victim.pid)
        assert facts is not None
        state = nobody_owned(shared_dir, "state", 0o755)
        folder = nobody_owned(state, "children", 0o700)
        rec = {
            "what": "worker 0",
            "pid": victim.pid,
            "start": facts.start,
            "boot": boot_id(),
            "agent_pid": 1,
            "agent_start": 0,
        }
        as_nobody(["sh", "-c", f"echo '{json.dumps(rec)}' > {folder}/worker-0.json"])

        assert ChildRecords(folder).stop_leftovers() == []
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


# -- the real agent ----------------------------------------------------------------------------


def _gateway_section(base: int) -> str:
    return textwrap.dedent(
        f"""
        [gateway]
        mode = "managed"
        listen = "127.0.0.1:{base}"
        metrics_listen = "127.0.0.1:{base + 1}"
        policy = "round_robin"
        extra_args = ["--shutdown-grace-period-secs", "1"]
        """
    )


@pytest.mark.slow
def test_kill_9_of_the_agent_leaves_nothing_and_the_next_agent_serves_again(
    short_tmp: Path,
) -> None:
    """The issue's scenario: `kill -9` of the agent (process runtime, managed smg); no
    worker and no smg is left (PDEATHSIG), and the next agent on the same config brings
    every worker back ready and routed."""
    marker = new_marker()
    gateway = _gateway_section(free_port_block(2))
    config = farm_config(
        short_tmp, workers=2, parallel=2, load_seconds=0.3, marker=marker, extra=gateway
    )
    farm = Farm(config, marker)
    try:
        farm.wait_for(lambda e: e.get("event") == "rollout_done", timeout=90)
        farm.wait_for(lambda e: e.get("event") == "gateway_started", timeout=60)
        # Two simulators with a scheduler child each, and smg.
        assert len(marked_pids(marker)) >= 5
    finally:
        farm.stop(signal.SIGKILL)
    left = _wait_gone(marker)
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert left == [], "processes outlived the agent's kill -9"

    again = Farm(config, marker)
    try:
        again.wait_for(lambda e: e.get("event") == "rollout_done", timeout=90)
        again.wait_for(lambda e: e.get("event") == "gateway_member" and e.get("worker") == 0)
        again.wait_for(lambda e: e.get("event") == "gateway_member" and e.get("worker") == 1)
        assert again.named("worker_failed") == [] and again.named("gateway_exited") == []
    finally:
        code = again.stop(signal.SIGINT)
    assert code == 0
    left = _wait_gone(marker)
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert left == []


@pytest.mark.slow
def test_the_next_agent_stops_leftovers_on_its_ports_and_brings_all_workers_and_smg_up(
    short_tmp: Path,
) -> None:
    """What PDEATHSIG could not catch (here: started by an "agent" that exits without it),
    on record, holding worker 0's port and the gateway's: reclaimed, not a conflict."""
    marker = new_marker()
    gw = free_port_block(2)
    config = farm_config(
        short_tmp,
        workers=2,
        parallel=2,
        load_seconds=0.3,
        marker=marker,
        extra=_gateway_section(gw),
    )
    base = int(
        next(ln for ln in config.read_text().splitlines() if ln.startswith("base_port")).split("=")[
            1
        ]
    )
    (short_tmp / "state").mkdir(mode=0o700)
    env = {"SGLANG_FARM_TEST_MARKER": marker}
    children = short_tmp / "state" / "children"
    worker_left = _left_by_a_dead_agent(children, "worker 0", _holder(base), env)
    gateway_left = _left_by_a_dead_agent(children, "gateway", _holder(gw), env)
    farm = Farm(config, marker)
    try:
        farm.wait_for(lambda e: e.get("event") == "rollout_done", timeout=90)
        farm.wait_for(
            lambda e: e.get("event") == "gateway_member" and e.get("worker") == 1, timeout=60
        )
        assert sorted(e["worker"] for e in farm.named("worker_ready")) == [0, 1]
        stopped = {e["child"]: e["pid"] for e in farm.named("leftover_stopped")}
        assert stopped == {"worker 0": worker_left, "gateway": gateway_left}
        for pid in (worker_left, gateway_left):
            facts = proc_facts(pid)
            assert facts is None or facts.zombie
        assert farm.named("gateway_exited") == []
        assert farm.named("worker_failed") == []
    finally:
        code = farm.stop(signal.SIGINT)
    assert code == 0
    left = _wait_gone(marker)
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert left == []


def test_the_first_record_makes_the_state_folder_and_a_private_records_folder(
    tmp_path: Path,
) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        facts = proc_facts(child.pid)
        assert facts is not None
        folder = tmp_path / "state" / "children"
        records = ChildRecords(folder)
        records.record("worker 2", child.pid, facts.start)
        assert (folder.stat().st_mode & 0o777) == 0o700
        assert ((folder / "worker-2.json").stat().st_mode & 0o777) == 0o600
        # Its agent (this process) still runs: a second agent leaves it alone.
        assert records.stop_leftovers() == []
        assert child.poll() is None and (folder / "worker-2.json").exists()
        records.forget("worker 2", child.pid)
        assert not (folder / "worker-2.json").exists()
    finally:
        child.kill()
        child.wait()
