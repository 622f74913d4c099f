"""The real Agent driven by a fake runtime, a fake prober and a virtual clock.

No processes, no sockets, no real sleeps: every test runs a whole scenario (minutes of
farm time) in milliseconds, through the same event pump, supervisor and launcher as
production.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from fake_gateway import FakeGateway
from fake_runtime import FakeInFlight, FakeProber, FakeRuntime
from sglang_farm.agent import Agent, AgentHooks
from sglang_farm.config import load_spec
from sglang_farm.failures import Failure, FailureKind
from sglang_farm.launcher import Preflight
from sglang_farm.phase import Phase
from sglang_farm.ports import PortState
from sglang_farm.runtime import Emit, Running
from sglang_farm.spec import FarmSpec
from virtual_time import run_virtual

OOM_LINE = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
    "total capacity of 79.11 GiB of which 1.00 GiB is free."
)
READY_LINE = "The server is fired up and ready to roll!"


def farm_toml(state_dir: Path, *, extra: str = "", sglang: str = "", workers: int = 8) -> str:
    return f"""
[farm]
name = "test-farm"
python = "{sys.executable}"
module = "sglang_farm.sim"
state_dir = "{state_dir}"

[workers]
gpus = {list(range(workers))}
host = "127.0.0.1"
base_port = 30000

[startup]
canary = 0
parallel = 3
load_timeout = "2m"
poll_interval = "500ms"

[health]
period = "2s"
timeout = "5s"
failure_threshold = 3

[restart]
backoff_initial = "1s"
backoff_max = "30s"
reset_after = "1m"
stop_timeout = "10s"

[metrics]
gpu_source = "none"

[control]
socket = "{state_dir}/control.sock"

