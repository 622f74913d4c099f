"""Defects the agent's shape caused (issue 32, section 4), each a scenario on a virtual clock."""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import replace
from pathlib import Path

import pytest

from agent_harness import farm, farm_toml
from sglang_farm.errors import FarmError
from sglang_farm.workers.supervisor import Event, ProcessExited
from virtual_time import run_virtual


def test_reset_oom_waits_for_the_changes_lock(tmp: Path) -> None:
    """4.4: `reset-oom` is a state change: it waits for the agent's `changes` lock (held
    here as a reload or a start holds it), never changes the worker under it."""

    async def scenario() -> None:
        async with farm(tmp) as f:
            await f.until(f.all_ready)
            sup = f.agent.supervisor
            sup.workers[2] = replace(sup.workers[2], oom_step=1)
            pending: asyncio.Future[None] | None = None
            async with f.agent.changes:
                r = f.ops.reset_oom(2)
                if inspect.isawaitable(r):
                    pending = asyncio.ensure_future(r)
                await asyncio.sleep(5)
                assert sup.workers[2].oom_step == 1, "reset while another change held the lock"
            assert pending is not None
            await asyncio.wait_for(pending, 5)
            assert sup.workers[2].oom_step == 0

    run_virtual(scenario())


def _run_task() -> asyncio.Task[object]:
    """The harness's task running `Agent.run`."""
    (task,) = [
        t for t in asyncio.all_tasks() if getattr(t.get_coro(), "__qualname__", "") == "Agent.run"
    ]
    return task


def test_an_exception_in_the_core_ends_the_agent_with_an_error(tmp: Path) -> None:
    """4.2: an exception from the core while the pump handles a worker's exit ended the
    pump's task; the agent logged it and went on (control socket, watchdog), supervising
    nothing. Now the agent stops by itself, saying why, and `run` raises (non-zero exit)."""

    async def scenario() -> None:
        with pytest.raises(FarmError) as ei:
            async with farm(tmp) as f:
                await f.until(f.all_ready)
                sup = f.agent.supervisor
                real = sup.handle

                def handle(worker: int, event: Event, now: float) -> object:
                    if isinstance(event, ProcessExited):
                        raise RuntimeError("injected: the core's bug")
                    return real(worker, event, now)

                sup.handle = handle  # type: ignore[method-assign,assignment]
                run = _run_task()
                f.runtime.crash(4, 1)
                for _ in range(600):  # farm seconds, a give-up bound
                    if run.done():
                        break
                    await asyncio.sleep(1)
                assert run.done(), "the agent went on after its pump crashed"
                assert not f.stop.is_set()  # it ended by itself, not on a stop
        assert "injected: the core's bug" in str(ei.value)
        assert "restart" in str(ei.value)

    run_virtual(scenario())


def test_a_crashed_watcher_ends_the_agent_naming_its_worker(tmp: Path) -> None:
    """4.2: a worker's liveness watcher is as vital as the pump (without it nothing sees
    that worker hang); its crash ends the agent, and the log line names the worker."""
    from structlog.testing import capture_logs

    async def scenario() -> None:
        with capture_logs() as logged, pytest.raises(FarmError) as ei:
            async with farm(tmp, text=farm_toml(tmp, workers=2)) as f:
                await f.until(f.all_ready)

                async def probe(url: str, timeout: float) -> object:
                    raise RuntimeError("injected: a probe's bug")

                f.prober.probe = probe  # type: ignore[method-assign,assignment]
                run = _run_task()
                for _ in range(600):  # farm seconds, a give-up bound
                    if run.done():
                        break
                    await asyncio.sleep(1)
                assert run.done(), "the agent went on after a watcher crashed"
        assert "liveness watcher failed" in str(ei.value)
        (said,) = [e for e in logged if e["event"] == "agent_task_crashed"][:1]
        assert said["worker"] in (0, 1) and said["gpu"] == said["worker"]
        assert said["log_level"] == "critical" and "probe's bug" in said["error"]

    run_virtual(scenario())
