"""The agent drains its whole host out of the gateway (issue 26 item 2): farmctl
drain-host / undrain-host on the real Agent over the fakes, on the virtual clock."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from agent_harness import GATEWAY, farm, farm_toml, urls
from fake_gateway import FakeGateway
from sglang_farm.control.results import status_result
from sglang_farm.control.settled import settled_result
from sglang_farm.runtime import Running
from sglang_farm.workers.phase import Phase
from virtual_time import run_virtual


def test_drain_host_empties_the_gateway_waits_for_requests_and_stops_nothing(tmp: Path) -> None:
    async def scenario() -> None:
        async with farm(tmp, text=farm_toml(tmp, gateway=GATEWAY)) as f:
            await f.until(lambda: f.gateway.routed() == urls(range(8)))
            assert settled_result(f.agent.view())["settled"] is True
            f.in_flight.counts[2] = 4
            f.in_flight.counts[5] = 1
            begun = len(f.timeline)
            draining = asyncio.create_task(f.ops.drain_host(None))
            await f.until(lambda: not f.gateway.routed(), within=1)
            await asyncio.sleep(8)
            assert not draining.done()  # workers 2 and 5 still run requests
            f.in_flight.counts[5] = 0
            await asyncio.sleep(3)
            assert not draining.done()
            f.in_flight.counts[2] = 0
            r = await asyncio.wait_for(draining, 5)
            assert r.workers == tuple(range(8)) and r.drained == tuple(range(8))
            assert r.left == {} and 11 <= r.waited_s <= 12
            # Every worker still runs: nothing stopped, nothing restarted.
            assert f.all_ready() and f.runtime.stops == []
            assert all(f.runtime.starts_of(w) == 1 for w in range(8))
            # A worker's requests are counted only once it is out of the gateway.
            url2 = "http://127.0.0.1:30002"
            seen = [
                e
                for e in f.timeline[begun:]
                if e == f"gateway remove {url2}" or e.startswith("in_flight 2:")
            ]
            assert seen[0] == f"gateway remove {url2}" and seen[-1] == "in_flight 2: 0", seen
            view = f.agent.view()
            assert view.held_out_since is not None
            assert settled_result(view)["state"] == "failed"  # held out: not settled
            # A restart while drained comes back ready and stays out of the gateway.
            await f.ops.restart([3])
            await f.until(lambda: f.runtime.starts_of(3) == 2 and f.phase(3) is Phase.READY)
            await asyncio.sleep(15)  # reconciles come and go
            assert not f.gateway.routed()
            # undrain-host: every ready worker back in, nothing restarted.
            assert await f.ops.undrain_host() == tuple(range(8))
            await f.until(lambda: f.gateway.routed() == urls(range(8)), within=2)
            assert f.runtime.stops == [3] and f.agent.view().held_out_since is None
            assert settled_result(f.agent.view())["settled"] is True

    run_virtual(scenario())


def test_a_drain_whose_budget_runs_out_says_what_is_left_and_keeps_the_host_out(
    tmp: Path,
) -> None:
    async def scenario() -> None:
        async with farm(tmp, text=farm_toml(tmp, gateway=GATEWAY)) as f:
            await f.until(lambda: f.gateway.routed() == urls(range(8)))
            f.in_flight.counts[6] = 2  # never finishes
            r = await f.ops.drain_host(20.0)
            assert r.left == {6: 2} and 6 not in r.drained and len(r.drained) == 7
            assert 20 <= r.waited_s <= 21
            assert not f.gateway.routed() and f.all_ready()

    run_virtual(scenario())


def test_a_drained_host_stays_out_of_the_gateway_across_an_agent_restart(tmp: Path) -> None:
    """The upgrade's agent restart must not put the host back by itself."""
    text = farm_toml(tmp, gateway=GATEWAY)

    async def first() -> None:
        async with farm(tmp, text=text) as f:
            await f.until(lambda: f.gateway.routed() == urls(range(8)))
            await f.ops.drain_host(None)
            assert not f.gateway.routed()

    run_virtual(first())
    assert json.loads((tmp / "state.json").read_text())["host"]["held_out_since"] is not None
    running = {w: Running(w, 5000 + w, True) for w in range(8)}
    gw = FakeGateway()

    async def second() -> None:
        async with farm(tmp, text=text, running=running, gateway=gw) as f:
            await asyncio.sleep(30)  # several reconciles
            assert f.all_ready() and not gw.routed()
            assert f.agent.view().held_out_since is not None
            await f.ops.undrain_host()
            await f.until(lambda: gw.routed() == urls(range(8)), within=2)

    run_virtual(second())