[sglang]
model_path = "sim/model"
mem_fraction_static = 0.8
{sglang}
{extra}
"""


@dataclass
class Farm:
    agent: Agent
    runtime: FakeRuntime
    prober: FakeProber
    stop: asyncio.Event
    gateway: FakeGateway
    in_flight: FakeInFlight

    def phases(self) -> dict[int, Phase]:
        return {w.id: w.phase for w in self.agent.view().workers}

    def phase(self, worker: int) -> Phase:
        return self.agent.view().worker(worker).phase

    async def until(self, cond: Callable[[], bool], within: float = 600.0) -> None:
        """Wait (in farm time) until `cond` holds; fail the test past `within` seconds."""
        loop = asyncio.get_running_loop()
        end = loop.time() + within
        while not cond():
            if loop.time() > end:
                raise AssertionError(f"not within {within} s of farm time: {self.phases()}")
            await asyncio.sleep(0.1)

    def all_ready(self) -> bool:
        return all(p is Phase.READY for p in self.phases().values())


@asynccontextmanager
async def farm(
    tmp: Path,
    *,
    text: str | None = None,
    running: dict[int, Running] | None = None,
    loader: Callable[[], FarmSpec] | None = None,
    gateway: FakeGateway | None = None,
    preflight: Preflight | None = None,
    refresh: Callable[[FarmSpec], Awaitable[None]] | None = None,
) -> AsyncIterator[Farm]:
    loop = asyncio.get_running_loop()
    spec = load_spec(text or farm_toml(tmp), source="test.toml")
    gw = gateway or FakeGateway()
    in_flight = FakeInFlight()
    prober = FakeProber(spec)
    made: list[FakeRuntime] = []

    def factory(emit: Emit) -> FakeRuntime:
        rt = FakeRuntime(emit, running_at_start=running or {})
        prober.runtime = rt
        made.append(rt)
        return rt

    agent = Agent(
        spec,
        factory,
        config_loader=loader,
        clock=loop.time,
        wall=lambda: 1.8e9 + loop.time(),
        hooks=AgentHooks(
            prober=prober,
            port_state=lambda _h, _p: PortState.FREE,
            gateway=gw if spec.gateway.enabled else None,
            in_flight=in_flight,
            preflight=preflight,
            refresh_preflight=refresh,
        ),
    )
    stop = asyncio.Event()
    f = Farm(agent, made[0], prober, stop, gw, in_flight)

    task = asyncio.create_task(agent.run(stop))
    try:
        yield f
    finally:
        stop.set()
        await asyncio.wait_for(task, 120)


@pytest.fixture
def tmp(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path


def test_rollout_canary_first_then_waves_of_parallel_and_views_carry_argv(tmp: Path) -> None:
    async def scenario() -> None:
        async with farm(tmp) as f:
            await f.until(lambda: f.runtime.starts != [])
            # Only the canary loads until it is ready.
            await asyncio.sleep(5)
            assert [w for w, _ in f.runtime.starts] == [0]
            await f.until(f.all_ready)
            order = [w for w, _ in f.runtime.starts]
            assert order[0] == 0 and sorted(order) == list(range(8))
            # At most `parallel` (3) loading at once: the second wave began after the first.
            starts = {w: f.runtime.procs[w].started_at for w in range(8)}
            first_wave = sorted(range(1, 8), key=lambda w: starts[w])[:3]
            assert all(starts[w] == starts[first_wave[0]] for w in first_wave)
            later = set(range(1, 8)) - set(first_wave)
            assert all(starts[w] > starts[first_wave[0]] for w in later)
            view = f.agent.view()
            for w in view.workers:
                assert w.argv == f.runtime.procs[w.id].command.argv
                assert "--port" in w.argv and str(w.port) in w.argv
            assert view.rollout == "done"
            assert f.runtime.prepares >= 9  # once at start, then before every launch

    run_virtual(scenario())


def test_crash_backs_off_then_relaunches_and_records_the_reason(tmp: Path) -> None:
    async def scenario() -> None:
        async with farm(tmp) as f:
            await f.until(f.all_ready)
            f.runtime.crash(3, 1, ("Traceback (most recent call last):", "RuntimeError: boom"))
            await f.until(lambda: f.phase(3) is Phase.BACKOFF, within=1)
            assert f.runtime.starts_of(3) == 1  # not relaunched during the back-off
            await f.until(lambda: f.runtime.starts_of(3) == 2, within=5)
            await f.until(lambda: f.phase(3) is Phase.READY)
            w = f.agent.view().worker(3)
            assert dict(w.restarts_by_reason) == {"crash": 1}
            assert w.last_failure is not None
            # The other workers never stopped.
            assert all(f.runtime.starts_of(i) == 1 for i in range(8) if i != 3)

    run_virtual(scenario())


def test_hung_worker_is_stopped_after_the_failure_threshold_and_restarted_as_hang(
    tmp: Path,
) -> None:
    async def scenario() -> None:
        async with farm(tmp) as f:
            await f.until(f.all_ready)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            f.prober.hung.add(5)
            await f.until(lambda: 5 in f.runtime.stops, within=60)
            # threshold x period, plus at most one period: 3 x 2 s + 2 s.
            assert loop.time() - t0 <= 8.5
            f.prober.hung.discard(5)
            await f.until(lambda: f.phase(5) is Phase.READY)
            assert dict(f.agent.view().worker(5).restarts_by_reason) == {"hang": 1}

    run_virtual(scenario())


def test_oom_while_serving_steps_the_ladder_and_spreads_in_waves(tmp: Path) -> None:
    extra = """
[oom]
scope = "all"

