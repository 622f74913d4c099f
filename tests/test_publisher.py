"""publisher: what follows each change of the farm (issue 24: out of agent.py): a fresh
view, the right watchers woken, waits on a condition, one coalesced state writer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, MutableMapping
from typing import Any

import structlog

from sglang_farm.farm_view import FarmView
from sglang_farm.publisher import Publisher
from sglang_farm.workers.phase import Phase
from sglang_farm.workers.supervisor import Rollout, WorkerState


def view(n: int) -> FarmView:
    return FarmView("f", "process", (), "/etc/x.toml", float(n), Rollout.IDLE, None)


class Harness:
    def __init__(self) -> None:
        self.built = 0
        self.saves = 0
        self.seen: list[tuple[str, float]] = []
        self.changed = {1: asyncio.Event(), 2: asyncio.Event(), 3: asyncio.Event()}

        async def save() -> None:
            self.saves += 1

        def build() -> FarmView:
            self.built += 1
            return view(self.built)

        def seen_by(who: str) -> Callable[[FarmView], None]:
            return lambda v: self.seen.append((who, v.started_at))

        self.pub = Publisher(
            build=build,
            changed=self.changed,
            save=save,
            after=(seen_by("sync"), seen_by("observer")),
            log_for=lambda w: structlog.get_logger().bind(worker=w),
        )


def test_each_publish_swaps_in_a_fresh_view_and_tells_after_in_order() -> None:
    async def main() -> None:
        h = Harness()
        assert h.pub.view.started_at == 1.0  # built at once: readers never see none
        h.pub.publish({1: WorkerState(1)})
        assert h.pub.view.started_at == 2.0
        assert h.seen == [("sync", 2.0), ("observer", 2.0)]

    asyncio.run(main())


def test_only_the_watchers_of_a_changed_worker_wake_and_a_phase_change_is_logged() -> None:
    async def main() -> list[MutableMapping[str, Any]]:
        h = Harness()
        first = {w: WorkerState(w) for w in (1, 2, 3)}
        h.pub.publish(first)  # the first look: each "changed"
        for ev in h.changed.values():
            ev.clear()
        with structlog.testing.capture_logs() as logs:
            h.pub.publish(
                {
                    1: WorkerState(1).enter(Phase.PENDING, 5.0),  # a new phase
                    2: WorkerState(2, pid=7),  # a new process, the same phase
                    3: WorkerState(3, busy=True),  # nothing its watcher looks at
                }
            )
        assert h.changed[1].is_set() and h.changed[2].is_set() and not h.changed[3].is_set()
        h.pub.publish({4: WorkerState(4)})  # a worker without a wake-up: no error
        return logs

    logs = asyncio.run(main())
    assert [(e["event"], e["worker"], e["state"], e["was"]) for e in logs] == [
        ("worker_state", 1, "pending", "stopped")
    ]


def test_a_worker_watcher_returns_at_its_change_or_at_once_when_removed() -> None:
    async def main() -> None:
        h = Harness()
        waiter = asyncio.ensure_future(h.pub.wait_worker(1, None))
        await asyncio.sleep(0)
        assert not waiter.done()
        h.pub.publish({1: WorkerState(1, pid=7)})
        await waiter
        await h.pub.wait_worker(9, None)  # no such worker (a reload removed it)

    asyncio.run(main())


def test_wait_until_looks_again_after_each_change() -> None:
    async def main() -> None:
        h = Harness()
        state = {"done": False}
        waiter = asyncio.ensure_future(h.pub.wait_until(lambda: state["done"], 60.0))
        await asyncio.sleep(0)
        h.pub.publish({})  # a change, the condition still false
        await asyncio.sleep(0)
        assert not waiter.done()
        state["done"] = True
        h.pub.publish({})
        assert await waiter is True
        assert await h.pub.wait_until(lambda: True, 0.0) is True  # holds already: no wait
        assert await h.pub.wait_until(lambda: False, 0.0) is False  # never: the timeout

    asyncio.run(main())


def test_changes_coalesce_into_one_save_of_the_latest() -> None:
    async def main() -> int:
        h = Harness()
        for n in range(5):
            h.pub.publish({1: WorkerState(1, pid=n)})
        writer = asyncio.ensure_future(h.pub.write_state())
        for _ in range(3):
            await asyncio.sleep(0)
        saves = h.saves
        h.pub.publish({1: WorkerState(1, pid=99)})
        for _ in range(3):
            await asyncio.sleep(0)
        writer.cancel()
        return saves * 10 + h.saves

    assert asyncio.run(main()) == 12  # one save for five changes, then one more
