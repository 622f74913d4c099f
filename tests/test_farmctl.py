"""farmctl against a real control socket served (in a thread) over FakeOps."""

from __future__ import annotations

import json
import shlex
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from fake_ops import FakeOps
from ops_socket import GATEWAY, Agent, serving
from sglang_farm.cli.ctl.connection import _agent_error
from sglang_farm.cli.ctl.exits import Exit
from sglang_farm.cli.ctl.status import format_status
from sglang_farm.cli.farmctl import cli
from sglang_farm.control.farm_api import ReloadResult
from sglang_farm.errors import AgentError
from sglang_farm.farm_view import Phase


@pytest.fixture
def agent() -> Iterator[Agent]:
    with serving(FakeOps(4)) as a:
        yield a


@pytest.fixture
def gw_agent() -> Iterator[Agent]:
    """A farm of 4 behind a gateway: ready workers are in it; stops and restarts drain."""
    with serving(FakeOps(4, gateway=GATEWAY)) as a:
        yield a


def test_status_prints_a_table_with_vram(agent: Agent) -> None:
    r = agent.run("status")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0] == "farm test-farm · process runtime · rollout done · 4/4 ready"
    assert lines[2].split() == ["WORKER", "GPU", "PORT", "STATE", "FOR", "PID", "RESTARTS", "VRAM"]
    assert lines[3].split() == [
        "0",
        "0",
        "30000",
        "ready",
        "1h00m",
        "1000",
        "0",
        "60.0/80.0",
        "GiB",
    ]
    assert "QUEUE" not in r.output  # the status carries no queue depth


def test_status_shows_no_vram_for_a_worker_without_a_process(agent: Agent) -> None:
    """A stopped worker showed its GPU's last figure (126.0/140.4 GiB in the demo): stale."""
    assert agent.run("stop", "1").exit_code == 0
    rows = {line.split()[0]: line.split() for line in agent.run("status").output.splitlines()[3:7]}
    assert rows["1"][3] == "stopped"
    assert rows["1"][-1] == "-"
    assert rows["0"][-2:] == ["60.0/80.0", "GiB"]  # the serving worker's figure stays


def test_status_json_is_the_raw_result(agent: Agent) -> None:
    r = agent.run("--json", "status")
    assert r.exit_code == 0
    st = json.loads(r.output)
    assert st["protocol_version"] == 1 and len(st["workers"]) == 4


# Every subcommand that talks to the agent, with arguments that print one JSON document.
AGENT_COMMANDS = [
    ("status",),
    ("why", "1"),
    ("endpoints",),
    ("version",),
    ("logs", "1", "-n", "2"),
    ("reset-oom", "2"),
    ("reload",),
    ("stop", "1"),
    ("start", "1"),
    ("restart", "0", "--no-wait"),
    ("release-gpu", "1"),  # worker 1 quarantined before each run
    ("wait", "--timeout", "5"),
    ("drain-host",),  # a gateway given before each run
    ("undrain-host",),
]


def test_status_json_after_the_subcommand_as_the_readme_writes_it(agent: Agent) -> None:
    r = agent.run("status", "--json")
    assert r.exit_code == 0, r.output
    st = json.loads(r.output)
    assert st["protocol_version"] == 1 and [w["id"] for w in st["workers"]] == [0, 1, 2, 3]


@pytest.mark.parametrize("argv", AGENT_COMMANDS, ids=lambda a: a[0])
def test_json_works_before_and_after_every_subcommand(agent: Agent, argv: tuple[str, ...]) -> None:
    def run(*args: str) -> Result:
        if argv[0] == "release-gpu":
            agent.ops.quarantine(1)
        if argv[0] == "drain-host":
            agent.ops.gateway = GATEWAY
        return agent.run(*args)

    before = run("--json", *argv)
    after = run(*argv, "--json")
    assert before.exit_code == 0 and after.exit_code == 0, (before.output, after.output)
    a, b = json.loads(before.output), json.loads(after.output)
    assert isinstance(a, dict) and isinstance(b, dict) and a and set(a) == set(b)


def test_every_subcommand_but_completion_documents_json(agent: Agent) -> None:
    names = {c[0] for c in AGENT_COMMANDS}
    # batch talks to the batch service, not the agent (tests/test_farmctl_batch*.py).
    assert names == set(cli.commands) - {"completion", "batch"}
    for name in names:
        assert "--json" in agent.run(name, "--help").output, name
    assert agent.run("completion", "bash", "--json").exit_code == Exit.USAGE


