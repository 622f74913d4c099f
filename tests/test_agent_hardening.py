"""The agent's defects found in review, each a scenario on a virtual clock (issue 15)."""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Mapping
from pathlib import Path

from agent_harness import GATEWAY, farm, farm_toml
from sglang_farm.config import load_spec
from sglang_farm.runtime import Running
from sglang_farm.sglang.failures import Failure, FailureKind
from sglang_farm.spec import FarmSpec
from sglang_farm.workers.phase import Phase
from virtual_time import run_virtual


def test_changes_wait_until_state_is_restored_and_workers_adopted(tmp: Path) -> None:
    """#7: a stop issued while the agent restores and adopts would be saved over the
    remembered state; until then the agent says why changes must wait."""
    release = asyncio.Event()

    async def scenario() -> None:
        async with farm(tmp, running={0: Running(0, 4242, True)}) as f:
            original = f.runtime.adopt

            async def slow_adopt(
                configured: Collection[int] | None = None,
            ) -> Mapping[int, Running]:
                await release.wait()
                return await original(configured)

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
            await f.ops.start([3])
            await f.until(lambda: f.phase(3) is Phase.READY, within=60)
            world["broken"] = {5}  # a reload brings a new problem for worker 5
            result = await f.ops.reload()
            assert result.applied
            await f.ops.restart([5])
            await f.until(lambda: f.phase(5) is Phase.FAILED, within=60)

    run_virtual(scenario())


def test_overlapping_reloads_restart_each_changed_worker_once(tmp: Path) -> None:
    """#13: two reloads at once (SIGHUP and farmctl) are applied one after the other."""
    new_text = farm_toml(tmp, sglang={"max_running_requests": 16})

    async def scenario() -> None:
        loader = lambda: load_spec(new_text, source="test.toml")  # noqa: E731 -- one-liner
        async with farm(tmp, loader=loader) as f:
            await f.until(f.all_ready)
            first, second = await asyncio.gather(f.ops.reload(), f.ops.reload())
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
            await asyncio.gather(f.ops.reload(), f.ops.restart([7]))
            await asyncio.sleep(60)
            assert set(f.runtime.procs) == set(range(6))  # nothing of 6 or 7 still runs

    run_virtual(scenario())


def test_a_reload_that_changes_the_gateway_is_refused_and_says_to_restart(tmp: Path) -> None:
    """The gateway is set up at agent start: a reload cannot move it; it says so."""
    new_text = farm_toml(tmp, gateway={**GATEWAY, "drain_timeout": "45s"})

    async def scenario() -> None:
        loader = lambda: load_spec(new_text, source="test.toml")  # noqa: E731 -- one-liner
        async with farm(tmp, text=farm_toml(tmp, gateway=GATEWAY), loader=loader) as f:
            await f.until(f.all_ready)
            result = await f.ops.reload()
            assert not result.applied
            assert "restart the agent" in result.problems[0]
            assert result.restart_needed  # farmctl reload exits 10 (not 1): restart the agent
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


def test_adopted_workers_running_an_old_command_line_are_restarted_in_waves(tmp: Path) -> None:
    """#11: a config edited while the agent was down: drifted workers restart, drained;
    the runtime is told which workers are configured (strays are its to stop)."""
    spec = load_spec(farm_toml(tmp), source="test.toml")
    old = ("python", "-m", "sglang_farm.sim", "--an-old-flag")

    async def scenario() -> None:
        async with farm(tmp) as f:
            f.runtime.running_at_start = {
                w: Running(
                    w, 5000 + w, True, argv=old if w in (2, 5) else f.agent.command_for(w).argv
                )
                for w in range(8)
            }
            # (replaced before the agent's run reaches adopt: its task has not run yet)
            await f.until(lambda: f.runtime.starts_of(2) == 1 and f.runtime.starts_of(5) == 1)
            await f.until(f.all_ready)
            assert all(f.runtime.starts_of(w) == 0 for w in range(8) if w not in (2, 5))
            assert f.runtime.adopt_configured == spec.worker_ids
            assert dict(f.agent.view().worker(2).restarts_by_reason) == {"config": 1}

    run_virtual(scenario())


def test_adopted_workers_whose_secrets_changed_while_the_agent_was_down_restart(
    tmp: Path,
) -> None:
    """An API key (or env value) edited while the agent was down: the argv holds no secret,
    so only the runtime knows the worker was started with the old one (its secret file
    changed when the agent installed the new ones); that worker restarts in waves."""

    async def scenario() -> None:
        async with farm(tmp) as f:
            f.runtime.running_at_start = {
                w: Running(w, 5000 + w, True, argv=f.agent.command_for(w).argv) for w in range(8)
            }
            f.runtime.secrets_changed_at_prepare = frozenset({3})
            await f.until(lambda: f.runtime.starts_of(3) == 1)
            await f.until(f.all_ready)
            assert all(f.runtime.starts_of(w) == 0 for w in range(8) if w != 3)
            assert dict(f.agent.view().worker(3).restarts_by_reason) == {"config": 1}

    run_virtual(scenario())
