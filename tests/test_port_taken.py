"""A squatted worker port (issue 22 §4): the supervisor's rule, and the agent's watcher over fakes.

Another process listening on a worker's port is never the worker: its answers never make
the worker ready, and the worker is stopped with the failure `port_taken` naming it. The
end-to-end test with a real squatter run as nobody is in test_port_squat.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agent_harness import GATEWAY, farm, farm_toml, urls
from sglang_farm.sglang.failures import FailureKind
from sglang_farm.spec import HealthPolicy, RestartPolicy, StartupPolicy
from sglang_farm.workers.phase import Phase
from sglang_farm.workers.supervisor import (
    HealthPassed,
    Launched,
    Policy,
    PortTaken,
    ProcessExited,
    StopIntent,
    Supervisor,
    Terminate,
    WorkerState,
    step,
    wants_in_gateway,
)
from virtual_time import run_virtual

HOLDER = "PID 4242 (user nobody)"


def policy() -> Policy:
    return Policy(
        StartupPolicy(canary=0, parallel=2, load_timeout=100.0),
        HealthPolicy(period=1.0, timeout=1.0, failure_threshold=3),
        RestartPolicy(backoff_initial=1.0, backoff_max=8.0, reset_after=50.0, max_failures=3),
    )


def test_port_taken_while_loading_stops_the_worker_as_port_taken_never_ready() -> None:
    s = WorkerState(3, Phase.STARTING, since=0.0, pid=77, launched_at=0.0)
    d = step(s, PortTaken(30003, HOLDER), 5.0, policy())
    assert d.state.phase is Phase.STOPPING
    assert d.state.stop_intent is StopIntent.FAILURE
    assert Terminate(3) in d.actions
    assert not wants_in_gateway(d.state)
    done = step(d.state, ProcessExited(-15), 6.0, policy()).state
    failure = done.last_failure
    assert failure is not None and failure.kind is FailureKind.PORT_TAKEN
    assert failure.summary == "port 30003 is held by PID 4242 (user nobody), not by worker 3"
    assert "stop that process" in failure.advice and "base_port" in failure.advice
    assert not done.ever_ready
    # Not a deterministic failure: the squatter may go; the worker is tried again later.
    assert done.phase is Phase.BACKOFF


def test_port_taken_while_serving_takes_the_worker_out_and_stops_it() -> None:
    s = WorkerState(3, Phase.READY, since=0.0, pid=77, launched_at=0.0, ever_ready=True)
    d = step(s, PortTaken(30003, HOLDER), 5.0, policy())
    assert d.state.phase is Phase.STOPPING and Terminate(3) in d.actions
    assert not wants_in_gateway(d.state)
    assert d.state.pending_failure is not None
    assert d.state.pending_failure.kind is FailureKind.PORT_TAKEN


@pytest.mark.parametrize(
    "phase", [Phase.STOPPED, Phase.PENDING, Phase.BACKOFF, Phase.STOPPING, Phase.FAILED]
)
def test_port_taken_about_a_worker_not_running_changes_nothing(phase: Phase) -> None:
    s = WorkerState(3, phase, since=0.0)
    d = step(s, PortTaken(30003, HOLDER), 5.0, policy())
    assert d.state == s and d.actions == ()


def test_supervisor_a_canary_whose_port_is_taken_is_never_ready() -> None:
    sup = Supervisor(range(2), policy())
    sup.start([0, 1], 0.0)
    sup.handle(0, Launched(pid=100), 0.0)
    actions = sup.handle(0, PortTaken(30000, HOLDER), 1.0)
    assert Terminate(0) in actions
    sup.handle(0, ProcessExited(-15), 2.0)
    s = sup.workers[0]
    assert s.phase is not Phase.READY and not s.ever_ready
    assert s.last_failure is not None and s.last_failure.kind is FailureKind.PORT_TAKEN
    # A late HealthPassed (a probe that was in flight) cannot make it ready now.
    sup.handle(0, HealthPassed(), 2.5)
    assert sup.workers[0].phase is not Phase.READY


# ---- the agent's watcher, over the fakes (virtual time) --------------------------------


def test_agent_never_makes_a_worker_ready_on_a_squatters_answers(tmp: Path) -> None:
    async def scenario() -> None:
        async with farm(tmp, text=farm_toml(tmp, gateway=GATEWAY)) as f:
            await f.until(lambda: f.gateway.routed() == urls(range(8)))
            f.ports.squat(30003)
            ready_again: list[float] = []
            routed_3: list[float] = []

            async def watch() -> None:
                while True:
                    if f.phase(3) is Phase.READY:
                        ready_again.append(asyncio.get_running_loop().time())
                    if urls([3]) & f.gateway.routed():
                        routed_3.append(asyncio.get_running_loop().time())
                    await asyncio.sleep(0.1)

            await f.ops.restart([3])
            await f.until(lambda: f.phase(3) is not Phase.READY, within=60)
            watcher = asyncio.create_task(watch())
            await f.until(
                lambda: (
                    (lf := f.agent.view().worker(3).last_failure) is not None
                    and lf.kind is FailureKind.PORT_TAKEN
                ),
                within=120,
            )
            await asyncio.sleep(120)  # farm time: back-offs and relaunches, all squatted
            watcher.cancel()
            assert f.ports.squatter_probes > 0  # the squatter did answer /health
            assert ready_again == [] and routed_3 == []
            lf = f.agent.view().worker(3).last_failure
            assert lf is not None
            assert lf.summary == "port 30003 is held by PID 4242 (user nobody), not by worker 3"
            # The rest of the farm kept serving.
            assert f.gateway.routed() == urls([0, 1, 2, 4, 5, 6, 7])

    run_virtual(scenario())


def test_agent_a_ready_worker_whose_listener_turns_foreign_is_stopped(tmp: Path) -> None:
    async def scenario() -> None:
        async with farm(tmp, text=farm_toml(tmp, gateway=GATEWAY)) as f:
            await f.until(lambda: f.gateway.routed() == urls(range(8)))
            before = f.runtime.starts_of(5)
            f.ports.squat(30005, pid=777, user="mallory")
            await f.until(lambda: urls([5]).isdisjoint(f.gateway.routed()), within=10)
            await f.until(lambda: f.runtime.starts_of(5) > before, within=60)
            lf = f.agent.view().worker(5).last_failure
            assert lf is not None and lf.kind is FailureKind.PORT_TAKEN
            assert "PID 777 (user mallory)" in lf.summary
            # The squatter leaves: the worker comes back as itself.
            del f.ports.squatters[30005]
            await f.until(lambda: f.gateway.routed() == urls(range(8)), within=120)

    run_virtual(scenario())


def test_agent_a_listener_no_process_holds_keeps_the_worker_loading(tmp: Path) -> None:
    async def scenario() -> None:
        async with farm(tmp) as f:
            f.ports.unseen.add(30000)  # the canary's port: what answers there is unproven
            await asyncio.sleep(60)  # farm time: the fake "loads" in 10 s
            assert f.phase(0) is Phase.STARTING
            assert f.agent.view().worker(0).last_failure is None
            f.ports.unseen.clear()  # now its own socket is seen
            await f.until(lambda: f.phase(0) is Phase.READY, within=5)

    run_virtual(scenario())


def test_port_blocks_for_tests_miss_the_ephemeral_range_and_the_demos_ports() -> None:
    """The suite's farms take their ports outside the ephemeral range: a busy machine's
    TIME-WAIT connections (thousands) cannot exhaust them (issue 32 §4.7)."""
    from farmproc import free_port_block, port_candidates

    eph = range(32768, 61000)
    for base in port_candidates(16, eph):
        block = range(base, base + 16)
        assert not (block.start < eph.stop and eph.start < block.stop), base
        assert not (block.start < 31100 and block.stop > 8000), base
    narrow = port_candidates(16, range(1024, 65001))  # an ephemeral range of every port
    assert narrow == []
    base = free_port_block(16)
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        lo, hi = (int(x) for x in f.read().split())
    assert not (base < hi + 1 and lo < base + 16)


def test_agent_why_names_the_squatter_while_the_launch_waits_for_the_port(tmp: Path) -> None:
    """Issue 30, item 12: a squatter binds worker 3's port the moment a restart frees it.
    The launch waits for the port (up to `PORT_FREE_WAIT_S`: SGLang's teardown frees it
    within seconds); meanwhile `why 3` said `no failure recorded`. It names the holder
    (`port_taken`) from `PORT_NAMED_AFTER_S` on, while the worker waits unstarted."""
    from sglang_farm.control.results import why_result
    from sglang_farm.host.ports import PortState
    from sglang_farm.workers.launcher import PORT_FREE_WAIT_S

    taken: set[int] = set()  # bound by the squatter (its owner shows once `squat` says)

    def port_state(_host: str, port: int) -> PortState:
        return PortState.IN_USE if port in taken else PortState.FREE

    async def scenario() -> None:
        async with farm(tmp, text=farm_toml(tmp, gateway=GATEWAY), port_state=port_state) as f:
            await f.until(lambda: f.gateway.routed() == urls(range(8)))
            starts = f.runtime.starts_of(3)
            await f.ops.restart([3])
            taken.add(30003)  # the moment the old process lets go of it
            await f.until(lambda: f.phase(3) is Phase.STARTING, within=60)
            f.ports.squat(30003)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            await f.until(
                lambda: (
                    (lf := f.agent.view().worker(3).last_failure) is not None
                    and lf.kind is FailureKind.PORT_TAKEN
                ),
                within=PORT_FREE_WAIT_S / 2,
            )
            assert loop.time() - t0 < PORT_FREE_WAIT_S  # named before the launch gave up
            why = why_result(f.agent.view().worker(3))
            assert why["state"] == "starting"
            failure = why["last_failure"]
            assert isinstance(failure, dict) and failure["kind"] == "port_taken"
            assert failure["summary"].startswith(f"port 30003 is held by {HOLDER}, not by worker 3")
            assert f.runtime.starts_of(3) == starts  # never started on the squatted port
            taken.clear()  # it leaves: the worker starts and serves
            del f.ports.squatters[30003]
            await f.until(lambda: f.gateway.routed() == urls(range(8)), within=120)

    run_virtual(scenario())
