"""ticker: when the time-based rules run (issue 24: out of agent.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from sglang_farm.spec import HealthPolicy, RestartPolicy, StartupPolicy
from sglang_farm.ticker import TICK_MAX_S, Ticker, next_wait
from sglang_farm.workers.phase import Phase
from sglang_farm.workers.supervisor import Policy, Supervisor, WorkerState
from virtual_time import run_virtual


def test_the_wait_is_until_the_deadline_never_negative_never_beyond_the_cap() -> None:
    assert next_wait(12.0, 10.0) == 2.0
    assert next_wait(3.0, 10.0) == 0.0  # overdue: at once
    assert next_wait(None, 10.0) == TICK_MAX_S  # nothing due: the safety net
    assert next_wait(10.0 + 3 * TICK_MAX_S, 10.0) == TICK_MAX_S


def test_a_wake_ticks_at_once_and_the_next_deadline_is_asked_each_round() -> None:
    async def main() -> tuple[int, list[float]]:
        loop = asyncio.get_running_loop()
        asked: list[float] = []
        ticks = 0

        def deadline(now: float) -> float:
            asked.append(now)
            return now + 3600.0  # far away: only a wake brings the tick

        def tick() -> None:
            nonlocal ticks
            ticks += 1

        ticker = Ticker(next_deadline=deadline, tick=tick, clock=loop.time)
        task = asyncio.ensure_future(ticker.run())
        await asyncio.sleep(0)
        assert ticks == 0
        ticker.wake()
        for _ in range(5):
            await asyncio.sleep(0)
        task.cancel()
        return ticks, asked

    ticks, asked = asyncio.run(main())
    assert ticks == 1 and len(asked) == 2


def _ticks_until(sup: Supervisor, done: Callable[[], bool], limit: int = 50) -> tuple[int, float]:
    """Run the ticker over `sup` on the virtual clock until `done()`: how many ticks it
    took and when. `limit` ticks is a give-up bound: time stands still while the ticker
    spins on a deadline that its tick does not act on."""

    async def main() -> tuple[int, float]:
        loop = asyncio.get_running_loop()
        ticks = 0
        over = asyncio.Event()

        def tick() -> None:
            nonlocal ticks
            ticks += 1
            sup.tick(loop.time())
            if done() or ticks >= limit:
                over.set()

        ticker = Ticker(next_deadline=sup.next_deadline, tick=tick, clock=loop.time)
        task = asyncio.ensure_future(ticker.run())
        await over.wait()
        task.cancel()
        return ticks, loop.time()

    return run_virtual(main())


def _policy() -> Policy:
    return Policy(
        StartupPolicy(canary=None, parallel=1, load_timeout=100.0),
        HealthPolicy(period=1.0, timeout=1.0, failure_threshold=3),
        RestartPolicy(backoff_initial=1.0, backoff_max=8.0, reset_after=50.0, max_failures=3),
    )


def test_the_load_deadline_stops_a_worker_when_due_not_after_a_spin() -> None:
    sup = Supervisor([0], _policy())
    sup.workers[0] = WorkerState(0, Phase.STARTING, since=1000.0, launched_at=1000.0, pid=7)
    ticks, at = _ticks_until(sup, lambda: sup.workers[0].phase is Phase.STOPPING)
    assert sup.workers[0].phase is Phase.STOPPING, f"still {sup.workers[0].phase} after {ticks}"
    assert at - 1000.0 < 100.0 + TICK_MAX_S and ticks <= 2 + int(100.0 // TICK_MAX_S)


def test_the_back_off_reset_comes_when_due_not_at_a_safety_tick() -> None:
    sup = Supervisor([0], _policy())
    sup.workers[0] = WorkerState(0, Phase.READY, failures=2, ready_since=1000.3, pid=7)
    _, at = _ticks_until(sup, lambda: sup.workers[0].failures == 0)
    assert sup.workers[0].failures == 0 and at == 1000.3 + 50.0  # reset_after 50 s
