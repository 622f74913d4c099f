"""worker_logs: a worker's lines to its followers and to the classifier of its current
process (issue 24: the agent keeps neither itself)."""

from __future__ import annotations

import asyncio

from sglang_farm.sglang.failures import FailureKind
from sglang_farm.workers.logs import WorkerLogs

OOM_LINE = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"


def test_a_line_is_classified_for_the_process_it_came_from() -> None:
    logs = WorkerLogs()
    assert logs.line(1, "loading weights") is None
    failure = logs.line(1, OOM_LINE)
    assert failure is not None and failure.kind is FailureKind.CUDA_OOM_LOAD
    logs.new_process(2, serving=True)  # adopted after its readiness gate
    failure = logs.line(2, OOM_LINE)
    assert failure is not None and failure.kind is FailureKind.CUDA_OOM_SERVING


def test_an_exit_is_explained_then_the_next_process_starts_afresh() -> None:
    logs = WorkerLogs()
    logs.new_process(1, serving=True)
    failure = logs.exited(1, -9, "oom-kill")
    assert failure is not None and failure.kind is FailureKind.HOST_OOM_KILL
    # The next process of worker 1 loads: its OOM is a load-time one again.
    failure = logs.line(1, OOM_LINE)
    assert failure is not None and failure.kind is FailureKind.CUDA_OOM_LOAD


def test_followers_get_every_line_from_when_they_start() -> None:
    async def main() -> tuple[list[str], list[str]]:
        logs = WorkerLogs()
        logs.line(1, "before anyone follows")
        a, b = logs.follow(1), logs.follow(1)
        first_a = asyncio.ensure_future(a.__anext__())
        first_b = asyncio.ensure_future(b.__anext__())
        await asyncio.sleep(0)  # both registered
        logs.line(1, "one")
        logs.line(2, "another worker's")
        logs.line(1, "two")
        got_a = [await first_a, await a.__anext__()]
        got_b = [await first_b]
        await a.aclose()
        logs.line(1, "three")  # a has left: only b
        got_b += [await b.__anext__(), await b.__anext__()]
        await b.aclose()
        return got_a, got_b

    got_a, got_b = asyncio.run(main())
    assert got_a == ["one", "two"]
    assert got_b == ["one", "two", "three"]