[[oom.steps]]
name = "less_static_memory"
add = { mem_fraction_static = -0.05 }
"""
    async def scenario() -> None:
        async with farm(tmp, text=farm_toml(tmp, extra=extra)) as f:
            await f.until(f.all_ready)
            f.runtime.log(2, READY_LINE)
            f.runtime.log(2, OOM_LINE)
            await f.until(lambda: 2 in f.runtime.stops, within=5)
            await f.until(lambda: all(f.runtime.starts_of(w) == 2 for w in range(8)))
            await f.until(f.all_ready)
            for w in f.agent.view().workers:
                assert w.oom_step == 1
                assert w.oom_step_name == "less_static_memory"
                argv = f.runtime.procs[w.id].command.argv
                assert argv[argv.index("--mem-fraction-static") + 1] == "0.75"
            # The spread restarted the others in waves of `parallel`, never all at once.
            stops_by_time: list[int] = f.runtime.stops
            assert sorted(stops_by_time) == list(range(8))
            assert dict(f.agent.view().worker(5).restarts_by_reason) == {"oom": 1}

    run_virtual(scenario())


def test_rolling_restart_keeps_the_rest_serving(tmp: Path) -> None:
    async def scenario() -> None:
        async with farm(tmp) as f:
            await f.until(f.all_ready)
            worst = [0]

            async def sample() -> None:
                while True:
                    out = sum(1 for p in f.phases().values() if p is not Phase.READY)
                    worst[0] = max(worst[0], out)
                    await asyncio.sleep(0.05)

            sampler = asyncio.create_task(sample())
            await f.agent.restart(list(range(8)))
            await f.until(lambda: all(f.runtime.starts_of(w) == 2 for w in range(8)))
            await f.until(f.all_ready)
            sampler.cancel()
            assert worst[0] == 3  # parallel = 3: never more out at once
            assert all(
                dict(w.restarts_by_reason) == {"manual": 1} for w in f.agent.view().workers
            )

    run_virtual(scenario())


def test_adoption_keeps_running_workers_and_holds_failed_ones(tmp: Path) -> None:
    state = tmp / "state.json"
    state.write_text(
        json.dumps(
            {
                "format": 1,
                "workers": {
                    "5": {"phase": "failed", "failures": 4, "oom_step": 0, "restarts": []},
                    "6": {"phase": "stopped", "failures": 0, "oom_step": 0, "restarts": []},
                },
            }
        )
    )
    running = {w: Running(w, 5000 + w, True) for w in (0, 1, 2, 3, 4, 7)}

    async def scenario() -> None:
        async with farm(tmp, running=running) as f:
            await f.until(
                lambda: all(f.phase(w) is Phase.READY for w in running), within=30
            )
            await asyncio.sleep(30)
            assert f.runtime.starts == []  # adopted, never started again
            assert f.phase(5) is Phase.FAILED and f.phase(6) is Phase.STOPPED
            assert f.agent.view().worker(0).pid == 5000

    run_virtual(scenario())


def test_reload_restarts_only_changed_workers_and_adds_and_removes(tmp: Path) -> None:
    new_text = [farm_toml(tmp, workers=6, sglang="max_running_requests = 32")]

    async def scenario() -> None:
        loader = lambda: load_spec(new_text[0], source="test.toml")  # noqa: E731 -- one-liner
        async with farm(tmp, loader=loader) as f:
            await f.until(f.all_ready)
            result = await f.agent.reload()
            assert result.applied
            assert result.removed == (6, 7) and result.added == ()
            assert result.restarted == (0, 1, 2, 3, 4, 5)
            await f.until(lambda: all(f.runtime.starts_of(w) == 2 for w in range(6)))
            await f.until(f.all_ready)
            assert [w.id for w in f.agent.view().workers] == list(range(6))
            assert 6 in f.runtime.stops and 7 in f.runtime.stops
            argv = f.agent.view().worker(0).argv
            assert argv[argv.index("--max-running-requests") + 1] == "32"
            # The same config again changes nothing.
            again = await f.agent.reload()
            assert again.applied and again.restarted == () and again.added == ()

    run_virtual(scenario())


# ---- the front door: membership follows readiness, planned stops drain ---------------------

GATEWAY = """
[gateway]
mode = "external"
url = "http://127.0.0.1:8000"
drain_timeout = "30s"
"""


def urls(ids: range | list[int]) -> set[str]:
    return {f"http://127.0.0.1:{30000 + w}" for w in ids}


def test_gateway_membership_follows_readiness_and_a_crash_leaves_at_once(tmp: Path) -> None:
    async def scenario() -> None:
        async with farm(tmp, text=farm_toml(tmp, extra=GATEWAY)) as f:
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
        async with farm(tmp, text=farm_toml(tmp, extra=GATEWAY)) as f:
            await f.until(lambda: f.gateway.routed() == urls(range(8)))
            f.in_flight.counts[2] = 5
            stopping = asyncio.create_task(f.agent.stop([2]))
            await f.until(lambda: urls([2]).isdisjoint(f.gateway.routed()), within=1)
            await asyncio.sleep(10)
            # Out of the gateway, its requests still running: not signalled yet.
            assert f.phase(2) is Phase.DRAINING
            assert 2 not in f.runtime.stops
            removed_at = f.gateway.calls.index(("remove", "http://127.0.0.1:30002"))
            assert removed_at >= 0
            f.in_flight.counts[2] = 0
            await asyncio.wait_for(stopping, 5)
            assert f.phase(2) is Phase.STOPPED and f.runtime.stops == [2]
            drained = f.agent.view().worker(2).last_drain_seconds
            assert drained is not None and 10 <= drained <= 11

    run_virtual(scenario())


def test_drain_budget_bounds_the_wait_and_no_drain_skips_it(tmp: Path) -> None:
    async def scenario() -> None:
        async with farm(tmp, text=farm_toml(tmp, extra=GATEWAY)) as f:
            await f.until(lambda: f.gateway.routed() == urls(range(8)))
            loop = asyncio.get_running_loop()
            f.in_flight.counts[4] = 3  # never finishes
            t0 = loop.time()
            await f.agent.stop([4])
            assert f.phase(4) is Phase.STOPPED
            assert 30 <= loop.time() - t0 <= 31  # drain_timeout = 30 s, then the stop
            f.in_flight.counts[5] = 3
            t0 = loop.time()
            await f.agent.stop([5], drain=False)
            assert f.phase(5) is Phase.STOPPED and loop.time() - t0 < 1

    run_virtual(scenario())


def test_restart_all_keeps_workers_minus_parallel_in_the_gateway(tmp: Path) -> None:
    async def scenario() -> None:
        async with farm(tmp, text=farm_toml(tmp, extra=GATEWAY)) as f:
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
            await f.agent.restart(list(range(8)))
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
        async with farm(tmp, text=farm_toml(tmp, extra=GATEWAY), gateway=gw) as f:
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


# ---- hardening (issue 15) -------------------------------------------------------------------


def test_changes_wait_until_state_is_restored_and_workers_adopted(tmp: Path) -> None:
    """#7: a stop issued while the agent restores and adopts would be saved over the
    remembered state; until then the agent says why changes must wait."""
    release = asyncio.Event()

    async def scenario() -> None:
        async with farm(tmp, running={0: Running(0, 4242, True)}) as f:
            original = f.runtime.adopt

            async def slow_adopt() -> Mapping[int, Running]:
                await release.wait()
                return await original()

            # Replaced before the agent's run reaches it (its task has not run yet).
            f.runtime.adopt = slow_adopt  # type: ignore[method-assign]  # a slow D-Bus
            await asyncio.sleep(5)
            pending = f.agent.startup_pending()
            assert pending is not None and "adopting" in pending
            release.set()
            await f.until(lambda: f.agent.startup_pending() is None, within=5)

    run_virtual(scenario())


def test_a_start_after_the_fix_judges_the_preflight_anew(tmp: Path) -> None:
    """#9: the doctor's verdict is re-gathered at an operator's start and at a reload."""
    world = {"broken": {3}}
    report = {"broken": set(world["broken"])}

    def preflight(spec: FarmSpec, worker: int) -> list[Failure]:
        if worker in report["broken"]:
            return [Failure(FailureKind.PREFLIGHT, "preflight model: missing", "fix the path")]
        return []

    async def refresh(spec: FarmSpec) -> None:
        report["broken"] = set(world["broken"])

    async def scenario() -> None:
        loader = lambda: load_spec(farm_toml(tmp), source="test.toml")  # noqa: E731 -- one-liner
        async with farm(tmp, preflight=preflight, refresh=refresh, loader=loader) as f:
            await f.until(lambda: f.phase(3) is Phase.FAILED and f.phase(2) is Phase.READY)
            world["broken"] = set()  # the operator fixed the model path
            await f.agent.start([3])
            await f.until(lambda: f.phase(3) is Phase.READY, within=60)
            world["broken"] = {5}  # a reload brings a new problem for worker 5
            result = await f.agent.reload()
            assert result.applied
            await f.agent.restart([5])
            await f.until(lambda: f.phase(5) is Phase.FAILED, within=60)

    run_virtual(scenario())