def test_format_status_shows_queue_only_when_present_and_failure_notes() -> None:
    now = 1000.0
    w = {
        "id": 1,
        "gpus": [1],
        "port": 30001,
        "state": "failed",
        "since": 990.0,
        "pid": None,
        "restarts_total": 3,
        "restarts_by_reason": {"oom": 2, "crash": 1},
        "last_failure": {"summary": "CUDA out of memory while loading"},
        "oom_step": 2,
    }
    text = format_status(
        {
            "farm": "f",
            "runtime": "systemd",
            "rollout": "halted",
            "now": now,
            "workers": [{**w, "queue_depth": 7}],
            "gpus": [],
        }
    )
    _head, _, cols, row, _, note = text.splitlines()
    assert cols.split() == ["WORKER", "GPU", "PORT", "STATE", "FOR", "PID", "RESTARTS", "QUEUE"]
    assert row.split() == [
        "1",
        "1",
        "30001",
        "failed",
        "10s",
        "-",
        "3",
        "(oom",
        "2,",
        "crash",
        "1)",
        "7",
    ]
    assert note == "worker 1: CUDA out of memory while loading, OOM step 2 (farmctl why 1)"


def test_restart_waits_until_ready_showing_progress(agent: Agent) -> None:
    agent.ops.step = 0.3  # each phase outlasts the server's 0.1 s look at the view
    r = agent.run("restart", "2")
    assert r.exit_code == 0, r.output
    out = r.output.splitlines()
    assert out[0] == "restart issued for worker 2"
    assert any(ln.startswith("worker 2: starting") for ln in out)
    assert out[-1].startswith("worker 2: ready after")
    assert ("restart", (2,)) in agent.ops.calls


def test_restart_no_wait_returns_at_once(agent: Agent) -> None:
    agent.ops.step = 5.0
    t0 = time.monotonic()
    r = agent.run("restart", "1", "--no-wait")
    assert r.exit_code == 0 and r.output == "restart issued for worker 1\n"
    assert time.monotonic() - t0 < 3


def test_restart_that_ends_failed_exits_3(agent: Agent) -> None:
    agent.ops.fail_next.add(3)
    r = agent.run("restart", "3")
    assert r.exit_code == Exit.NOT_RUNNING and int(Exit.NOT_RUNNING) == 3
    assert r.stderr.strip() == (
        "farmctl: worker 3 failed: CUDA out of memory while loading the model; see farmctl why 3"
    )


def test_restart_timeout_exits_1(agent: Agent) -> None:
    agent.ops.step = 5.0
    r = agent.run("restart", "0", "--timeout", "0.3")
    assert r.exit_code == Exit.FAILED
    assert "worker 0 is not ready after 0.3s" in r.stderr


def test_restart_all_waits_for_every_worker(agent: Agent) -> None:
    r = agent.run("restart", "all")
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[0] == "restart issued for workers 0, 1, 2, 3"
    assert (
        sum(ln.startswith("worker ") and "ready after" in ln for ln in r.output.splitlines()) == 4
    )


def _ready_lines(output: str) -> list[tuple[str, float]]:
    """(who, seconds) of every line that says a worker is ready."""
    out = []
    for ln in output.splitlines():
        who, _, rest = ln.partition(": ")
        if rest.startswith("ready"):
            out.append((who, float(rest.rsplit(" ", 1)[-1].strip("()s"))))
    return out


def test_restart_all_reports_each_worker_once_with_its_real_duration(agent: Agent) -> None:
    agent.ops.step = 0.5  # stopping 0.5 s, starting 0.5 s: every worker takes ~1 s
    r = agent.run("restart", "all")
    assert r.exit_code == 0, r.output
    ready = _ready_lines(r.output)
    # In the order they became ready (every worker is followed at once).
    assert sorted(who for who, _ in ready) == ["worker 0", "worker 1", "worker 2", "worker 3"]
    assert all(0.9 <= secs < 5 for _, secs in ready), r.output  # never "ready after 0.0s"


def test_restart_of_one_worker_says_ready_once(agent: Agent) -> None:
    agent.ops.step = 0.3
    r = agent.run("restart", "2")
    assert r.exit_code == 0, r.output
    ready = _ready_lines(r.output)
    assert len(ready) == 1 and ready[0][0] == "worker 2" and 0.5 <= ready[0][1] < 5, r.output
    assert r.output.splitlines()[-1] == f"worker 2: ready after {ready[0][1]:.1f}s"


def test_busy_is_exit_1_with_the_agents_reason(agent: Agent) -> None:
    agent.ops.issue_delay = 1.0
    bg = threading.Thread(target=agent.run, args=("stop", "1"))
    bg.start()
    time.sleep(0.3)
    r = agent.run("start", "1")
    bg.join()
    assert r.exit_code == 1
    assert r.stderr.startswith("farmctl: start refused (busy): worker 1 is busy")


def test_state_change_while_the_agent_starts_is_busy_and_reads_still_work(agent: Agent) -> None:
    agent.ops.startup_reason = "the agent is restoring its state and adopting running workers"
    r = agent.run("stop", "1")
    assert r.exit_code == Exit.FAILED
    assert r.stderr.startswith(
        "farmctl: stop refused (busy): the agent is restoring its state and adopting running "
        "workers; state changes wait until it is done: retry stop in a few seconds"
    )
    assert r.stderr.count("\n") == 1
    assert agent.run("status").exit_code == 0
    assert agent.ops.calls == []


