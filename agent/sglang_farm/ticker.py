"""I/O: when the supervisor's time-based rules run (back-off end, load deadline, drain
budget, back-off reset, wave timeout).

The loop sleeps until the supervisor's next deadline, or until woken (an action may have
set a nearer one), and never longer than `TICK_MAX_S`: an idle farm wakes it every few
seconds at most, a safety net should a deadline go unreported.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

TICK_MAX_S = 5.0  # the longest the time-based rules go unevaluated (a safety net)


def next_wait(due: float | None, now: float) -> float:
    """Pure: how long to sleep before the next tick: until `due` (None: no deadline),
    at least 0, at most `TICK_MAX_S`."""
    return TICK_MAX_S if due is None else min(TICK_MAX_S, max(0.0, due - now))


class Ticker:
    def __init__(
        self,
        *,
        next_deadline: Callable[[float], float | None],
        tick: Callable[[], None],
        clock: Callable[[], float],
    ) -> None:
        self._next_deadline = next_deadline
        self._tick = tick
        self._clock = clock
        self._wake = asyncio.Event()

    def wake(self) -> None:
        """A new deadline may now be the nearest: look again."""
        self._wake.set()

    async def run(self) -> None:
        """Tick when due, until cancelled."""
        while True:
            now = self._clock()
            wait = next_wait(self._next_deadline(now), now)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                # asyncio.timeout, not wait_for: in 3.11 wait_for can swallow a cancellation
                # that races with the event, and this loop would never end.
                async with asyncio.timeout(wait):
                    await self._wake.wait()
            self._tick()
