"""The real Agent driven by a fake runtime, a fake prober and a virtual clock (issue 12 §1).

Rollout, crash -> back-off -> relaunch, hang, OOM step and spread, rolling restarts,
adoption, reload diff and view building, through the same event pump, supervisor and
launcher as production; no processes, no sockets, no sleeps (agent_harness.py).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from agent_harness import OOM_LINE, READY_LINE, farm, farm_toml
from sglang_farm.config import load_spec
from sglang_farm.runtime import Running
from sglang_farm.workers.phase import Phase
from virtual_time import run_virtual


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
            # threshold x period, plus at most one period: 3 x 2 s + 2 s; and not sooner:
            # a probe's own timeout (5 s) after its missed beats is not counted again.
            assert 5.9 <= loop.time() - t0 <= 8.5
            f.prober.hung.discard(5)
            await f.until(lambda: f.phase(5) is Phase.READY)
            assert dict(f.agent.view().worker(5).restarts_by_reason) == {"hang": 1}

    run_virtual(scenario())


def test_oom_while_serving_steps_the_ladder_and_spreads_in_waves(tmp: Path) -> None:
    step = {"name": "less_static_memory", "add": {"mem_fraction_static": -0.05}}
    oom = {"scope": "all", "steps": [step]}

    async def scenario() -> None:
        async with farm(tmp, text=farm_toml(tmp, oom=oom)) as f:
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
            await f.ops.restart(list(range(8)))
            await f.until(lambda: all(f.runtime.starts_of(w) == 2 for w in range(8)))
            await f.until(f.all_ready)
            sampler.cancel()
            assert worst[0] == 3  # parallel = 3: never more out at once
            assert all(dict(w.restarts_by_reason) == {"manual": 1} for w in f.agent.view().workers)

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
            await f.until(lambda: all(f.phase(w) is Phase.READY for w in running), within=30)
            await asyncio.sleep(30)
            assert f.runtime.starts == []  # adopted, never started again
            assert f.phase(5) is Phase.FAILED and f.phase(6) is Phase.STOPPED
            assert f.agent.view().worker(0).pid == 5000

    run_virtual(scenario())


def test_reload_restarts_only_changed_workers_and_adds_and_removes(tmp: Path) -> None:
    new_text = [farm_toml(tmp, workers=6, sglang={"max_running_requests": 32})]

    async def scenario() -> None:
        loader = lambda: load_spec(new_text[0], source="test.toml")  # noqa: E731 -- one-liner
        async with farm(tmp, loader=loader) as f:
            await f.until(f.all_ready)
            result = await f.ops.reload()
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
            again = await f.ops.reload()
            assert again.applied and again.restarted == () and again.added == ()

    run_virtual(scenario())


def test_a_stop_that_never_ends_is_waited_for_the_stop_budget_and_its_slack(tmp: Path) -> None:
    """One budget (`supervisor.stop_budget`, issue 24 §1): `farmctl stop` returns once the
    worker is stopped, or at the budget plus its slack, in farm time."""

    async def scenario() -> float:
        async with farm(tmp, text=farm_toml(tmp, workers=2)) as f:
            await f.until(f.all_ready)
            f.runtime.unstoppable.add(1)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            await f.ops.stop([0])  # stops at once
            assert loop.time() - t0 < 1.0 and f.phase(0) is Phase.STOPPED
            t0 = loop.time()
            await f.ops.stop([1])
            waited = loop.time() - t0
            assert f.phase(1) is Phase.STOPPING
            f.runtime.unstoppable.clear()
            return waited

    waited = run_virtual(scenario())
    # stop_timeout = "10s", no gateway (no drain), and a 15 s slack (STOP_SLACK_S).
    assert waited == pytest.approx(25.0, abs=0.5)
