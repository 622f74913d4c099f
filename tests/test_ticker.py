"""ticker: when the time-based rules run (issue 24: out of agent.py)."""

from __future__ import annotations

import asyncio

from sglang_farm.ticker import TICK_MAX_S, Ticker, next_wait


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