def test_unknown_worker_is_usage_exit_2(agent: Agent) -> None:
    r = agent.run("why", "9")
    assert r.exit_code == Exit.USAGE
    assert r.stderr == "farmctl: why: no worker 9; workers are 0-3\n"
    assert agent.run("restart", "nine").exit_code == Exit.USAGE  # click's own usage error


def test_start_stop_reset_oom_endpoints(agent: Agent) -> None:
    assert agent.run("stop", "all").output == "stopped workers 0, 1, 2, 3\n"
    assert agent.run("endpoints").output == ""
    assert agent.run("start", "2", "--wait").exit_code == 0
    assert agent.run("endpoints").output == "http://127.0.0.1:30002\n"
    r = agent.run("reset-oom", "2")
    assert r.exit_code == 0 and agent.ops.oom_resets == [2]


def test_why_shows_failure_lines_action_and_advice(agent: Agent) -> None:
    agent.ops.fail_next.add(1)
    assert agent.run("restart", "1").exit_code == 3
    out = agent.run("why", "1").output
    assert out.splitlines()[0] == "worker 1: failed"
    assert "  | torch.OutOfMemoryError: CUDA out of memory" in out
    assert "what the farm did: moved to OOM ladder step 1" in out
    assert "what to do: lower --mem-fraction-static" in out
    assert "OOM ladder step: 1 (less-static-memory); farmctl reset-oom 1 undoes it" in out
    assert agent.run("why", "0").output == "worker 0: ready\nno failure recorded\n"


def test_why_says_a_failure_the_worker_has_served_since_is_its_past(agent: Agent) -> None:
    """Issue 31 item 4: after reset-oom, restart and a stop, `why 3` still said `gave up
    after 6 failures in a row` as if it ailed the worker now."""
    from fake_ops import OOM_FAILURE

    gave_up = "gave up after 6 failures in a row (5 restarts allowed: restart.max_failures)"
    w = agent.ops.workers[3]
    agent.ops.workers[3] = replace(
        w,
        phase=Phase.STOPPED,
        last_failure=OOM_FAILURE,
        last_failure_at=time.time() - 600,
        last_action=gave_up,
        failure_past="served",
    )
    lines = agent.run("why", "3").output.splitlines()
    assert lines[0] == "worker 3: stopped"
    assert lines[1].startswith("last failure (10m0"), lines[1]  # 10m00s, or a second more
    assert lines[1].endswith(
        f"s ago; worker 3 has served since): {OOM_FAILURE.summary} [{OOM_FAILURE.kind}]"
    )
    assert f"what the farm did then: {gave_up}" in lines
    assert f"what to do if it happens again: {OOM_FAILURE.advice}" in lines
    assert not [ln for ln in lines if ln.startswith(("what the farm did:", "what to do:"))]
    agent.ops.workers[3] = replace(agent.ops.workers[3], failure_past="reset")
    out = agent.run("why", "3").output
    assert "s ago; the operator has reset worker 3 since): CUDA out of memory" in out
    raw = json.loads(agent.run("why", "3", "--json").output)
    assert raw["failure_past"] == "reset"
    # Starting again after the reset: status no longer calls that failure its news.
    agent.ops.workers[3] = replace(agent.ops.workers[3], phase=Phase.STARTING)
    assert OOM_FAILURE.summary not in agent.run("status").output
    agent.ops.workers[3] = replace(agent.ops.workers[3], failure_past=None)
    assert f"worker 3: {OOM_FAILURE.summary}" in agent.run("status").output


def test_reload_applied_and_rejected(agent: Agent) -> None:
    r = agent.run("reload")
    # No canary analysis: the restarted worker is followed as `restart` follows it.
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0] == "config applied: restarting worker 1"
    assert all(ln.startswith("worker 1: ") for ln in lines[1:-2])  # its phases, as seen
    assert lines[-2].startswith("worker 1: ready after ")
    assert lines[-1] == "rollout done"
    r = agent.run("reload", "--no-wait")
    assert r.exit_code == 0 and r.output == "config applied: restarting worker 1\n"
    agent.ops.reload_result = ReloadResult(False, problems=("workers[2].gpu: expected an int",))
    r = agent.run("reload")
    assert r.exit_code == 1
    assert "  workers[2].gpu: expected an int" in r.stderr
    assert "reload rejected: 1 problem in the config; the old config keeps running" in r.stderr


def test_a_reload_that_needs_an_agent_restart_exits_10_and_says_so(agent: Agent) -> None:
    """Fleet review #1: a valid config that only an agent restart applies ([gateway]) is
    not a config problem: exit 10, which an orchestrator acts on (systemctl restart)."""
    problem = "farm.toml: [gateway] changed; a reload does not apply it: restart the agent"
    agent.ops.reload_result = ReloadResult(False, problems=(problem,), restart_needed=True)
    r = agent.run("reload")
    assert r.exit_code == 10, r.output
    assert f"  {problem}" in r.stderr
    assert "needs an agent restart" in r.stderr and "systemctl restart sglang-farm" in r.stderr
    r = agent.run("--json", "reload")
    assert r.exit_code == 10 and json.loads(r.stdout)["restart_needed"] is True


