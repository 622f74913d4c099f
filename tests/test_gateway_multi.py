"""Several gateways (issue 26, item 1): the farm
over two in-memory gateways (virtual time): every ready worker in each, a planned stop out
of all of them first, each gateway reconciled on its own, a down or hung one holding
nothing on the other. The same over two real smg gateways: tests/test_gateway_multi_e2e.py;
`[gateway] urls` itself: tests/test_mutation_config.py (with the config's other tests);
the admin key's file: tests/test_gateway_keyfile.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agent_harness import GATEWAY, TWO, A, B, farm, farm_toml, urls
from fake_gateway import FakeGateway
from sglang_farm.cli.ctl.status import format_status
from sglang_farm.config import load_spec
from sglang_farm.control.results import endpoints_result, status_result
from sglang_farm.control.settled import settled_result
from sglang_farm.errors import ConfigError, GatewayError, GatewayErrorCode
from sglang_farm.gateway import Member
from sglang_farm.gateway.membership import combined
from sglang_farm.metrics.collectors import MetricsState, build_registry
from sglang_farm.spec import FarmSpec
from sglang_farm.workers.phase import Phase
from virtual_time import run_virtual

HEAD = "[workers]\ngpus = [0, 1]\n[sglang]\nmodel_path = '/models/m'\n[gateway]\n"


def _load(gateway: str) -> FarmSpec:
    return load_spec(HEAD + gateway, source="farm.toml")


def _problems(gateway: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        _load(gateway)
    return list(info.value.problems)


# --- the combined word (pure) ----------------------------------------------------------


def test_joining_needs_every_answering_gateway_and_leaving_needs_none() -> None:
    assert combined(True, [True, True]) is True
    assert combined(True, [True, False]) is False
    assert combined(True, [True, None]) is None  # one has not said yet
    assert combined(True, [False, None]) is False
    assert combined(False, [False, False]) is False
    assert combined(False, [False, True]) is True  # still routed by one: not drained
    assert combined(False, [False, None]) is None
    assert combined(False, [True, None]) is True
    assert combined(True, []) is None and combined(False, []) is None  # none answers


# --- the farm over two gateways (virtual time) -----------------------------------------


def _two() -> tuple[FakeGateway, FakeGateway]:
    a, b = FakeGateway(A), FakeGateway(B)
    b.timeline = a.timeline  # one order of calls for both
    return a, b


def test_every_ready_worker_joins_every_gateway(tmp: Path) -> None:
    a, b = _two()

    async def scenario() -> None:
        async with farm(tmp, text=farm_toml(tmp, gateway=TWO), gateway=a, more_gateways=[b]) as f:
            await f.until(lambda: a.routed() == b.routed() == urls(range(8)))
            await f.until(lambda: all(w.in_gateway for w in f.agent.view().workers), within=1)
            gw = f.agent.view().gateway
            assert gw is not None and gw.up and gw.members == 8
            assert [(g.url, g.up, g.members) for g in gw.each] == [(A, True, 8), (B, True, 8)]
            shown = status_result(f.agent.view(), (), version="t", now=0.0)["gateways"]
            assert isinstance(shown, list)
            assert [(g["url"], g["up"], g["members"]) for g in shown] == [
                (A, True, 8),
                (B, True, 8),
            ]
            assert settled_result(f.agent.view())["settled"] is True
            ends = endpoints_result(f.agent.view())
            assert ends["gateway"] == A and ends["gateways"] == [A, B]
            b.down = True
            await f.until(lambda: not f.agent.view().gateway.each[1].up, within=15)  # type: ignore[union-attr]
            view = f.agent.view()
            registry = build_registry(lambda: MetricsState(snapshot_at=0.0, farm=view), version="t")
            for url, up in ((A, 1), (B, 0)):
                assert registry.get_sample_value("sglang_farm_gateway_up", {"url": url}) == up
                labels = {"url": url}
                assert registry.get_sample_value("sglang_farm_gateway_routed_workers", labels) == 8
            assert registry.get_sample_value("sglang_farm_gateway_members") == 8
            text = format_status(status_result(view, (), version="t", now=0.0))
            assert f"gateway {A} · up · routes to 8 of 8 workers" in text
            assert f"gateway {B} · down · routed to 8 of 8 workers when last confirmed" in text
            (note,) = [line for line in text.splitlines() if "is not answering" in line]
            assert note.startswith(f"gateway {B} is not answering") and "cannot reach it" in note

    run_virtual(scenario())


def test_a_planned_stop_leaves_every_gateway_before_its_requests_are_counted(tmp: Path) -> None:
    a, b = _two()

    async def scenario() -> None:
        async with farm(tmp, text=farm_toml(tmp, gateway=TWO), gateway=a, more_gateways=[b]) as f:
            await f.until(lambda: a.routed() == b.routed() == urls(range(8)))
            b.delay = 3.0  # B takes its time: the drain waits for it
            f.in_flight.counts[2] = 4
            begun = len(f.timeline)
            stopping = asyncio.create_task(f.ops.stop([2]))
            await f.until(lambda: urls([2]).isdisjoint(a.routed() | b.routed()), within=5)
            f.in_flight.counts[2] = 0
            await asyncio.wait_for(stopping, 10)
            url = "http://127.0.0.1:30002"
            seen = [
                e
                for e in f.timeline[begun:]
                if e in (f"gateway remove {url}", "stop 2") or e.startswith("in_flight 2:")
            ]
            # Out of both (B's answer came 3 s later) before a single count, then the stop.
            assert seen[:2] == [f"gateway remove {url}"] * 2, seen
            assert seen[-1] == "stop 2" and f.phase(2) is Phase.STOPPED

    run_virtual(scenario())


def test_a_down_gateway_holds_no_stop_and_is_refilled_when_it_returns(tmp: Path) -> None:
    a, b = _two()

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        async with farm(tmp, text=farm_toml(tmp, gateway=TWO), gateway=a, more_gateways=[b]) as f:
            await f.until(lambda: a.routed() == b.routed() == urls(range(8)))
            b.down = True
            await f.until(lambda: not f.agent.view().gateway.each[1].up, within=15)  # type: ignore[union-attr]
            t0 = loop.time()
            await f.ops.restart([5])
            await f.until(lambda: f.runtime.starts_of(5) == 2 and f.phase(5) is Phase.READY)
            await f.until(lambda: urls([5]) <= a.routed(), within=5)
            assert loop.time() - t0 < 30  # not the 30 s drain budget: B was not waited on
            view = f.agent.view()
            assert view.gateway is not None and view.gateway.up  # A answers
            assert view.worker(5).in_gateway  # in every gateway that answers
            # The farm's work went on; an orchestrator's `farmctl wait` does not: B lacks it.
            settled = settled_result(view)
            assert settled["settled"] is False
            waiting = settled["waiting"]
            assert isinstance(waiting, list)
            assert [(i["kind"], i["message"].split(" (")[0]) for i in waiting] == [
                ("gateway_down", f"the gateway at {B} is not answering")
            ]
            # B restarts empty: its own reconcile refills it, A untouched meanwhile.
            b.members.clear()
            removes = [c for c in a.calls if c[0] == "remove"]
            b.down = False
            await f.until(lambda: b.routed() == urls(range(8)), within=25)
            assert [c for c in a.calls if c[0] == "remove"] == removes

    run_virtual(scenario())


def test_a_gateway_that_never_answers_holds_a_stop_only_for_its_bound(tmp: Path) -> None:
    a, b = _two()

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        text = farm_toml(tmp, gateway={**TWO, "drain_timeout": "5m"})
        async with farm(tmp, text=text, gateway=a, more_gateways=[b]) as f:
            await f.until(lambda: a.routed() == b.routed() == urls(range(8)))
            b.delay = float("inf")  # hangs: no error, no answer
            t0 = loop.time()
            await f.ops.stop([1])
            assert f.phase(1) is Phase.STOPPED
            assert loop.time() - t0 < 60  # its bound (15 s), not the 5 min drain budget
            gw = f.agent.view().gateway
            assert gw is not None and not gw.each[1].up
            assert "no answer within 15 s" in (gw.each[1].last_error or "")

    run_virtual(scenario())


def test_a_rolling_wave_waits_until_every_gateway_routes_to_it(tmp: Path) -> None:
    a, b = _two()

    async def scenario() -> None:
        async with farm(tmp, text=farm_toml(tmp, gateway=TWO), gateway=a, more_gateways=[b]) as f:
            await f.until(lambda: a.routed() == b.routed() == urls(range(8)))
            b.delay = 2.0  # B confirms each add 2 s after A
            broken: list[str] = []

            async def watch() -> None:
                while True:
                    for w in f.agent.view().workers:
                        u = f"http://127.0.0.1:{30000 + w.id}"
                        joined = w.phase is Phase.READY and w.in_gateway
                        if joined and not (u in a.routed() and u in b.routed()):
                            broken.append(f"worker {w.id} in, gateways {a.routed(), b.routed()}")
                    await asyncio.sleep(0.05)

            watcher = asyncio.create_task(watch())
            await f.ops.restart(list(range(8)))
            await f.until(lambda: all(f.runtime.starts_of(w) == 2 for w in range(8)))
            await f.until(lambda: all(w.in_gateway for w in f.agent.view().workers))
            watcher.cancel()
            assert broken == []
            assert a.routed() == b.routed() == urls(range(8))

    run_virtual(scenario())


def test_one_gateway_reads_as_before(tmp: Path) -> None:
    """`url` alone: the status is that gateway's, with no list of gateways beside it."""

    async def scenario() -> None:
        async with farm(tmp, text=farm_toml(tmp, gateway=GATEWAY)) as f:
            await f.until(lambda: f.gateway.routed() == urls(range(8)))
            gw = f.agent.view().gateway
            assert gw is not None and gw.gateways == () and gw.each == (gw,)
            assert gw.url == "http://127.0.0.1:8000"

    run_virtual(scenario())


