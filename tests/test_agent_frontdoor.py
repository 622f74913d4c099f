"""The agent and the gateway: membership follows readiness, planned stops drain (issue 13)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

from agent_harness import GATEWAY, farm, farm_toml, urls
from fake_gateway import FakeGateway
from sglang_farm.cli.ctl.status import _gateway_line
from sglang_farm.config import load_spec
from sglang_farm.control.results import status_result
from sglang_farm.gateway import Member
from sglang_farm.metrics.collectors import MetricsState, build_registry
from sglang_farm.runtime import Running
from sglang_farm.workers.phase import Phase
from virtual_time import run_virtual


def test_gateway_membership_follows_readiness_and_a_crash_leaves_at_once(tmp: Path) -> None:
    async def scenario() -> None:
        async with farm(tmp, text=farm_toml(tmp, gateway=GATEWAY)) as f:
            await f.until(lambda: f.gateway.routed() == urls(range(8)))
            await asyncio.sleep(1)
            assert sorted(f.gateway.calls) == sorted(("add", u) for u in urls(range(8)))
            assert all(w.in_gateway for w in f.agent.view().workers)
            gw = f.agent.view().gateway
            assert gw is not None and gw.up and gw.members == 8
            f.runtime.crash(3, 1)
            # Out of the gateway as soon as the farm saw the exit, before any relaunch.
            await f.until(lambda: urls([3]).isdisjoint(f.gateway.routed()), within=0.5)
            assert f.runtime.starts_of(3) == 1
            await f.until(lambda: f.gateway.routed() == urls(range(8)))
            assert f.runtime.starts_of(3) == 2

    run_virtual(scenario())


def test_planned_stop_leaves_the_gateway_then_waits_for_in_flight_requests(tmp: Path) -> None:
    async def scenario() -> None:
        async with farm(tmp, text=farm_toml(tmp, gateway=GATEWAY)) as f:
            await f.until(lambda: f.gateway.routed() == urls(range(8)))
            f.in_flight.counts[2] = 5
            begun = len(f.timeline)
            stopping = asyncio.create_task(f.ops.stop([2]))
            await f.until(lambda: urls([2]).isdisjoint(f.gateway.routed()), within=1)
            await asyncio.sleep(10)
            # Out of the gateway, its requests still running: not signalled yet.
            assert f.phase(2) is Phase.DRAINING
            assert 2 not in f.runtime.stops
            f.in_flight.counts[2] = 0
            await asyncio.wait_for(stopping, 5)
            assert f.phase(2) is Phase.STOPPED and f.runtime.stops == [2]
            # In this order: out of the gateway, its requests counted until none are left
            # (never before it left), then the stop.
            url = "http://127.0.0.1:30002"
            of_2 = {f"gateway add {url}", f"gateway remove {url}", "stop 2"}
            seen = [e for e in f.timeline[begun:] if e in of_2 or e.startswith("in_flight 2:")]
            assert seen[0] == f"gateway remove {url}", seen
            assert seen[-2:] == ["in_flight 2: 0", "stop 2"], seen
            assert set(seen[1:-2]) == {"in_flight 2: 5"}, seen
            drained = f.agent.view().worker(2).last_drain_seconds
            assert drained is not None and 10 <= drained <= 11

    run_virtual(scenario())


def test_drain_budget_bounds_the_wait_and_no_drain_skips_it(tmp: Path) -> None:
    async def scenario() -> None:
        async with farm(tmp, text=farm_toml(tmp, gateway=GATEWAY)) as f:
            await f.until(lambda: f.gateway.routed() == urls(range(8)))
            loop = asyncio.get_running_loop()
            f.in_flight.counts[4] = 3  # never finishes
            t0 = loop.time()
            await f.ops.stop([4])
            assert f.phase(4) is Phase.STOPPED
            assert 30 <= loop.time() - t0 <= 31  # drain_timeout = 30 s, then the stop
            f.in_flight.counts[5] = 3
            t0 = loop.time()
            await f.ops.stop([5], drain=False)
            assert f.phase(5) is Phase.STOPPED and loop.time() - t0 < 1

    run_virtual(scenario())


def test_restart_all_keeps_workers_minus_parallel_in_the_gateway(tmp: Path) -> None:
    async def scenario() -> None:
        async with farm(tmp, text=farm_toml(tmp, gateway=GATEWAY)) as f:
            await f.until(lambda: f.gateway.routed() == urls(range(8)))
            fewest = [8]
            order: list[int] = []

            async def sample() -> None:
                while True:
                    fewest[0] = min(fewest[0], len(f.gateway.routed()))
                    for w in f.runtime.stops:
                        if w not in order:
                            order.append(w)
                    await asyncio.sleep(0.05)

            sampler = asyncio.create_task(sample())
            await f.ops.restart(list(range(8)))
            await f.until(lambda: all(f.runtime.starts_of(w) == 2 for w in range(8)))
            await f.until(lambda: f.gateway.routed() == urls(range(8)))
            sampler.cancel()
            assert order[0] == 0  # the canary first
            assert fewest[0] == 8 - 3  # parallel = 3: never more out of the gateway

    run_virtual(scenario())


def test_gateway_down_keeps_supervising_and_reconciles_when_back(tmp: Path) -> None:
    other = "http://10.0.0.9:30000"

    async def scenario() -> None:
        gw = FakeGateway(others=[other])
        async with farm(tmp, text=farm_toml(tmp, gateway=GATEWAY), gateway=gw) as f:
            await f.until(lambda: f.gateway.routed() == urls(range(8)) | {other})
            f.gateway.down = True
            f.runtime.crash(6, 1)
            await f.until(lambda: f.runtime.starts_of(6) == 2)
            await f.until(lambda: f.phase(6) is Phase.READY)
            view = f.agent.view()
            assert view.gateway is not None and not view.gateway.up and view.gateway.errors > 0
            # Back, and restarted empty but for the other host's worker: refilled.
            f.gateway.members = {k: v for k, v in f.gateway.members.items() if k == other}
            f.gateway.down = False
            await f.until(lambda: f.gateway.routed() == urls(range(8)) | {other}, within=30)
            view = f.agent.view()
            assert view.gateway is not None and view.gateway.up and view.gateway.members == 8
            assert ("remove", other) not in f.gateway.calls

    run_virtual(scenario())


def test_an_agent_restart_keeps_serving_workers_in_the_gateway(tmp: Path) -> None:
    """The soak's finding: a new agent removed every adopted worker, then added it back,
    and the gateway answered 404 in between. Active units stay routed."""
    running = {w: Running(w, 5000 + w, True) for w in range(8)}
    gw = FakeGateway(others=sorted(urls(range(8))))  # what the previous agent registered

    async def scenario() -> None:
        async with farm(tmp, text=farm_toml(tmp, gateway=GATEWAY), running=running, gateway=gw):
            await asyncio.sleep(30)
            assert not [c for c in gw.calls if c[0] == "remove"], gw.calls
            assert gw.routed() == urls(range(8))

    run_virtual(scenario())


def test_a_gateway_not_up_yet_at_start_is_no_error(tmp: Path) -> None:
    """A managed gateway starts with the agent: calls before it first answers are not
    errors (the demo showed '1 error since the agent started' on every start)."""
    gw = FakeGateway()
    gw.down = True

    async def scenario() -> None:
        async with farm(tmp, text=farm_toml(tmp, gateway=GATEWAY), gateway=gw) as f:
            await asyncio.sleep(3)
            view = f.agent.view()
            assert view.gateway is not None and not view.gateway.up
            assert view.gateway.errors == 0 and view.gateway.last_error is not None
            gw.down = False
            await f.until(lambda: f.gateway.routed() == urls(range(8)), within=120)
            view = f.agent.view()
            assert view.gateway is not None and view.gateway.up and view.gateway.errors == 0

    run_virtual(scenario())


MANAGED = {"mode": "managed", "listen": "127.0.0.1:8000", "drain_timeout": "30s"}


def test_a_managed_gateway_loses_members_the_farm_did_not_add(tmp: Path) -> None:
    """Issue 22 item 3: a managed gateway is the farm's alone. A member someone else
    registered (behind the farm's back, with the key) is removed at the next reconcile,
    and the farm's own workers stay."""
    rogue = "http://127.0.0.1:31500"
    gw = FakeGateway(others=[rogue])

    async def scenario() -> None:
        async with farm(tmp, text=farm_toml(tmp, gateway=MANAGED), gateway=gw) as f:
            await f.until(lambda: f.gateway.routed() == urls(range(8)), within=60)
            assert ("remove", rogue) in f.gateway.calls
            # One planted while the farm runs: gone within one reconcile period.
            gw.members[rogue] = Member(url=rogue, id="planted", status="ready")
            await f.until(lambda: rogue not in f.gateway.routed(), within=11)
            await asyncio.sleep(15)
            assert f.gateway.routed() == urls(range(8))
            view = f.agent.view()
            assert view.gateway is not None and view.gateway.foreign == ()

    run_virtual(scenario())


def test_an_external_gateways_foreign_members_are_shown_not_removed(tmp: Path) -> None:
    """Issue 22 item 3: an external gateway is shared; another host's worker is left in
    it, and status (text and --json) and the metrics name it."""
    other = "http://10.0.0.9:30000"
    gw = FakeGateway(others=[other])

    async def scenario() -> None:
        async with farm(tmp, text=farm_toml(tmp, gateway=GATEWAY), gateway=gw) as f:
            await f.until(lambda: f.gateway.routed() == urls(range(8)) | {other})
            await asyncio.sleep(25)  # two reconciles
            assert ("remove", other) not in f.gateway.calls
            view = f.agent.view()
            assert view.gateway is not None and view.gateway.foreign == (other,)
            result = status_result(view, [], version="t", now=0.0)
            gateway = result["gateway"]
            assert isinstance(gateway, dict) and gateway["foreign"] == [other]
            assert f"1 member not of this farm: {other}" in _gateway_line(gateway, 8)
            registry = build_registry(lambda: MetricsState(snapshot_at=0.0, farm=view), version="t")
            assert registry.get_sample_value("sglang_farm_gateway_foreign_members") == 1

    run_virtual(scenario())


def test_a_reload_adding_api_key_brings_every_worker_back_with_its_key(tmp: Path) -> None:
    """Issue 22 item 8: the key the gateway presents to a worker follows reloads. Each
    worker restarts with the new key and is added back with it (per-worker keys too);
    before, the gateway kept the key read at agent start and smg never took them back."""
    new = [
        farm_toml(tmp, gateway=GATEWAY, sglang={"api_key": "k-farm"})
        + '\n[workers.overrides.5]\nsglang = { api_key = "k-five" }\n'
    ]

    async def scenario() -> None:
        loader = lambda: load_spec(new[0], source="test.toml")  # noqa: E731 -- one-liner
        async with farm(tmp, text=farm_toml(tmp, gateway=GATEWAY), loader=loader) as f:
            await f.until(lambda: f.gateway.routed() == urls(range(8)))
            assert set(f.gateway.keys.values()) == {None}
            result = await f.ops.reload()
            assert result.applied and result.restarted == tuple(range(8))
            await f.until(lambda: all(f.runtime.starts_of(w) == 2 for w in range(8)))
            await f.until(lambda: f.gateway.routed() == urls(range(8)))
            want = {u: "k-farm" for u in urls(range(8))} | {"http://127.0.0.1:30005": "k-five"}
            assert f.gateway.keys == want

    run_virtual(scenario())


def test_a_gateway_that_never_comes_up_is_said_once_not_on_every_retry(tmp: Path) -> None:
    """smg not installed: the gateway never answers. The agent said so 160+ times in two
    minutes (gateway_change_failed per worker per retry, gateway_reconcile_failed every
    10 s); it says it once (issue 22 item 10), and keeps retrying quietly."""
    from structlog.testing import capture_logs

    gw = FakeGateway()
    gw.down = True

    async def scenario() -> None:
        async with farm(tmp, text=farm_toml(tmp, gateway=GATEWAY), gateway=gw) as f:
            await asyncio.sleep(120)
            view = f.agent.view()
            assert view.gateway is not None and not view.gateway.up

    with capture_logs() as logs:
        run_virtual(scenario())
    said = [
        e["event"]
        for e in logs
        if e["event"].startswith("gateway") and e["log_level"] in ("warning", "error", "info")
    ]
    assert said.count("gateway_not_reached_yet") == 1
    assert [e for e in said if e != "gateway_not_reached_yet"] == []


def test_the_rollouts_end_names_the_farm_its_front_door_and_what_to_try(tmp: Path) -> None:
    """A new user's terminal had no plain "ready" line: the rollout's end says the farm,
    N/N ready, the one URL users call, and the farmctl command for this config."""
    from structlog.testing import capture_logs

    gw = FakeGateway()

    async def scenario() -> None:
        async with farm(tmp, text=farm_toml(tmp, gateway=GATEWAY), gateway=gw) as f:
            await f.until(lambda: f.agent.view().ready_count == 8)
            await asyncio.sleep(1)

    with capture_logs() as logs:
        run_virtual(scenario())
    (done,) = [e for e in logs if e["event"] == "rollout_done"]
    assert (done["ready"], done["workers"], done["front_door"]) == (8, 8, gw.url)
    # farmctl as typed here: on the PATH, or the agent's own (.venv/bin/farmctl) (issue 31)
    assert done["next"].endswith("farmctl --config test.toml status")
    want = f"{done['farm']}: 8/8 ready and routed · front door {gw.url} · try: {done['next']}"
    assert done["summary"] == want


def test_a_refused_removal_of_a_foreign_member_leaves_the_managed_gateway_up(tmp: Path) -> None:
    """Issue 26 review: the gateway answered (it refused to remove that one member), so
    it is not down, and it keeps guarding the farm's drains."""
    rogue = "http://127.0.0.1:31500"
    gw = FakeGateway(others=[rogue])
    gw.fail_remove.add(rogue)

    async def scenario() -> None:
        async with farm(tmp, text=farm_toml(tmp, gateway=MANAGED), gateway=gw) as f:
            await f.until(lambda: f.gateway.routed() >= urls(range(8)), within=60)
            await f.until(lambda: ("remove", rogue) in f.gateway.calls, within=15)
            await asyncio.sleep(25)  # two more reconciles, each refused again
            view = f.agent.view()
            assert view.gateway is not None and view.gateway.up
            assert view.gateway.foreign == (rogue,)

    run_virtual(scenario())


def test_status_names_a_worker_the_gateway_passes_over_for_overload(tmp: Path) -> None:
    """Issue 34 §3: smg's overload protection leaves a worker out of routing while it
    still lists it ready, so the farm counts it in the gateway; status says which worker
    smg passes over and why (its queue against [gateway] overload_waiting_requests), and
    stops saying so once its queue is short again."""
    gw = FakeGateway()

    async def scenario() -> None:
        async with farm(tmp, text=farm_toml(tmp, gateway=GATEWAY), gateway=gw) as f:
            await f.until(lambda: f.gateway.routed() == urls(range(8)))
            (u3,) = urls([3])
            gw.members[u3] = replace(gw.members[u3], waiting=12, token_usage=0.25)
            await asyncio.sleep(25)  # two reconciles
            view = f.agent.view()
            reason = "12 requests waiting (overload_waiting_requests 8)"
            assert view.gateway is not None and view.gateway.overloaded == ((3, reason),)
            assert next(w for w in view.workers if w.id == 3).in_gateway
            gateway = status_result(view, [], version="t", now=0.0)["gateway"]
            assert isinstance(gateway, dict)
            assert gateway["overloaded"] == [{"worker": 3, "reason": reason}]
            assert f"worker 3 overloaded ({reason})" in _gateway_line(gateway, 8)
            registry = build_registry(lambda: MetricsState(snapshot_at=0.0, farm=view), version="t")
            assert registry.get_sample_value("sglang_farm_gateway_overloaded_workers") == 1
            gw.members[u3] = replace(gw.members[u3], waiting=0, token_usage=0.85)
            await asyncio.sleep(25)
            view = f.agent.view()
            assert view.gateway is not None
            assert view.gateway.overloaded == ((3, "KV cache 85% used (overload_token_usage 0.8)"),)
            gw.members[u3] = replace(gw.members[u3], waiting=1, token_usage=0.5)
            await asyncio.sleep(25)
            view = f.agent.view()
            assert view.gateway is not None and view.gateway.overloaded == ()
            line = _gateway_line(status_result(view, [], version="t", now=0.0)["gateway"], 8)  # type: ignore[arg-type]
            assert "overloaded" not in line

    run_virtual(scenario())