def test_logs_tail_and_follow(agent: Agent) -> None:
    assert agent.run("logs", "1", "-n", "2").output == "w1 line 48\nw1 line 49\n"

    def feed() -> None:
        deadline = time.monotonic() + 5
        while not agent.ops.follow_queues and time.monotonic() < deadline:
            time.sleep(0.01)
        agent.soon(agent.ops.push_log, "new 1")
        agent.soon(agent.ops.push_log, None)

    threading.Thread(target=feed).start()
    r = agent.run("logs", "1", "-n", "1", "-f")
    assert r.exit_code == 0 and r.output == "w1 line 49\nnew 1\n"


def test_version_and_completion(agent: Agent) -> None:
    assert agent.run("version").output == "farmctl 0.1.0\nagent 0.1.0 (protocol 1)\n"
    r = agent.run("completion", "bash")
    assert r.exit_code == 0 and "_FARMCTL_COMPLETE=bash_complete" in r.output
    assert "complete -o nosort -F" in r.output


def test_socket_from_config_and_env(agent: Agent, tmp_path: Path) -> None:
    cfg = tmp_path / "farm.toml"
    cfg.write_text(f'[control]\nsocket = "{agent.path}"\n')
    r = CliRunner().invoke(cli, ["--config", str(cfg), "version"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli, ["version"], env={"FARMCTL_SOCKET": agent.path})
    assert r.exit_code == 0, r.output
    cfg.write_text("[control\n")
    r = CliRunner().invoke(cli, ["--config", str(cfg), "status"])
    assert r.exit_code == Exit.USAGE and "is not valid TOML" in r.stderr


def test_bad_config_names_the_real_check_config_command(tmp_path: Path) -> None:
    from sglang_farm.cli.main import cli as sglang_farm_cli

    cfg = tmp_path / "my farm.toml"
    cfg.write_text("[control\n")
    r = CliRunner().invoke(cli, ["--config", str(cfg), "status"])
    assert r.exit_code == Exit.USAGE
    advice = r.stderr.rstrip("\n").rsplit("check it with: ", 1)[1]
    assert advice == f"sglang-farm check-config --config '{cfg}'"
    # The command farmctl names exists and takes those arguments: it reports the
    # config problem (exit 1), not a usage error (exit 2, "No such command").
    named = shlex.split(advice)
    checked = CliRunner().invoke(sglang_farm_cli, named[1:])
    assert checked.exit_code == 1, checked.output


def farmctl(*args: str) -> subprocess.CompletedProcess[str]:
    code = "import sys; from sglang_farm.cli.farmctl import main; sys.argv[0]='farmctl'; main()"
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=30
    )


def test_an_unreachable_demo_gets_the_demos_hint_not_systemctl(tmp_path: Path) -> None:
    """With the demo's agent down, farmctl suggested `systemctl status sglang-farm`."""
    demo = tmp_path / "etc" / "demo.toml"
    demo.parent.mkdir()
    demo.write_text(f'[control]\nsocket = "{tmp_path / "gone.sock"}"\n')
    p = farmctl("--config", str(demo), "status")
    assert p.returncode == Exit.UNREACHABLE
    assert "systemctl" not in p.stderr
    assert p.stderr.rstrip().endswith(
        f"is the demo running? start it with ./scripts/demo "
        f"(or sglang-farm run --config {demo} --runtime process)"
    )
    other = tmp_path / "oom-demo.toml"
    other.write_text(demo.read_text())
    p = farmctl("--config", str(other), "status")
    assert p.stderr.rstrip().endswith(
        f"is its farm running? start it with: sglang-farm run --config {other} --runtime process"
    )


