"""farmctl wait, drain-host and undrain-host (issue 26 item 2) against a real control
socket over FakeOps: what an orchestrator branches on is the exit code."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest

from fake_ops import FakeOps
from ops_socket import GATEWAY, Agent, serving
from sglang_farm.canary.view import CanaryState, RolloutVerdictView
from sglang_farm.cli.ctl import wait
from sglang_farm.cli.ctl.exits import Exit
from sglang_farm.farm_view import Phase, Quarantine
from sglang_farm.workers.supervisor import Rollout


@pytest.fixture
def gw_agent(monkeypatch: pytest.MonkeyPatch) -> Iterator[Agent]:
    monkeypatch.setattr(wait, "SETTLED_POLL_S", 0.02)
    with serving(FakeOps(4, gateway=GATEWAY)) as a:
        yield a


def test_wait_on_a_settled_farm_exits_0_at_once(gw_agent: Agent) -> None:
    r = gw_agent.run("wait", "--timeout", "5")
    assert r.exit_code == Exit.OK, r.output
    assert "settled: 4 of 4 workers serving (ready and in the gateway)" in r.output


def test_wait_blocks_until_a_worker_is_back_in_the_gateway(gw_agent: Agent) -> None:
    ops = gw_agent.ops
    ops.workers[2] = replace(ops.workers[2], phase=Phase.STARTING, in_gateway=False)

    def later() -> None:
        time.sleep(0.3)
        gw_agent.soon(
            lambda: ops.workers.__setitem__(2, replace(ops.workers[2], phase=Phase.READY))
        )
        time.sleep(0.3)
        gw_agent.soon(lambda: ops.workers.__setitem__(2, replace(ops.workers[2], in_gateway=True)))

    t = threading.Thread(target=later)
    t.start()
    r = gw_agent.run("wait", "--timeout", "30")
    t.join()
    assert r.exit_code == Exit.OK, r.output
    lines = r.output.splitlines()
    assert lines[0] == "waiting: worker 2 is starting"
    assert "waiting: worker 2 is ready, not yet in the gateway" in lines
    assert lines[-1].startswith("settled: 4 of 4")


def test_wait_times_out_with_7_and_says_what_it_waited_for(gw_agent: Agent) -> None:
    gw_agent.ops.rolling = 1
    r = gw_agent.run("wait", "--timeout", "0.2")
    assert r.exit_code == Exit.TIMED_OUT, r.output
    assert int(Exit.TIMED_OUT) == 7  # documented
    assert "not settled after 0.2s: waiting for a rolling restart is under way" in r.output


def test_wait_json_is_the_agents_result_with_timed_out(gw_agent: Agent) -> None:
    gw_agent.ops.rolling = 1
    r = gw_agent.run("wait", "--timeout", "0.1", "--json")
    assert r.exit_code == Exit.TIMED_OUT
    doc = json.loads(r.output.split("\nfarmctl:")[0])
    assert doc["state"] == "waiting" and doc["timed_out"] is True and doc["settled"] is False
    assert doc["waiting"] == [
        {"kind": "rolling_restart", "worker": None, "message": "a rolling restart is under way"}
    ]


def _canary(state: CanaryState) -> RolloutVerdictView:
    return RolloutVerdictView(state, "ab12cd", 1, time.time(), 30.0, None, "ITL p99 5x")


@pytest.mark.parametrize(
    ("hold", "code", "words"),
    [
        ("failed", Exit.NOT_RUNNING, "worker 3 failed"),
        ("quarantined", Exit.NOT_RUNNING, "farmctl release-gpu 3"),
        ("halted", Exit.HALTED, "the rollout is halted (canary worker 0 failed: bad flag)"),
        ("rolled_back", Exit.ROLLED_BACK, "change ab12cd on canary worker 1 was rolled back"),
        ("held", Exit.HELD, "change ab12cd on canary worker 1 was held"),
        ("drained", Exit.DRAINED, "farmctl undrain-host"),
    ],
)
def test_wait_exits_at_once_with_the_code_of_what_holds_the_farm(
    gw_agent: Agent, monkeypatch: pytest.MonkeyPatch, hold: str, code: Exit, words: str
) -> None:
    ops = gw_agent.ops
    if hold == "failed":
        ops.workers[3] = replace(ops.workers[3], phase=Phase.FAILED, in_gateway=False)
    elif hold == "quarantined":
        q = Quarantine(3, "xid 79", "fell off the bus", time.time())
        ops.workers[3] = replace(ops.workers[3], phase=Phase.QUARANTINED, quarantine=q)
    elif hold == "halted":
        ops.rollout = Rollout.HALTED
        monkeypatch.setattr(
            FakeOps,
            "view",
            lambda self, v=FakeOps.view: replace(
                v(self), rollout_reason="canary worker 0 failed: bad flag"
            ),
        )
    elif hold == "drained":
        ops.held_out_since = time.time()
    else:
        cv = _canary(CanaryState(hold))
        monkeypatch.setattr(
            FakeOps, "view", lambda self, v=FakeOps.view: replace(v(self), canary=cv)
        )
    began = time.monotonic()
    r = gw_agent.run("wait", "--timeout", "60")
    assert r.exit_code == code, r.output
    assert time.monotonic() - began < 30  # at once, not after the timeout
    assert words in r.output


def test_drain_host_holds_the_host_out_and_undrain_puts_it_back(gw_agent: Agent) -> None:
    ops = gw_agent.ops
    r = gw_agent.run("drain-host")
    assert r.exit_code == Exit.OK, r.output
    assert "host drained: workers 0, 1, 2, 3 out of the gateway" in r.output
    assert ops.calls[-1] == ("drain-host", ()) and ops.drain_timeouts == [None]
    assert not any(w.in_gateway for w in ops.workers.values())
    st = gw_agent.run("status")
    assert "host DRAINED (out of the gateway)" in st.output
    assert gw_agent.run("wait", "--timeout", "5").exit_code == Exit.DRAINED
    r = gw_agent.run("undrain-host")
    assert r.exit_code == Exit.OK, r.output
    assert "host back in the gateway: workers 0, 1, 2, 3" in r.output
    assert gw_agent.run("wait", "--timeout", "5").exit_code == Exit.OK


def test_drain_host_that_runs_out_of_time_exits_7_naming_what_is_left(gw_agent: Agent) -> None:
    gw_agent.ops.drain_left = {2: 5, 3: None}
    r = gw_agent.run("drain-host", "--timeout", "12")
    assert r.exit_code == Exit.TIMED_OUT, r.output
    assert gw_agent.ops.drain_timeouts == [12.0]
    assert "worker 2 (5 in flight), worker 3 (unknown in flight) still had requests" in r.output
    assert "the host stays out" in r.output


def test_drain_host_with_a_gateway_it_could_not_confirm_exits_11_naming_it(
    gw_agent: Agent,
) -> None:
    """Issue 30 item 11: a frozen gateway (smg SIGSTOPped) counts as down, so the drain
    goes on without it, but it never confirmed the workers out: not "host drained"."""
    gw_agent.ops.drain_unconfirmed = {"http://gw-b:8000": (0, 1, 2, 3)}
    r = gw_agent.run("drain-host")
    assert r.exit_code == Exit.UNCONFIRMED and int(Exit.UNCONFIRMED) == 11, r.output
    assert "could not confirm it out of gateway http://gw-b:8000 (workers 0, 1, 2, 3)" in (r.output)
    assert "host drained" not in r.output and "may still route users" in r.output
    r = gw_agent.run("drain-host", "--json")
    assert r.exit_code == Exit.UNCONFIRMED, r.output
    doc = json.loads(r.output.split("\nfarmctl:")[0])
    assert doc["unconfirmed"] == {"http://gw-b:8000": [0, 1, 2, 3]}
    assert doc["drained_all"] is False


def test_drain_host_without_a_gateway_is_refused_with_what_to_do() -> None:
    with serving(FakeOps(2)) as a:
        r = a.run("drain-host")
    assert r.exit_code == Exit.FAILED, r.output
    assert "this farm has no gateway" in r.output and "farmctl stop all" in r.output


def test_wait_with_a_gateway_down_times_out_with_7_naming_it(gw_agent: Agent) -> None:
    """Issue 26 review: settled is in EVERY gateway ([gateway] urls); one that does not
    answer keeps an orchestrator waiting, by name."""
    a = replace(GATEWAY, routed=(0, 1, 2, 3))
    b = replace(a, url="http://gw-b:8000", up=False, last_error="cannot reach it")
    gw_agent.ops.gateway = replace(a, gateways=(a, b))
    r = gw_agent.run("wait", "--timeout", "0.2")
    assert r.exit_code == Exit.TIMED_OUT, r.output
    assert (
        "not settled after 0.2s: waiting for the gateway at http://gw-b:8000 is not answering "
        "(cannot reach it)" in r.output
    )