# --- one worker's refusal is that worker's, not its gateway's (review of issue 26) -----


@pytest.mark.parametrize("code", [GatewayErrorCode.REFUSED, GatewayErrorCode.TIMEOUT])
def test_one_workers_failed_add_leaves_its_gateway_up_and_guarding_every_drain(
    tmp: Path, code: GatewayErrorCode
) -> None:
    """B answers but will not take worker 1 (a 409/500/503, or smg's add timeout for one
    slow worker): B still routes the others, so a stop of worker 2 waits for B's remove,
    and worker 1 is not "in" (a wave must not advance on A's word alone)."""
    a, b = _two()
    u1, u2 = "http://127.0.0.1:30001", "http://127.0.0.1:30002"

    async def scenario() -> None:
        async with farm(tmp, text=farm_toml(tmp, gateway=TWO), gateway=a, more_gateways=[b]) as f:
            await f.until(lambda: a.routed() == b.routed() == urls(range(8)))
            add = b.add

            async def refusing(url: str, *, api_key: str | None = None) -> None:
                if url.rstrip("/") == u1:
                    raise GatewayError(B, code, f"{code} for worker {u1} (test)")
                await add(url, api_key=api_key)

            b.add = refusing  # type: ignore[method-assign]
            await f.ops.restart([1])
            await f.until(lambda: f.runtime.starts_of(1) == 2 and f.phase(1) is Phase.READY)
            await f.until(lambda: u1 in a.routed(), within=5)
            await asyncio.sleep(30)  # B refused it again and again meanwhile
            view = f.agent.view()
            assert view.gateway is not None and view.gateway.each[1].up  # B still answers
            assert not view.worker(1).in_gateway  # B does not route it: not in
            assert settled_result(view)["settled"] is False
            b.delay = 3.0
            begun = len(f.timeline)
            await f.ops.stop([2])
            seen = [e for e in f.timeline[begun:] if e in (f"gateway remove {u2}", "stop 2")]
            assert seen == [f"gateway remove {u2}"] * 2 + ["stop 2"], seen
            assert u2 not in b.routed()

    run_virtual(scenario())