def test_a_reload_on_a_drained_host_judges_its_canary_only_once_it_is_back_in(
    tmp: Path,
) -> None:
    """The upgrade's reload while drained: the canary restarts on the change, ready and
    out of the gateway; its window waits for undrain-host (a canary without traffic cannot
    be judged), then the verdict, then the waves; farmctl wait's rule follows it."""
    from canary_farm import WINDOW, Metrics, _start
    from sglang_farm.canary.view import CanaryState
    from sglang_farm.config import load_spec

    def text(env: dict[str, str] | None = None) -> str:
        farm_t = {"state_dir": str(tmp), **({"env": env} if env else {})}
        return farm_toml(tmp, workers=4, gateway=GATEWAY, rollout=WINDOW, farm=farm_t)

    new = text({"HARMLESS": "1"})
    m = Metrics()

    async def scenario() -> None:
        async with farm(
            tmp, text=text(), loader=lambda: load_spec(new, source="test.toml"), scrape=m
        ) as f:
            await _start(f, m)
            await f.until(lambda: f.gateway.routed() == urls(range(4)))
            await f.ops.drain_host(None)
            result = await f.ops.reload()
            assert result.applied and result.restarted == (0, 1, 2, 3)
            await f.until(lambda: f.runtime.starts_of(0) == 2 and f.phase(0) is Phase.READY)
            await asyncio.sleep(120)  # twice the window: nothing judged while out
            view = f.agent.view()
            assert view.canary is not None and view.canary.state is CanaryState.ANALYSING
            assert view.canary.ends_at is None  # the window has not started
            assert [f.runtime.starts_of(w) for w in (1, 2, 3)] == [1, 1, 1]
            assert not f.gateway.routed()
            await f.ops.undrain_host()
            await f.until(lambda: all(f.runtime.starts_of(w) == 2 for w in range(4)), within=300)
            await f.until(lambda: settled_result(f.agent.view())["settled"] is True, within=300)
            cv = f.agent.view().canary
            assert cv is not None and cv.state is CanaryState.PROMOTED
            assert f.gateway.routed() == urls(range(4))

    run_virtual(scenario())


def test_a_drain_past_a_frozen_gateway_names_it_as_unconfirmed(tmp: Path) -> None:
    """Issue 30 item 11: of two gateways, one freezes (its calls never answer): the drain
    goes on without it once its calls time out, but the result names it with every
    worker it never confirmed out, and the one that answered is not named."""
    from agent_harness import TWO, A, B

    async def scenario() -> None:
        a, b = FakeGateway(A), FakeGateway(B)
        async with farm(tmp, text=farm_toml(tmp, gateway=TWO), gateway=a, more_gateways=[b]) as f:
            await f.until(lambda: a.routed() == urls(range(8)) and b.routed() == urls(range(8)))
            b.delay = float("inf")  # frozen: SIGSTOPped smg
            r = await f.ops.drain_host(60.0)
            assert not a.routed() and b.routed() == urls(range(8))
            assert r.left == {}
            assert r.unconfirmed == {B: tuple(range(8))}
            assert f.all_ready()

    run_virtual(scenario())


def test_a_worker_the_gateway_holds_but_does_not_route_is_not_confirmed_out(tmp: Path) -> None:
    """CI's flake of `test_hostdrain_frozen` (stop 36): smg's health check failed worker 1
    for a moment, the farm's list saw it held but not routed, and a drain past the frozen
    gateway then named only worker 0, as though a gateway that still holds worker 1 (and
    routes to it again once its health check passes) had confirmed it out. Out of a gateway
    is not held by it: only a confirmed remove, or a list without it, says so."""
    from sglang_farm.gateway.port import Member

    async def scenario() -> None:
        gw = FakeGateway()
        async with farm(tmp, text=farm_toml(tmp, gateway=GATEWAY), gateway=gw) as f:
            await f.until(lambda: gw.routed() == urls(range(8)))
            (u1,) = urls([1])
            gw.members[u1] = Member(url=u1, id="fake-unhealthy", status="unhealthy")
            gw.fail_add.add(u1)  # smg's add waits for routed: not confirmed while unhealthy
            await asyncio.sleep(25)  # a reconcile lists it held, not routed
            gw.delay = float("inf")  # then frozen: SIGSTOPped smg
            r = await f.ops.drain_host(60.0)
            assert r.unconfirmed == {gw.url: tuple(range(8))}

    run_virtual(scenario())