def test_overlapping_reloads_restart_each_changed_worker_once(tmp: Path) -> None:
    """#13: two reloads at once (SIGHUP and farmctl) are applied one after the other."""
    new_text = farm_toml(tmp, sglang="max_running_requests = 16")

    async def scenario() -> None:
        loader = lambda: load_spec(new_text, source="test.toml")  # noqa: E731 -- one-liner
        async with farm(tmp, loader=loader) as f:
            await f.until(f.all_ready)
            first, second = await asyncio.gather(f.agent.reload(), f.agent.reload())
            assert first.restarted == tuple(range(8)) and second.restarted == ()
            await f.until(lambda: all(f.runtime.starts_of(w) == 2 for w in range(8)))
            await f.until(f.all_ready)
            await asyncio.sleep(60)
            assert all(f.runtime.starts_of(w) == 2 for w in range(8))

    run_virtual(scenario())


def test_a_restart_racing_the_removal_of_its_worker_leaves_nothing_running(tmp: Path) -> None:
    """#13: a worker a reload removes is never restarted behind the farm's back."""
    new_text = farm_toml(tmp, workers=6)

    async def scenario() -> None:
        loader = lambda: load_spec(new_text, source="test.toml")  # noqa: E731 -- one-liner
        async with farm(tmp, loader=loader) as f:
            await f.until(f.all_ready)
            await asyncio.gather(f.agent.reload(), f.agent.restart([7]))
            await asyncio.sleep(60)
            assert set(f.runtime.procs) == set(range(6))  # nothing of 6 or 7 still runs

    run_virtual(scenario())


