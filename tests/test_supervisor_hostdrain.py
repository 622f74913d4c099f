"""The supervisor's host-level hold (issue 26 item 2): `farmctl drain-host` holds every
worker of the host out of the gateway without stopping it; planned stops, restarts and
rollouts keep working meanwhile; `undrain-host` lets them back in."""

from __future__ import annotations

from dataclasses import replace

from sglang_farm.farm_view import Phase
from sglang_farm.workers.failures import RestartReason
from sglang_farm.workers.supervisor import (
    Drain,
    Drained,
    GatewayMembership,
    HealthPassed,
    Launched,
    Note,
    Policy,
    ProcessExited,
    StopRequested,
    Supervisor,
    WorkerState,
    wants_in_gateway,
)
from test_supervisor import gateway_policy, phase


def serving(ids: list[int], policy: Policy | None = None) -> Supervisor:
    """Every worker READY and routed to."""
    sup = Supervisor(ids, policy or gateway_policy())
    sup.start(ids, 0.0)
    for _ in range(len(ids)):
        for w in ids:
            if sup.workers[w].phase is Phase.STARTING:
                sup.handle(w, Launched(pid=1000 + w), 1.0)
                sup.handle(w, HealthPassed(), 1.0)
                sup.handle(w, GatewayMembership(True), 1.0)
    assert all(s.phase is Phase.READY for s in sup.workers.values())
    return sup


def test_a_held_out_worker_is_not_wanted_in_the_gateway_even_when_ready() -> None:
    s = WorkerState(3).enter(Phase.READY, 1.0)
    assert wants_in_gateway(s)
    assert not wants_in_gateway(replace(s, held_out=True))


def test_drain_host_holds_every_worker_out_and_stops_none() -> None:
    sup = serving([0, 1, 2])
    actions = sup.hold_out(True, 5.0)
    assert sup.held_out and sup.held_out_since == 5.0
    assert all(s.held_out for s in sup.workers.values())
    assert all(s.phase is Phase.READY for s in sup.workers.values())  # still running
    assert not [a for a in actions if not isinstance(a, Note)]  # no stop, no drain action
    assert Note("host_held_out", {"workers": [0, 1, 2]}) in actions
    assert not any(wants_in_gateway(s) for s in sup.workers.values())
    # The same again changes nothing and says nothing.
    assert sup.hold_out(True, 6.0) == [] and sup.held_out_since == 5.0


def test_undrain_host_lets_every_ready_worker_back_in() -> None:
    sup = serving([0, 1, 2])
    sup.hold_out(True, 5.0)
    actions = sup.hold_out(False, 9.0)
    assert not sup.held_out and sup.held_out_since is None
    assert all(wants_in_gateway(s) for s in sup.workers.values())
    assert Note("host_back_in", {"workers": [0, 1, 2]}) in actions


def test_a_worker_added_by_a_reload_while_held_out_is_held_out_too() -> None:
    sup = serving([0, 1])
    sup.hold_out(True, 5.0)
    sup.reconfigure(sup.policy, added=[2], removed=[])
    assert sup.workers[2].held_out


def test_a_restart_while_held_out_comes_back_ready_but_stays_out() -> None:
    sup = serving([0, 1])
    sup.hold_out(True, 5.0)
    sup.handle(0, GatewayMembership(False), 5.0)
    # A planned stop drains as before: not in the gateway, so at once to its requests.
    assert Drain(0) in sup.handle(0, StopRequested(), 6.0)
    sup.handle(0, Drained(), 7.0)
    sup.handle(0, ProcessExited(0), 8.0)
    assert phase(sup, 0) is Phase.STOPPED and sup.workers[0].held_out
    sup.start([0], 9.0)
    sup.handle(0, Launched(pid=5), 10.0)
    sup.handle(0, HealthPassed(), 11.0)
    assert phase(sup, 0) is Phase.READY and not wants_in_gateway(sup.workers[0])


def test_a_rolling_restart_while_held_out_does_not_wait_for_the_gateway() -> None:
    """A held-out worker never rejoins: its wave is settled once it is ready again, not
    after the wave budget (the upgrade of a drained host restarts every worker)."""
    p = gateway_policy()
    sup = serving(
        [0, 1, 2],
        Policy(replace(p.startup, parallel=1), p.health, p.restart, drain_timeout=p.drain_timeout),
    )
    sup.hold_out(True, 5.0)
    for w in (0, 1, 2):
        sup.handle(w, GatewayMembership(False), 5.0)
    sup.restart_rolling([0, 1, 2], RestartReason.CONFIG, 6.0)  # wave 1: the canary, 0
    sup.handle(0, Drained(), 6.5)
    sup.handle(0, ProcessExited(0), 7.0)
    sup.handle(0, Launched(pid=9), 7.5)
    actions = sup.handle(0, HealthPassed(), 8.0)
    assert Drain(1) in actions  # the next wave at once, not after the wave budget
    assert phase(sup, 1) is Phase.DRAINING
