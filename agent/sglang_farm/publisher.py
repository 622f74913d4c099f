"""I/O: the farm published after each change: a fresh `FarmView` swapped in, the waiters
woken, the state file written off the event loop.

The agent says when something changed (`publish`). Readers (the control socket, the
exporter) never wait on a worker: they read `view`, an immutable snapshot. Liveness
watchers wait for their worker's next change (`wait_worker`), commands for a condition
over the states (`wait_until`), and one writer saves the latest states, however many
changes came meanwhile (`write_state`: an fsync per change would stall the loop).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping, Sequence

import structlog

from sglang_farm.farm_view import FarmView
from sglang_farm.workers.phase import Phase
from sglang_farm.workers.supervisor import WorkerState


class Publisher:
    def __init__(
        self,
        *,
        build: Callable[[], FarmView],
        changed: dict[int, asyncio.Event],
        save: Callable[[], Awaitable[object]],
        after: Sequence[Callable[[FarmView], None]],
        log_for: Callable[[int], structlog.typing.FilteringBoundLogger],
    ) -> None:
        """`build`: a fresh view; `changed`: each worker's wake-up (the agent's, which adds
        and removes workers on a reload); `save`: write the states (called on the loop:
        it takes its copy there); `after`: told of every new view, in order."""
        self._build = build
        self._changed = changed
        self._save = save
        self._after = after
        self._log_for = log_for
        self._keys: dict[int, tuple[Phase, int | None, float | None]] = {}
        self._dirty = asyncio.Event()
        self._wake = asyncio.Event()
        self.view = build()

    def publish(self, workers: Mapping[int, WorkerState]) -> None:
        """Something changed: a fresh view; the watchers of each worker whose phase, process
        or launch changed woken (a phase change logged); the state marked for saving;
        `after` told; the commands waiting on a condition look again."""
        self.view = self._build()
        for wid, s in workers.items():
            key = (s.phase, s.pid, s.launched_at)
            prev = self._keys.get(wid)
            if prev == key:
                continue
            self._keys[wid] = key
            if prev is not None and prev[0] != s.phase:
                self._log_for(wid).info("worker_state", state=str(s.phase), was=str(prev[0]))
            ev = self._changed.get(wid)
            if ev is not None:
                ev.set()
        self._dirty.set()
        for cb in self._after:
            cb(self.view)
        wake, self._wake = self._wake, asyncio.Event()
        wake.set()

    async def wait_worker(self, worker: int, timeout: float | None) -> None:
        """Until the worker's next change, or `timeout` seconds."""
        ev = self._changed.get(worker)
        if ev is None:
            return  # removed by a reload; its watcher ends at its next look
        ev.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await ev.wait()

    async def wait_until(self, cond: Callable[[], bool], timeout: float) -> bool:
        """Until `cond()` holds (looked at after each change): True, or False at `timeout`."""
        try:
            async with asyncio.timeout(timeout):
                while not cond():
                    await self._wake.wait()
        except TimeoutError:
            return False
        return True

    async def write_state(self) -> None:
        """One writer, always of the latest states (changes coalesce); runs until cancelled."""
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            await self._save()
