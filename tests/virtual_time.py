"""An asyncio event loop whose clock is virtual: sleeps and timeouts take no real time.

When nothing is ready to run, the loop would block in select() until the next timer;
here it jumps its clock to that timer instead. Only for code with no real I/O to wait
on (fakes only): a real socket would be outrun by the virtual clock, so work handed to
a thread (`asyncio.to_thread`) runs inline instead.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor
from typing import Any, TypeVar, TypeVarTuple

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


class _JumpingSelector(selectors.DefaultSelector):
    def __init__(self, loop: VirtualTimeLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        events = super().select(0)
        if events or timeout is None or timeout <= 0:
            if not events and timeout is None:
                # Nothing scheduled at all: something real (a thread) must wake us.
                return super().select(None)
            return events
        self._loop.now += timeout
        return events


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self.now = 1000.0
        super().__init__(selector=_JumpingSelector(self))

    def time(self) -> float:
        return self.now

    def run_in_executor(
        self, executor: Executor | None, func: Callable[[*Ts], T], *args: *Ts
    ) -> asyncio.Future[T]:
        """Inline, at once: a real thread would be outrun by the virtual clock."""
        fut: asyncio.Future[T] = self.create_future()
        try:
            fut.set_result(func(*args))
        except BaseException as exc:  # handed to the awaiting coroutine, as a thread's would be
            fut.set_exception(exc)
        return fut


def run_virtual(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` to completion on a fresh virtual-time loop."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()