def test_unreachable_agent_is_exit_4_with_one_line(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.sock")
    p = farmctl("--socket", missing, "status")
    assert p.returncode == Exit.UNREACHABLE and int(Exit.UNREACHABLE) == 4
    assert p.stderr == (
        f"farmctl: cannot reach the agent at {missing}: no socket there; "
        "is sglang-farm running? (systemctl status sglang-farm)\n"
    )
    stale = str(tmp_path / "stale.sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(stale)
    s.close()
    p = farmctl("--socket", stale, "restart", "3")
    assert p.returncode == 4 and "nothing listens on the socket" in p.stderr
    assert "Traceback" not in p.stderr and p.stderr.count("\n") == 1


def test_import_path_stays_light() -> None:
    p = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import sglang_farm.cli.farmctl"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    modules = {ln.split("|")[-1].strip() for ln in p.stderr.splitlines() if "|" in ln}
    assert "sglang_farm.cli.farmctl" in modules
    heavy = {"httpx", "prometheus_client", "structlog", "asyncio", "pynvml", "pystemd"}
    assert not heavy & modules, heavy & modules


# --- the gateway and the drain -----------------------------------------------------------


def test_status_shows_the_gateway_line_and_who_is_in_it(gw_agent: Agent) -> None:
    assert gw_agent.run("stop", "1").exit_code == 0
    r = gw_agent.run("status")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    head = "farm test-farm · process runtime · rollout done · 3/4 ready (worker 1 stopped)"
    assert lines[0] == head + " and routed"
    assert lines[1] == "gateway http://127.0.0.1:8000 · up · routes to 3 of 4 workers"
    assert lines[3].split()[:6] == ["WORKER", "GPU", "PORT", "STATE", "GATEWAY", "FOR"]
    assert lines[4].split()[:5] == ["0", "0", "30000", "ready", "in"]
    assert lines[5].split()[:5] == ["1", "1", "30001", "stopped", "out"]


def test_status_without_a_gateway_has_no_gateway_line_or_column(agent: Agent) -> None:
    out = agent.run("status").output
    assert "gateway" not in out.lower()
    assert out.splitlines()[1] == ""


def test_format_status_shows_draining_and_a_gateway_that_does_not_answer() -> None:
    w = {"gpus": [0], "port": 30000, "since": 995.0, "pid": 7, "restarts_total": 0}
    text = format_status(
        {
            "farm": "f",
            "runtime": "process",
            "rollout": "done",
            "ready": 1,
            "now": 1000.0,
            "workers": [
                {**w, "id": 0, "state": "draining", "in_gateway": False},
                {**w, "id": 1, "state": "ready", "in_gateway": True},
            ],
            "gpus": [],
            "gateway": {
                "url": "http://gw:8000",
                "up": False,
                "members": 1,
                "errors": 3,
                "last_error": "connection refused",
            },
        }
    )
    _head, gw, _, cols, draining, ready, _, note = text.splitlines()
    assert gw == (
        "gateway http://gw:8000 · down · routed to 1 of 2 workers when last confirmed"
        " · 3 errors since the agent started"
    )
    assert cols.split() == ["WORKER", "GPU", "PORT", "STATE", "GATEWAY", "FOR", "PID", "RESTARTS"]
    assert draining.split() == ["0", "0", "30000", "draining", "out", "5s", "7", "0"]
    assert ready.split()[3:5] == ["ready", "in"]
    assert note == (
        "gateway http://gw:8000 is not answering: connection refused; "
        "the farm keeps supervising its workers and retries"
    )


def test_restart_drains_by_default_and_shows_the_draining_phase(gw_agent: Agent) -> None:
    gw_agent.ops.step = 0.3  # each phase outlasts the server's 0.1 s look at the view
    r = gw_agent.run("restart", "2")
    assert r.exit_code == 0, r.output
    out = r.output.splitlines()
    assert out[0] == "restart issued for worker 2"
    assert sum(1 for ln in out if ln.startswith("worker 2: draining")) == 1  # said once
    assert out[-1].startswith("worker 2: ready after")
    assert gw_agent.ops.drains == [("restart", (2,), True)]


def test_restart_returns_once_the_gateway_routes_to_the_worker_again(gw_agent: Agent) -> None:
    """`restart 3` returned at "ready" while the worker was still out of the gateway."""
    gw_agent.ops.step = 0.3
    r = gw_agent.run("restart", "3")
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[-1].startswith("worker 3: ready after")
    assert gw_agent.ops.workers[3].in_gateway  # back in when the command returned


def test_restart_all_follows_every_worker_and_says_each_phase_once(agent: Agent) -> None:
    """`restart all` followed only the first worker of each wave (the others were ready by
    their turn) and said a phase more than once."""
    agent.ops.step = 0.3
    r = agent.run("restart", "all")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()[1:]
    for wid in range(4):
        mine = [ln.split(" (")[0] for ln in lines if ln.startswith(f"worker {wid}:")]
        assert mine[:2] == [f"worker {wid}: stopping", f"worker {wid}: starting"], lines
        assert mine[2].startswith(f"worker {wid}: ready after")
        assert len(mine) == 3, lines


def test_restart_no_drain_says_so_and_reaches_the_agent(gw_agent: Agent) -> None:
    r = gw_agent.run("restart", "3", "--no-drain")
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[0] == "restart issued for worker 3 (no drain)"
    assert not any("draining" in ln for ln in r.output.splitlines())
    assert gw_agent.ops.drains == [("restart", (3,), False)]


def test_stop_no_drain_says_so_and_reaches_the_agent(gw_agent: Agent) -> None:
    r = gw_agent.run("stop", "all", "--no-drain")
    assert r.exit_code == 0 and r.output == "stopped workers 0, 1, 2, 3 (no drain)\n"
    assert gw_agent.run("stop", "1").output == "stopped worker 1\n"
    assert gw_agent.ops.drains == [("stop", (0, 1, 2, 3), False), ("stop", (1,), True)]


def test_no_drain_is_documented_and_only_on_stop_and_restart(agent: Agent) -> None:
    for cmd in ("stop", "restart"):
        help_text = " ".join(agent.run(cmd, "--help").output.split())
        assert (
            "--no-drain Skip the gateway drain: the worker is stopped while requests may still "
            "be running." in help_text
        )
    r = agent.run("start", "1", "--no-drain")
    assert r.exit_code == Exit.USAGE
    assert "No such option" in r.stderr and "--no-drain" in r.stderr
    assert agent.ops.calls == []


def test_restart_json_is_raw_with_or_without_no_drain(gw_agent: Agent) -> None:
    r = gw_agent.run("--json", "restart", "0", "--no-drain", "--no-wait")
    assert r.exit_code == 0
    assert set(json.loads(r.output)) == {"workers", "issued_at"}


def test_why_says_a_worker_is_draining(gw_agent: Agent) -> None:
    gw_agent.ops.step = 5.0
    assert gw_agent.run("restart", "1", "--no-wait").exit_code == 0
    lines = gw_agent.run("why", "1").output.splitlines()
    assert lines[0] == "worker 1: draining for 0s"
    assert lines[1] == (
        "draining before a planned stop: it is out of the gateway; the farm waits for its "
        "running and queued requests to finish, at most the drain budget "
        "([gateway] drain_timeout), then stops it (and starts it again if this is a restart)"
    )
    assert lines[2] == "no failure recorded"


def test_endpoints_list_workers_and_the_gateway_only_when_asked(gw_agent: Agent) -> None:
    assert gw_agent.run("stop", "0").exit_code == 0
    r = gw_agent.run("endpoints")
    assert r.exit_code == 0
    assert r.output == "http://127.0.0.1:30001\nhttp://127.0.0.1:30002\nhttp://127.0.0.1:30003\n"
    r = gw_agent.run("endpoints", "--gateway")
    assert r.exit_code == 0 and r.output == "http://127.0.0.1:8000\n"
    raw = json.loads(gw_agent.run("--json", "endpoints").output)
    assert raw["gateway"] == "http://127.0.0.1:8000" and len(raw["endpoints"]) == 3


def test_endpoints_gateway_without_one_exits_1_and_says_what_to_do(agent: Agent) -> None:
    assert len(agent.run("endpoints").output.splitlines()) == 4
    r = agent.run("endpoints", "--gateway")
    assert r.exit_code == Exit.FAILED and r.stdout == ""
    assert r.stderr == (
        "farmctl: this farm has no gateway ([gateway] is off in its config); switch it on "
        "as docs/gateway.md says, or use the workers' URLs (farmctl endpoints)\n"
    )
    assert json.loads(agent.run("--json", "endpoints").output)["gateway"] is None


# --- quarantine and release-gpu -----------------------------------------------------------


def test_status_shows_quarantined_and_a_note_per_quarantined_worker(agent: Agent) -> None:
    agent.ops.quarantine(2)
    agent.ops.quarantine(3, reason="gpu lost", detail="GPU is lost")
    r = agent.run("status")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert (
        lines[0]
        == "farm test-farm · process runtime · rollout done · 2/4 ready (workers 2, 3 quarantined)"
    )
    assert lines[5].split()[:6] == ["2", "2", "30002", "quarantined", "0s", "-"]
    assert lines[-2:] == [
        "worker 2: GPU 2 quarantined (xid 79): farmctl why 2",
        "worker 3: GPU 3 quarantined (gpu lost): farmctl why 3",
    ]
    raw = json.loads(agent.run("status", "--json").output)
    assert raw["workers"][2]["state"] == "quarantined"
    assert raw["workers"][3]["quarantine"]["reason"] == "gpu lost"


def test_format_status_notes_a_quarantine_decided_while_the_worker_stops() -> None:
    w = {"id": 5, "gpus": [5], "port": 30005, "since": 990.0, "pid": 77, "restarts_total": 0}
    q = {"gpu": 5, "reason": "xid 48", "detail": "Double Bit ECC Error", "since": 995.0}
    text = format_status(
        {
            "farm": "f",
            "runtime": "systemd",
            "rollout": "done",
            "now": 1000.0,
            "workers": [{**w, "state": "stopping", "quarantine": q}],
            "gpus": [],
        }
    )
    assert text.splitlines()[-1] == "worker 5: GPU 5 quarantined (xid 48): farmctl why 5"


def test_why_explains_a_quarantine_and_the_next_step(agent: Agent) -> None:
    agent.ops.quarantine(2, reason="xid 48", detail="Double Bit ECC Error")
    r = agent.run("why", "2")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0] == "worker 2: quarantined for 0s"
    assert lines[1].startswith(
        "GPU 2 is quarantined (xid 48): Double Bit ECC Error. The farm stopped the worker"
    )
    assert lines[2].startswith(
        "next step: reset the GPU with `nvidia-smi -r -i 2` when no process holds it "
        "(or reboot), then `farmctl release-gpu 2`"
    )
    assert len(lines) == 3  # no "no failure recorded": the GPU's failure is the story
    raw = json.loads(agent.run("why", "2", "--json").output)
    assert raw["quarantine"]["reason"] == "xid 48" and raw["next_step"] == lines[2][11:]


def test_release_gpu_brings_the_worker_back(agent: Agent) -> None:
    agent.ops.quarantine(2)
    r = agent.run("release-gpu", "2")
    assert r.exit_code == 0, r.output
    assert r.output == (
        "GPU 2 released: worker 2 starting again "
        "(farmctl status shows the progress; farmctl logs 2 -f the output)\n"
    )
    assert agent.ops.calls == [("release-gpu", (2,))]
    deadline = time.monotonic() + 5
    while agent.run("status", "--json").output.count('"state": "ready"') < 4:
        assert time.monotonic() < deadline, "worker 2 did not come back"
        time.sleep(0.05)
    assert agent.ops.workers[2].quarantine is None


def test_refused_release_prints_each_problem_and_exits_1(agent: Agent) -> None:
    agent.ops.quarantine(2)
    agent.ops.release_problems = [
        "GPU 2 has row remaps pending: reset it (nvidia-smi -r -i 2)",
        "GPU 2 still has compute processes (4242): stop them first",
    ]
    r = agent.run("release-gpu", "2")
    assert r.exit_code == Exit.FAILED
    assert r.stdout == ""
    assert r.stderr.splitlines() == [
        "  GPU 2 has row remaps pending: reset it (nvidia-smi -r -i 2)",
        "  GPU 2 still has compute processes (4242): stop them first",
        "farmctl: GPU 2 not released: the quarantine stays; worker 2 stays stopped; fix what "
        "is listed and run farmctl release-gpu 2 again",
    ]
    assert agent.ops.workers[2].quarantine is not None
    raw = agent.run("release-gpu", "2", "--json")
    assert raw.exit_code == Exit.FAILED
    assert json.loads(raw.stdout) == {
        "released": False,
        "gpu": 2,
        "workers": [2],
        "problems": agent.ops.release_problems,
    }


def test_release_of_a_gpu_with_nothing_quarantined_says_so(agent: Agent) -> None:
    r = agent.run("release-gpu", "1")
    assert r.exit_code == Exit.FAILED
    assert r.stderr.splitlines() == [
        "  no worker is quarantined on GPU 1",
        "farmctl: GPU 1 not released: the quarantine stays; fix what is listed and run "
        "farmctl release-gpu 1 again",
    ]


def test_release_of_a_gpu_the_farm_does_not_use_is_usage_exit_2(agent: Agent) -> None:
    r = agent.run("release-gpu", "9")
    assert r.exit_code == Exit.USAGE
    assert r.stderr == (
        "farmctl: release-gpu failed (bad_request): no worker of this farm uses GPU 9; its "
        "workers use GPU 0-3 (farmctl status lists them)\n"
    )
    assert agent.run("release-gpu", "-1").exit_code == Exit.USAGE  # click's own check
    assert agent.ops.calls == []


def test_release_gpu_while_the_agent_starts_is_busy(agent: Agent) -> None:
    agent.ops.quarantine(2)
    agent.ops.startup_reason = "the agent is restoring its state and adopting running workers"
    r = agent.run("release-gpu", "2")
    assert r.exit_code == Exit.FAILED
    assert r.stderr.startswith(
        "farmctl: release-gpu refused (busy): the agent is restoring its state"
    )
    assert agent.ops.calls == []


def test_an_agent_older_than_a_command_is_named_as_such() -> None:
    exc = AgentError("unknown_command", "unknown command 'release-gpu'; commands are status")
    err = _agent_error("release-gpu", exc, as_json=False)
    assert err.exit_code == Exit.FAILED
    assert err.format_message() == (
        "the agent does not know release-gpu: it is older than this farmctl (0.1.0); "
        "upgrade sglang-farm and restart it (systemctl restart sglang-farm)"
    )


def test_completion_offers_release_gpu() -> None:
    # The completion script calls farmctl back: new commands complete with no new script.
    env = {"_FARMCTL_COMPLETE": "bash_complete", "COMP_WORDS": "farmctl rel", "COMP_CWORD": "1"}
    r = CliRunner().invoke(cli, [], env=env, prog_name="farmctl")
    assert r.exit_code == 0, r.output
    assert sorted(r.output.splitlines()) == ["plain,release-gpu", "plain,reload"]


def test_start_or_restart_of_a_quarantined_worker_is_refused_with_the_release_command(
    agent: Agent,
) -> None:
    """Issue 22 item 7. Before: `start 3` printed "start requested for worker 3", exit 0,
    and nothing happened."""
    agent.ops.quarantine(3)
    for cmd in ("start", "restart"):
        t0 = time.monotonic()
        r = agent.run(cmd, "3")
        assert time.monotonic() - t0 < 5  # not the 1200 s default timeout
        assert r.exit_code == Exit.FAILED, r.output
        assert r.stdout == ""
        assert r.stderr == (
            f"farmctl: {cmd} failed: worker 3 is quarantined: GPU 3 is set aside (xid 79), and "
            f"{cmd} leaves it stopped; deal with the GPU (farmctl why 3 says how), then release "
            "it with farmctl release-gpu 3, which re-checks the GPU through NVML and starts "
            "the worker\n"
        )
    assert agent.run("start", "3", "--wait").exit_code == Exit.FAILED
    assert agent.ops.calls == []  # refused before the agent was asked
    raw = agent.run("start", "3", "--json")
    assert json.loads(raw.stdout)["error"]["code"] == "failed"


def test_restart_all_restarts_the_others_and_says_the_quarantined_one_stays(
    agent: Agent,
) -> None:
    agent.ops.quarantine(2)
    r = agent.run("restart", "all")
    assert r.exit_code == Exit.NOT_RUNNING, r.output
    out = r.stdout.splitlines()
    assert out[0] == "restart issued for workers 0, 1, 3"
    assert sorted(ln for ln in out if "ready after" in ln)[0].startswith("worker 0: ready after")
    assert sum("ready after" in ln for ln in out) == 3  # every other worker waited for
    assert r.stderr.splitlines() == [
        "worker 2 is quarantined and stays stopped: release it with farmctl release-gpu "
        "--worker 2 once its GPU is dealt with (farmctl why 2)",
        "farmctl: worker 2 is quarantined and not running (said above); the others are ready",
    ]
    assert agent.ops.calls == [("restart", (0, 1, 3))]
    started = agent.run("start", "all")  # no wait: said, exit 0
    assert started.exit_code == Exit.OK and "worker 2 is quarantined" in started.stderr


def test_release_by_worker_frees_a_quarantine_on_a_gpu_the_worker_was_moved_off(
    agent: Agent,
) -> None:
    """Quarantined on GPU 2, then a reload put worker 2 on GPU 5. Before: neither
    `release-gpu 2` (exit 2: no worker uses it) nor `release-gpu 5` (nothing quarantined
    on it) released it, and no other command did."""
    agent.ops.quarantine(2)
    agent.ops.workers[2] = replace(agent.ops.workers[2], gpus=(5,))
    r = agent.run("release-gpu", "2")
    assert r.exit_code == Exit.USAGE
    assert r.stderr.endswith("worker 2's quarantine names it: farmctl release-gpu --worker 2\n")
    assert agent.run("release-gpu", "5").exit_code == Exit.FAILED
    r = agent.run("release-gpu", "--worker", "2")
    assert r.exit_code == Exit.OK, r.output
    assert r.output == (
        "worker 2 released (GPU 5 checked): worker 2 starting again "
        "(farmctl status shows the progress; farmctl logs 2 -f the output)\n"
    )
    assert agent.ops.calls[-1] == ("release-worker", (2,))
    deadline = time.monotonic() + 5
    while agent.ops.workers[2].phase is not Phase.READY:
        assert time.monotonic() < deadline, "worker 2 did not come back"
        time.sleep(0.05)
    r = agent.run("release-gpu", "--worker", "2")
    assert r.exit_code == Exit.FAILED
    assert r.stderr.splitlines() == [
        "  worker 2 is not quarantined (it is ready): nothing to release",
        "farmctl: worker 2 not released: the quarantine stays; fix what is listed and run "
        "farmctl release-gpu --worker 2 again",
    ]


def test_release_gpu_takes_a_gpu_or_a_worker_not_both_nor_neither(agent: Agent) -> None:
    for argv in (("release-gpu",), ("release-gpu", "1", "--worker", "1")):
        r = agent.run(*argv)
        assert r.exit_code == Exit.USAGE
        assert r.stderr == (
            "farmctl: name the GPU (farmctl release-gpu G) or the worker (farmctl release-gpu "
            "--worker N), one of the two; farmctl status shows which is quarantined\n"
        )
    assert agent.run("release-gpu", "--worker", "9").exit_code == Exit.USAGE  # unknown_worker
    assert agent.ops.calls == []


def test_simulated_vram_is_marked_and_a_stopped_worker_shows_no_queue() -> None:
    """#24: simulated figures say so; a queue depth is shown only for a serving worker."""
    from sglang_farm.control import results
    from sglang_farm.control.farm_api import GpuMemory

    ops = FakeOps(2)
    ops._set(1, Phase.STOPPED)
    st = results.status_result(
        ops.view(),
        [GpuMemory(0, 4 << 30, 80 << 30, True), GpuMemory(1, 1 << 30, 80 << 30, True)],
        version="t",
        now=0.0,
        queues={0: 3.0, 1: 7.0},
    )
    listed = st["workers"]
    assert isinstance(listed, list)
    workers = {w["id"]: w for w in listed}
    assert workers[0]["queue_depth"] == 3.0 and "queue_depth" not in workers[1]
    assert "(simulated)" in format_status(st)
