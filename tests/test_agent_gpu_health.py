"""GPU health: a failing GPU is quarantined, not crash-looped (issue 14), through the
NVML poller's seam (`Agent.observe_fleet`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import MutableMapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from structlog.testing import capture_logs

from agent_harness import farm, farm_toml
from sglang_farm.config import load_spec
from sglang_farm.gpus.snapshot import FleetSnapshot, GpuSnapshot
from sglang_farm.runtime import Running
from sglang_farm.sglang.load import WorkerStats
from sglang_farm.workers.phase import Phase
from virtual_time import run_virtual


def fleet(
    xids: dict[tuple[int, int], int] | None = None,
    *,
    lost: set[int] | None = None,
    remaps: set[int] | None = None,
) -> FleetSnapshot:
    """What the NVML poller would report for 8 GPUs (the poller's seam)."""
    gpus = tuple(
        GpuSnapshot(
            index=i,
            uuid=f"GPU-{i}",
            healthy=i not in (lost or set()),
            error="nvmlDeviceGetMemoryInfo: GPU is lost" if i in (lost or set()) else None,
            remapped_rows_pending=i in (remaps or set()),
        )
        for i in range(8)
    )
    return FleetSnapshot(0.0, 0.0, True, gpus, MappingProxyType(dict(xids or {})))


def test_a_reset_class_xid_quarantines_only_its_worker_and_it_stays_stopped(tmp: Path) -> None:
    async def scenario() -> None:
        async with farm(tmp) as f:
            await f.until(f.all_ready)
            loop = asyncio.get_running_loop()
            f.agent.observe_fleet(fleet())
            t0 = loop.time()
            f.agent.observe_fleet(fleet({(5, 79): 1}))  # XID 79: fell off the bus
            await f.until(lambda: f.phase(5) is Phase.QUARANTINED, within=10)
            assert loop.time() - t0 <= 10
            q = f.agent.view().worker(5).quarantine
            assert q is not None and q.reason == "xid 79" and q.gpu == 5
            await asyncio.sleep(120)  # long past any back-off: never restarted
            assert f.phase(5) is Phase.QUARANTINED and f.runtime.starts_of(5) == 1
            assert all(f.phase(w) is Phase.READY for w in range(8) if w != 5)
            assert all(f.runtime.starts_of(w) == 1 for w in range(8) if w != 5)
            # An operator's start does not bypass it.
            await f.ops.start([5])
            await asyncio.sleep(5)
            assert f.phase(5) is Phase.QUARANTINED

    run_virtual(scenario())


def test_an_application_xid_does_not_quarantine(tmp: Path) -> None:
    async def scenario() -> None:
        async with farm(tmp) as f:
            await f.until(f.all_ready)
            f.agent.observe_fleet(fleet())
            f.agent.observe_fleet(fleet({(2, 13): 3}))  # XID 13: the application's fault
            await asyncio.sleep(30)
            assert f.phase(2) is Phase.READY and 2 not in f.runtime.stops

    run_virtual(scenario())


def test_lost_gpus_quarantine_their_workers_two_at_once(tmp: Path) -> None:
    async def scenario() -> None:
        async with farm(tmp) as f:
            await f.until(f.all_ready)
            f.agent.observe_fleet(fleet(lost={1, 6}))
            await f.until(
                lambda: f.phase(1) is Phase.QUARANTINED and f.phase(6) is Phase.QUARANTINED,
                within=10,
            )
            q = f.agent.view().worker(6).quarantine
            assert q is not None and q.reason == "gpu lost" and "lost" in q.detail
            assert sum(1 for w in range(8) if f.phase(w) is Phase.READY) == 6

    run_virtual(scenario())


def test_pending_row_remaps_at_a_restart_quarantine_instead_of_relaunching(tmp: Path) -> None:
    async def scenario() -> None:
        async with farm(tmp) as f:
            await f.until(f.all_ready)
            f.agent.observe_fleet(fleet(remaps={3}))
            assert f.phase(3) is Phase.READY  # running: judged at its next start
            f.runtime.crash(3, 1)
            await f.until(lambda: f.phase(3) is Phase.BACKOFF, within=1)
            f.agent.observe_fleet(fleet(remaps={3}))
            await f.until(lambda: f.phase(3) is Phase.QUARANTINED, within=1)
            await asyncio.sleep(30)
            assert f.runtime.starts_of(3) == 1

    run_virtual(scenario())


def test_quarantine_survives_an_agent_restart_and_release_checks_the_gpu(tmp: Path) -> None:
    problems: list[str] = ["GPU 5 has row remaps pending: reset it (nvidia-smi -r -i 5)"]
    checked: list[int] = []

    async def check_gpu(gpu: int) -> list[str]:
        checked.append(gpu)
        return list(problems)

    async def first() -> None:
        async with farm(tmp) as f:
            await f.until(f.all_ready)
            f.agent.observe_fleet(fleet())
            f.agent.observe_fleet(fleet({(5, 79): 1}))
            await f.until(lambda: f.phase(5) is Phase.QUARANTINED, within=10)

    async def second() -> None:
        async with farm(tmp, check_gpu=check_gpu) as f:  # a new agent: cold start
            await f.until(lambda: all(f.phase(w) is Phase.READY for w in range(8) if w != 5))
            assert f.phase(5) is Phase.QUARANTINED and f.runtime.starts_of(5) == 0
            q = f.agent.view().worker(5).quarantine
            assert q is not None and q.reason == "xid 79"
            assert await f.ops.release_gpu(5) == problems  # refused: stays quarantined
            assert f.phase(5) is Phase.QUARANTINED and checked == [5]
            problems.clear()  # the operator reset the GPU
            assert await f.ops.release_gpu(5) == []
            await f.until(lambda: f.phase(5) is Phase.READY, within=60)
            assert f.agent.view().worker(5).quarantine is None
            assert dict(f.agent.view().worker(5).quarantines_by_reason) == {"xid 79": 1}

    run_virtual(first())
    run_virtual(second())


# ---- a quarantine never outlives its way out (issue 22, item 7) --------------------------


def three_workers(tmp: Path, gpus: Sequence[int] = (0, 1, 2)) -> str:
    """A worker on each of `gpus` (the config's `workers.gpus`), three unless a test says."""
    return farm_toml(tmp, workers=gpus)


async def ok_gpu(gpu: int) -> list[str]:
    return []


def dropped(logs: Sequence[MutableMapping[str, Any]]) -> list[MutableMapping[str, Any]]:
    return [e for e in logs if e["event"] == "quarantine_dropped"]


def test_a_quarantine_on_a_gpu_the_config_moved_the_worker_off_is_dropped_at_restore(
    tmp: Path,
) -> None:
    """Quarantined on GPU 2; the config now puts worker 2 on GPU 5. Before: restored as
    QUARANTINED with a record naming GPU 2, which neither `release-gpu 2` (no worker uses
    it) nor `release-gpu 5` (nothing quarantined on it) could release."""

    async def first() -> None:
        async with farm(tmp, text=three_workers(tmp)) as f:
            await f.until(f.all_ready)
            f.agent.observe_fleet(fleet())
            f.agent.observe_fleet(fleet({(2, 79): 1}))
            await f.until(lambda: f.phase(2) is Phase.QUARANTINED, within=10)

    async def second() -> None:
        with capture_logs() as logs:
            async with farm(tmp, text=three_workers(tmp, [0, 1, 5])) as f:
                await f.until(f.all_ready)
                w = f.agent.view().worker(2)
                assert w.quarantine is None and w.gpus == (5,)
                assert dict(w.quarantines_by_reason) == {"xid 79": 1}  # the history stays
                assert w.last_action is not None and "GPU 2" in w.last_action
        [line] = dropped(logs)
        assert (line["worker"], line["gpu"], line["quarantined_gpu"]) == (2, 5, 2)
        assert line["log_level"] == "warning"
        assert "no longer uses GPU 2" in str(line["why"])

    run_virtual(first())
    run_virtual(second())


def test_a_quarantined_phase_without_a_record_is_dropped_at_restore_and_the_worker_starts(
    tmp: Path,
) -> None:
    """Before: worker 1 restored QUARANTINED with no record, released by nothing
    (`release-gpu` matches the record's GPU) and `start 1` did nothing."""
    (tmp / "state.json").write_text(
        json.dumps({"format": 1, "workers": {"1": {"phase": "quarantined", "failures": 0}}})
    )

    async def scenario() -> None:
        with capture_logs() as logs:
            async with farm(tmp, text=three_workers(tmp)) as f:
                await f.until(f.all_ready)
                assert f.runtime.starts_of(1) == 1
        [line] = dropped(logs)
        assert (line["worker"], line["gpu"], line["quarantined_gpu"]) == (1, 1, None)
        assert "no record" in str(line["why"])

    run_virtual(scenario())


def test_a_worker_quarantined_before_a_reload_moved_it_is_released_by_worker(tmp: Path) -> None:
    """A reload moves quarantined worker 2 from GPU 2 to GPU 5: it stays quarantined (the
    reload's restart leaves it so) and is released by its id, after GPU 5 (the GPU it will
    run on) passes the checks."""
    checked: list[int] = []
    problems: list[str] = ["GPU 5 has row remaps pending: reset it (nvidia-smi -r -i 5)"]

    async def check_gpu(gpu: int) -> list[str]:
        checked.append(gpu)
        return list(problems)

    async def scenario() -> None:
        moved = load_spec(three_workers(tmp, [0, 1, 5]), source="test.toml")
        async with farm(
            tmp, text=three_workers(tmp), loader=lambda: moved, check_gpu=check_gpu
        ) as f:
            await f.until(f.all_ready)
            f.agent.observe_fleet(fleet())
            f.agent.observe_fleet(fleet({(2, 79): 1}))
            await f.until(lambda: f.phase(2) is Phase.QUARANTINED, within=10)
            assert (await f.ops.reload()).applied
            await asyncio.sleep(30)
            assert f.phase(2) is Phase.QUARANTINED and f.runtime.starts_of(2) == 1
            # By GPU: its quarantine names GPU 2; GPU 5, its GPU now, says the way out.
            assert await f.ops.release_gpu(5) == [
                "no worker is quarantined on GPU 5",
                "worker 2 uses GPU 5 and is quarantined for another GPU: release it with "
                "farmctl release-gpu --worker 2",
            ]
            assert await f.ops.release_worker(2) == problems  # refused: it stays
            assert f.phase(2) is Phase.QUARANTINED and checked == [5]
            problems.clear()
            assert await f.ops.release_worker(2) == []
            await f.until(lambda: f.phase(2) is Phase.READY, within=60)
            assert f.agent.view().worker(2).quarantine is None and checked == [5, 5]
            assert await f.ops.release_worker(2) == [
                "worker 2 is not quarantined (it is ready): nothing to release"
            ]

    run_virtual(scenario())


def test_a_released_gpu_is_not_quarantined_again_by_the_xid_it_already_counted(
    tmp: Path,
) -> None:
    """Issue 27 finding 3: NVML's XID counts are cumulative; after a release, the next
    snapshots still carry the old count, which is no new fault (only a higher count is)."""

    async def scenario() -> None:
        async with farm(tmp, check_gpu=ok_gpu) as f:
            await f.until(f.all_ready)
            f.agent.observe_fleet(fleet())
            f.agent.observe_fleet(fleet({(5, 79): 1}))
            await f.until(lambda: f.phase(5) is Phase.QUARANTINED, within=10)
            assert await f.ops.release_gpu(5) == []
            await f.until(lambda: f.phase(5) is Phase.READY, within=60)
            for _ in range(3):  # the poller's next looks: the same count of XID 79
                f.agent.observe_fleet(fleet({(5, 79): 1}))
                await asyncio.sleep(5)
            assert f.phase(5) is Phase.READY and f.agent.view().worker(5).quarantine is None
            f.agent.observe_fleet(fleet({(5, 79): 2}))  # a new one: set aside again
            await f.until(lambda: f.phase(5) is Phase.QUARANTINED, within=10)

    run_virtual(scenario())


def test_a_stop_of_a_quarantined_worker_returns_at_once_and_leaves_it_quarantined(
    tmp: Path,
) -> None:
    """Before: `stop` waited for STOPPED or FAILED, which a quarantined worker never
    reaches: `farmctl stop 5` hung for the whole stop budget (here 25 s of farm time)."""

    async def scenario() -> None:
        async with farm(tmp) as f:
            await f.until(f.all_ready)
            loop = asyncio.get_running_loop()
            f.agent.observe_fleet(fleet())
            f.agent.observe_fleet(fleet({(5, 79): 1}))
            await f.until(lambda: f.phase(5) is Phase.QUARANTINED, within=10)
            t0 = loop.time()
            await f.ops.stop([5])
            assert loop.time() - t0 < 1
            assert f.phase(5) is Phase.QUARANTINED

    run_virtual(scenario())


def test_a_reload_that_removes_a_quarantined_worker_does_not_wait_for_it_to_stop(
    tmp: Path,
) -> None:
    async def scenario() -> None:
        fewer = load_spec(three_workers(tmp, [0, 1]), source="t.toml")
        async with farm(tmp, text=three_workers(tmp), loader=lambda: fewer) as f:
            await f.until(f.all_ready)
            loop = asyncio.get_running_loop()
            f.agent.observe_fleet(fleet())
            f.agent.observe_fleet(fleet({(2, 79): 1}))
            await f.until(lambda: f.phase(2) is Phase.QUARANTINED, within=10)
            t0 = loop.time()
            result = await f.ops.reload()
            assert result.applied and result.removed == (2,)
            assert loop.time() - t0 < 1  # before: the whole stop budget (25 s here)

    run_virtual(scenario())


def crashed_mid_quarantine(tmp: Path) -> None:
    """The state file of an agent that went (kill -9) while it stopped worker 2 for its
    GPU: the quarantine recorded, the phase not yet (STOPPING is not remembered)."""
    q = {"gpu": 2, "reason": "xid 79", "detail": "fell off the bus", "at": 1.8e9}
    (tmp / "state.json").write_text(
        json.dumps({"format": 1, "workers": {"2": {"phase": None, "quarantine": q}}})
    )


def test_a_quarantine_decided_before_the_agent_went_holds_the_worker_at_a_cold_start(
    tmp: Path,
) -> None:
    """Before: worker 2 was started again on its failing GPU, its quarantine still shown."""
    crashed_mid_quarantine(tmp)

    async def scenario() -> None:
        async with farm(tmp, text=three_workers(tmp)) as f:
            await f.until(lambda: f.phase(0) is Phase.READY and f.phase(1) is Phase.READY)
            await asyncio.sleep(60)
            assert f.phase(2) is Phase.QUARANTINED and f.runtime.starts_of(2) == 0

    run_virtual(scenario())


def test_a_quarantine_decided_before_the_agent_went_stops_the_adopted_worker(
    tmp: Path,
) -> None:
    """Its process outlived the agent (systemd): adopted, the stop for its GPU goes on.
    Before: adopted as serving, on its failing GPU, with its quarantine shown."""
    crashed_mid_quarantine(tmp)
    running = {w: Running(w, 4000 + w, active=True) for w in range(3)}

    async def scenario() -> None:
        async with farm(tmp, text=three_workers(tmp), running=running) as f:
            await f.until(lambda: f.phase(2) is Phase.QUARANTINED, within=30)
            assert 2 in f.runtime.stops and f.runtime.starts_of(2) == 0
            assert f.phase(0) is Phase.READY and 0 not in f.runtime.stops

    run_virtual(scenario())


# ---- busy versus dead ---------------------------------------------------------------------


def stats(worker: int, *, running: float, changed_at: float) -> dict[int, WorkerStats]:
    """What the worker pollers report: its running requests and when its counters moved."""
    return {
        worker: WorkerStats(
            worker=worker, taken_at=changed_at, up=True, running=running, changed_at=changed_at
        )
    }


def test_a_busy_worker_with_a_slow_health_is_not_restarted(tmp: Path) -> None:
    async def scenario() -> None:
        async with farm(tmp) as f:
            await f.until(f.all_ready)
            loop = asyncio.get_running_loop()
            wall = 1.8e9  # the harness's wall clock is 1.8e9 + loop time
            f.prober.hung.add(4)  # /health queues behind a long batch
            for _ in range(30):  # 60 s of polls every 2 s: the counters keep moving
                f.agent.observe_stats(stats(4, running=8, changed_at=wall + loop.time()))
                await asyncio.sleep(2)
            assert f.phase(4) is Phase.READY and 4 not in f.runtime.stops
            # The counters stop moving: the same slow /health is now a hang.
            await f.until(lambda: 4 in f.runtime.stops, within=60)
            assert dict(f.agent.view().worker(4).restarts_by_reason) == {}  # not yet relaunched
            f.prober.hung.discard(4)
            await f.until(lambda: f.phase(4) is Phase.READY)
            assert dict(f.agent.view().worker(4).restarts_by_reason) == {"hang": 1}

    run_virtual(scenario())


def test_a_wedged_worker_is_restarted_though_its_health_answers(tmp: Path) -> None:
    async def scenario() -> None:
        async with farm(tmp) as f:
            await f.until(f.all_ready)
            loop = asyncio.get_running_loop()
            frozen = 1.8e9 + loop.time()
            f.agent.observe_fleet(fleet())  # NVML: the GPU is idle (no utilization sample)
            f.agent.observe_stats(stats(6, running=5, changed_at=frozen))
            await asyncio.sleep(60)
            f.agent.observe_stats(stats(6, running=5, changed_at=frozen))
            assert f.phase(6) is Phase.READY  # 60 s frozen: within the 120 s stall window
            await asyncio.sleep(70)
            f.agent.observe_stats(stats(6, running=5, changed_at=frozen))
            await f.until(lambda: 6 in f.runtime.stops, within=5)
            await f.until(lambda: f.phase(6) is Phase.READY)
            w = f.agent.view().worker(6)
            assert dict(w.restarts_by_reason) == {"hang": 1}
            assert w.last_failure is not None and "wedged" in w.last_failure.summary
            # Frozen counters with no request running are an idle worker: left alone.
            f.agent.observe_stats(stats(2, running=0, changed_at=frozen))
            await asyncio.sleep(200)
            f.agent.observe_stats(stats(2, running=0, changed_at=frozen))
            assert 2 not in f.runtime.stops

    run_virtual(scenario())


def test_a_hung_worker_that_worked_a_moment_ago_is_not_excused_as_busy(tmp: Path) -> None:
    """A SIGSTOPped worker's counters moved before the stop, never after its probes were
    sent: its failed probes count, within threshold x period as for any hang."""

    async def scenario() -> None:
        async with farm(tmp) as f:
            await f.until(f.all_ready)
            loop = asyncio.get_running_loop()
            f.agent.observe_stats(stats(3, running=2, changed_at=1.8e9 + loop.time()))
            await asyncio.sleep(0.5)
            f.agent.observe_stats(stats(3, running=2, changed_at=1.8e9 + loop.time()))
            t0 = loop.time()
            f.prober.hung.add(3)  # stopped: no answer, no counter moves any more
            await f.until(lambda: 3 in f.runtime.stops, within=20)
            assert loop.time() - t0 <= 8.5  # 3 x 2 s + one period, not the 30 s busy window

    run_virtual(scenario())