def test_a_reload_that_changes_the_gateway_is_refused_and_says_to_restart(tmp: Path) -> None:
    """The gateway is set up at agent start: a reload cannot move it; it says so."""
    new_text = farm_toml(tmp, extra=GATEWAY.replace("30s", "45s"))

    async def scenario() -> None:
        loader = lambda: load_spec(new_text, source="test.toml")  # noqa: E731 -- one-liner
        async with farm(tmp, text=farm_toml(tmp, extra=GATEWAY), loader=loader) as f:
            await f.until(f.all_ready)
            result = await f.agent.reload()
            assert not result.applied
            assert "restart the agent" in result.problems[0]
            assert f.agent.spec.gateway.drain_timeout == 30.0

    run_virtual(scenario())


def test_the_agents_own_fd_exhaustion_is_never_the_workers_failure(tmp: Path) -> None:
    """#1: probes that fail with the agent's own EMFILE skip the beat; no hang restart."""

    async def scenario() -> None:
        async with farm(tmp) as f:
            await f.until(f.all_ready)
            f.prober.starved.add(4)
            await asyncio.sleep(120)  # 60 periods of 2 s
            assert f.phase(4) is Phase.READY and 4 not in f.runtime.stops
            f.prober.starved.discard(4)
            f.prober.failing.add(4)  # a real failure still counts
            await f.until(lambda: 4 in f.runtime.stops, within=20)

    run_virtual(scenario())
