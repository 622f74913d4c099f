"""Pure: each worker's log lines as the agent reads them: the classifier of its current
process (which failure its lines show, `classify.LogClassifier`), and the operators
following them (`farmctl logs -f`).

No I/O and no clock: the runtime delivers the lines (`runtime.LogLine`, `runtime.Exited`);
each follower reads from its own bounded queue, so a slow one loses lines and never
stalls the agent.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator

from sglang_farm.sglang.classify import LogClassifier
from sglang_farm.sglang.failures import Failure
from sglang_farm.workers.startup_book import StartupBook

FOLLOW_BUFFER = 10000  # lines a follower may fall behind before it loses some


class WorkerLogs:
    def __init__(self) -> None:
        self._classifiers: dict[int, LogClassifier] = {}
        self._followers: dict[int, set[asyncio.Queue[str]]] = {}
        self.startups = StartupBook()  # each worker's latest start, phase by phase

    def new_process(
        self, worker: int, *, serving: bool = False, launched_at: float | None = None
    ) -> None:
        """The worker's process is new (launched, or adopted: `serving` when it passed its
        readiness gate before, so its OOMs are serving-time ones). `launched_at` (the
        agent's clock): a launch, whose start is followed phase by phase from its lines."""
        self._classifiers[worker] = LogClassifier(serving=serving)
        if launched_at is not None:
            self.startups.launched(worker, launched_at)
        else:
            self.startups.forget(worker)  # adopted: its start was not seen

    def line(self, worker: int, text: str, at: float | None = None) -> Failure | None:
        """One line of its log: to every follower, to its start's timeline (`at`: when it
        arrived, the agent's clock); the failure it completes, if any."""
        for q in self._followers.get(worker, ()):
            with contextlib.suppress(asyncio.QueueFull):
                q.put_nowait(text)
        if at is not None:
            self.startups.line(worker, text, at)
        return self._classifier(worker).feed(text)

    def exited(self, worker: int, status: int | None, result: str | None) -> Failure | None:
        """Its process is gone: the failure that best explains the end (None: the log and
        the exit explain nothing)."""
        failure = self._classifier(worker).finish(status, result)
        self._classifiers.pop(worker, None)
        return failure

    async def follow(self, worker: int) -> AsyncGenerator[str, None]:
        """Every line from now on, until the caller stops iterating."""
        q: asyncio.Queue[str] = asyncio.Queue(maxsize=FOLLOW_BUFFER)
        self._followers.setdefault(worker, set()).add(q)
        try:
            while True:
                yield await q.get()
        finally:
            self._followers[worker].discard(q)

    def _classifier(self, worker: int) -> LogClassifier:
        c = self._classifiers.get(worker)
        if c is None:
            c = self._classifiers[worker] = LogClassifier()
        return c