def test_a_refused_remove_holds_the_stop_until_that_gateway_removes_it(tmp: Path) -> None:
    a, b = _two()
    u2 = "http://127.0.0.1:30002"

    async def scenario() -> None:
        text = farm_toml(tmp, gateway={**TWO, "drain_timeout": "5m"})
        async with farm(tmp, text=text, gateway=a, more_gateways=[b]) as f:
            await f.until(lambda: a.routed() == b.routed() == urls(range(8)))
            b.fail_remove.add(u2)
            stopping = asyncio.create_task(f.ops.stop([2]))
            await asyncio.sleep(60)
            assert f.phase(2) is Phase.DRAINING and u2 in b.routed()
            gw = f.agent.view().gateway
            assert gw is not None and gw.each[1].up
            b.fail_remove.clear()
            await asyncio.wait_for(stopping, 60)
            assert f.phase(2) is Phase.STOPPED and u2 not in b.routed()

    run_virtual(scenario())


def test_a_list_answered_late_does_not_undo_a_removal_confirmed_meanwhile(tmp: Path) -> None:
    """B's reconcile lists while worker 3 leaves: the list, asked before the removal and
    answered after it, still shows 3; that stale word must not put 3 back "in" (and set
    off a second removal)."""
    a, b = _two()
    u3 = "http://127.0.0.1:30003"

    async def scenario() -> None:
        async with farm(tmp, text=farm_toml(tmp, gateway=TWO), gateway=a, more_gateways=[b]) as f:
            await f.until(lambda: a.routed() == b.routed() == urls(range(8)))
            listing, answered = asyncio.Event(), asyncio.Event()
            list_now = b.list

            async def late_list() -> list[Member]:
                listing.set()
                seen = await list_now()  # what B routes when asked...
                await asyncio.sleep(4)  # ...answered 4 s later
                answered.set()
                return seen

            b.list = late_list  # type: ignore[method-assign]
            await listing.wait()
            await f.ops.stop([3])  # out of both, confirmed, while the list is under way
            assert u3 not in b.routed()
            await answered.wait()
            await asyncio.sleep(1)
            gw = f.agent.view().gateway
            assert gw is not None and 3 not in (gw.each[1].routed or ())
            assert b.calls.count(("remove", u3)) == 1, b.calls

    run_virtual(scenario())