def test_a_worker_whose_add_was_sent_but_not_answered_is_not_confirmed_out(tmp: Path) -> None:
    """CI's flake of `test_hostdrain_frozen` (stop 38): smg routed worker 1 before its
    answer to the farm's add came back, the test froze it then, and a drain past the
    frozen gateway named only worker 0: the farm's start-up list, older than the add,
    said the gateway did not hold worker 1. From the moment an add is sent, the gateway
    may hold the worker: only a confirmed remove, or a list asked after the add, says out."""

    async def scenario() -> None:
        gw = FakeGateway()
        (u1,) = urls([1])
        gw.hang_add.add(u1)
        async with farm(tmp, text=farm_toml(tmp, gateway=GATEWAY), gateway=gw) as f:
            await f.until(lambda: gw.routed() == urls(range(8)))
            await asyncio.sleep(20)  # reconciles come and go; worker 1's add never answers
            gw.delay = float("inf")  # then frozen: SIGSTOPped smg
            r = await f.ops.drain_host(60.0)
            assert r.unconfirmed == {gw.url: tuple(range(8))}

    run_virtual(scenario())


def test_a_drain_survives_a_state_file_cut_in_half_across_an_agent_restart(tmp: Path) -> None:
    """Issue 30 item 9: drain-host, the agent killed, state.json cut in half, start: the
    hold was dropped (`state_unreadable`) and the gateway routed all 8 again. Its second
    copy keeps the hold, and status says what was found."""
    text = farm_toml(tmp, gateway=GATEWAY)

    async def first() -> None:
        async with farm(tmp, text=text) as f:
            await f.until(lambda: f.gateway.routed() == urls(range(8)))
            await f.ops.drain_host(None)

    run_virtual(first())
    path = tmp / "state.json"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    running = {w: Running(w, 5000 + w, True) for w in range(8)}
    gw = FakeGateway()

    async def second() -> None:
        async with farm(tmp, text=text, running=running, gateway=gw) as f:
            await asyncio.sleep(30)  # several reconciles
            assert f.all_ready() and not gw.routed()
            view = f.agent.view()
            assert view.held_out_since is not None
            (alert,) = [a for a in view.state_alerts if a.file == str(path)]
            assert alert.kind == "unreadable" and "state.json.copy" in alert.then
            assert "state_alerts" in status_result(view, (), version="t", now=2e9)

    run_virtual(second())


def test_drain_host_on_a_full_state_dir_fails_with_the_reason_and_status_says_so(
    tmp: Path,
) -> None:
    """Issue 30 item 5: on a full state_dir, drain-host answered "host drained" while
    state.json kept no hold (an agent restart would have put the host back). It now
    fails naming the file and why; status and the metrics say the state is not saved."""
    from fulldisk import fill, small_tmpfs
    from sglang_farm.cli.ctl.status import format_status
    from sglang_farm.errors import FarmError

    with small_tmpfs(tmp / "state") as state_dir:
        text = farm_toml(state_dir, gateway=GATEWAY)

        async def scenario() -> None:
            async with farm(state_dir, text=text) as f:
                await f.until(lambda: f.gateway.routed() == urls(range(8)))
                filler = fill(state_dir)
                try:
                    await f.ops.drain_host(None)
                except FarmError as exc:  # state.StateNotSaved: farmctl's `failed`, exit 1
                    message = str(exc)
                else:
                    raise AssertionError("drain-host answered as if its hold were saved")
                assert str(state_dir / "state.json") in message
                assert "No space left on device" in message and "agent restart" in message
                view = f.agent.view()
                assert view.held_out_since is not None  # in force, only not saved
                (alert,) = [a for a in view.state_alerts if a.kind == "not_saved"]
                assert alert.file == str(state_dir / "state.json")
                assert "STATE NOT SAVED" in format_status(
                    status_result(view, (), version="t", now=2e9)
                )
                assert view.state_save_failures >= 1
                # A stop the agent restart would undo says so too.
                try:
                    await f.ops.stop([3])
                except FarmError as exc:
                    assert "worker(s) 3 stopped, but it is not saved" in str(exc)
                else:
                    raise AssertionError("stop answered as if it were saved")
                filler.unlink()
                await f.ops.undrain_host()
                assert not [a for a in f.agent.view().state_alerts if a.kind == "not_saved"]

        run_virtual(scenario())
