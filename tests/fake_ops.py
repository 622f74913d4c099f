"""A scripted `FarmOps` for control-socket tests: a farm of N workers that move
through phases on their own (restart → [draining →] stopping → starting → ready, or
failed; quarantined → released → starting → ready), recording every call. Time is
real but short (`step` seconds per phase).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import replace
from types import MappingProxyType
from typing import TypedDict, Unpack

from sglang_farm.control.farm_api import GpuMemory, HostDrainResult, ReloadResult
from sglang_farm.farm_view import (
    FarmView,
    GatewayStatus,
    Phase,
    Quarantine,
    RestartRecord,
    WorkerView,
)
from sglang_farm.sglang.failures import Failure, FailureKind
from sglang_farm.sglang.load import RecentAnswers
from sglang_farm.workers.phase import StopIntent
from sglang_farm.workers.supervisor import Rollout


def make_worker(i: int, *, in_gateway: bool = False) -> WorkerView:
    """Worker `i` on GPU `i`, ready for an hour."""
    return WorkerView(
        id=i,
        gpus=(i,),
        port=30000 + i,
        base_url=f"http://127.0.0.1:{30000 + i}",
        phase=Phase.READY,
        since=time.time() - 3600,
        pid=1000 + i,
        in_gateway=in_gateway,
    )


class _Changes(TypedDict, total=False):
    """The `WorkerView` fields that change with a phase here (`FakeOps._set`)."""

    pid: int | None
    last_failure: Failure | None
    last_failure_at: float | None
    last_action: str | None
    oom_step: int
    oom_step_name: str | None
    last_load_seconds: float | None
    in_gateway: bool
    last_drain_seconds: float | None
    quarantine: Quarantine | None
    stop_intent: StopIntent | None


OOM_FAILURE = Failure(
    kind=FailureKind.CUDA_OOM_LOAD,
    summary="CUDA out of memory while loading the model",
    advice="lower --mem-fraction-static or use more GPUs (tp)",
    lines=("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",),
)

XID_79_DETAIL = (
    "GPU has fallen off the bus; NVIDIA's action: RESTART_BM: Restart bare metal, "
    "system should be restarted."
)


class FakeOps:
    """Implements `sglang_farm.control.farm_api.FarmOps`.

    Knobs: `issue_delay` (seconds `start`/`restart`/`stop` hold before returning),
    `step` (seconds per phase after a restart), `fail_next` (worker ids whose next
    start ends FAILED with `OOM_FAILURE`), `raise_on` (command → exception to raise),
    `reload_result`, `gpus`, `startup_reason` (what `startup_pending` answers: set it
    to play an agent still restoring its state and adopting workers). With `gateway`
    (its `members` is counted from the workers), ready workers are in it, and a stop
    or restart with `drain` passes through DRAINING (out of the gateway) for one
    `step`. `drains` records the `drain` argument of every `stop` and `restart`.

    An applied `reload` restarts its `restarted` workers as `restart` does (not with
    `roll_on_reload` False).

    `quarantine(worker)` sets a worker's GPU aside as the agent does (stopped, state
    QUARANTINED); `start` and `restart` leave such a worker as it is. `release_gpu`
    answers `release_problems` when set (the quarantine stays), else starts the workers
    quarantined on that GPU again (or says none is); `release_worker` the same for one
    worker, whichever GPU its quarantine names.
    """

    def __init__(
        self, n: int = 4, *, step: float = 0.05, gateway: GatewayStatus | None = None
    ) -> None:
        self.gateway = gateway
        self.workers: dict[int, WorkerView] = {
            i: make_worker(i, in_gateway=gateway is not None) for i in range(n)
        }
        self.step = step
        self.issue_delay = 0.0
        self.fail_next: set[int] = set()
        self.raise_on: dict[str, BaseException] = {}
        self.calls: list[tuple[str, tuple[int, ...]]] = []
        self.drains: list[tuple[str, tuple[int, ...], bool]] = []
        self.reload_result = ReloadResult(applied=True, restarted=(1,))
        self.roll_on_reload = True  # an applied reload restarts its `restarted` workers
        self.queues: dict[int, float] = {}
        self.answers: dict[int, RecentAnswers] = {}  # issue 34 §2
        self.gpu_nodes: dict[int, int] = {}  # issue 34 §5
        self.gpus: list[GpuMemory] = [
            GpuMemory(i, used_bytes=60 * 2**30, total_bytes=80 * 2**30) for i in range(n)
        ]
        self.log_lines: dict[int, list[str]] = {
            i: [f"w{i} line {k}" for k in range(50)] for i in range(n)
        }
        self.follow_queues: list[asyncio.Queue[str | None]] = []
        self.oom_resets: list[int] = []
        self.startup_reason: str | None = None
        self.release_problems: list[str] = []
        # Issue 26: drain-host holds the host out (`held_out_since`); `drain_left` is what
        # `drain_host` answers is still running when its wait runs out.
        self.held_out_since: float | None = None
        self.drain_left: dict[int, int | None] = {}
        # Issue 30: the gateways that did not answer and never confirmed workers out.
        self.drain_unconfirmed: dict[str, tuple[int, ...]] = {}
        self.drain_timeouts: list[float | None] = []
        self.rolling = 0
        self.rollout = Rollout.DONE
        # Fleet review #2: the config in force (its file and digest; None: not from a file).
        self.config_source = "/etc/sglang-farm/farm.toml"
        self.config_sha256: str | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    # --- FarmOps ---

    def view(self) -> FarmView:
        if "view" in self.raise_on:
            raise self.raise_on["view"]
        return FarmView(
            name="test-farm",
            runtime="process",
            workers=tuple(self.workers[i] for i in sorted(self.workers)),
            config_source=self.config_source,
            config_sha256=self.config_sha256,
            started_at=time.time() - 7200,
            rollout=self.rollout,
            rolling=self.rolling,
            held_out_since=self.held_out_since,
            gateway=None
            if self.gateway is None
            else replace(self.gateway, members=sum(w.in_gateway for w in self.workers.values())),
        )

    def startup_pending(self) -> str | None:
        return self.startup_reason

    def gpu_memory(self) -> Sequence[GpuMemory]:
        return list(self.gpus)

    def queue_depths(self) -> dict[int, float]:
        return dict(self.queues)

    def recent_answers(self) -> dict[int, RecentAnswers]:
        return dict(self.answers)

    def gpu_numa_nodes(self) -> dict[int, int]:
        return dict(self.gpu_nodes)

    async def _issue(self, name: str, ids: Sequence[int]) -> None:
        self.calls.append((name, tuple(ids)))
        if name in self.raise_on:
            raise self.raise_on[name]
        if self.issue_delay:
            await asyncio.sleep(self.issue_delay)

    def _set(self, i: int, phase: Phase, **kw: Unpack[_Changes]) -> None:
        self.workers[i] = replace(self.workers[i], phase=phase, since=time.time(), **kw)

    def _quarantined(self, i: int) -> bool:
        return self.workers[i].phase is Phase.QUARANTINED

    async def start(self, worker_ids: Sequence[int]) -> None:
        await self._issue("start", worker_ids)
        for i in worker_ids:
            if self._quarantined(i):
                continue  # only a release starts it again
            self._set(i, Phase.STARTING, pid=None)
            self._spawn(self._come_up(i, stop_first=False))

    def _drains(self, drain: bool) -> bool:
        return drain and self.gateway is not None

    async def stop(self, worker_ids: Sequence[int], *, drain: bool = True) -> None:
        self.drains.append(("stop", tuple(worker_ids), drain))
        await self._issue("stop", worker_ids)
        # A quarantined worker is stopped already and stays set aside (as the agent does).
        worker_ids = [i for i in worker_ids if not self._quarantined(i)]
        if self._drains(drain):
            for i in worker_ids:
                self._set(i, Phase.DRAINING, in_gateway=False)
            await asyncio.sleep(self.step)
        for i in worker_ids:
            if self._drains(drain):
                self._set(i, Phase.STOPPED, pid=None, last_drain_seconds=self.step)
            else:
                self._set(i, Phase.STOPPED, pid=None, in_gateway=False)

    async def restart(self, worker_ids: Sequence[int], *, drain: bool = True) -> None:
        self.drains.append(("restart", tuple(worker_ids), drain))
        await self._issue("restart", worker_ids)
        for i in worker_ids:
            if self._quarantined(i):
                continue  # only a release starts it again
            if self._drains(drain):
                self._set(i, Phase.DRAINING, in_gateway=False)
            else:
                self._set(i, Phase.STOPPING, in_gateway=False)
            w = self.workers[i]
            by = dict(w.restarts_by_reason)
            by["manual"] = by.get("manual", 0) + 1
            self.workers[i] = replace(
                w,
                restarts=(*w.restarts, RestartRecord(time.time(), "manual")),
                restarts_by_reason=MappingProxyType(by),
            )
            self._spawn(self._come_up(i, stop_first=True))

    async def _come_up(self, i: int, *, stop_first: bool) -> None:
        if stop_first and self.workers[i].phase is Phase.DRAINING:
            await asyncio.sleep(self.step)
            self._set(i, Phase.STOPPING, last_drain_seconds=self.step)
        if stop_first:
            await asyncio.sleep(self.step)
            self._set(i, Phase.STARTING, pid=None)
        await asyncio.sleep(self.step)
        if i in self.fail_next:
            self.fail_next.discard(i)
            self._set(
                i,
                Phase.FAILED,
                pid=None,
                last_failure=OOM_FAILURE,
                last_failure_at=time.time(),
                last_action="moved to OOM ladder step 1 and gave up after 5 failures",
                oom_step=1,
                oom_step_name="less-static-memory",
            )
        else:
            self._set(i, Phase.READY, pid=2000 + i, last_load_seconds=self.step)
            if self.gateway is not None:
                # As with a real gateway: it routes to a ready worker a moment later.
                await asyncio.sleep(self.step)
                self.workers[i] = replace(self.workers[i], in_gateway=True)

    def _spawn(self, coro: Coroutine[object, object, None]) -> None:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def logs(self, worker_id: int, lines: int) -> Sequence[str]:
        return self.log_lines[worker_id][-lines:] if lines else []

    async def follow_logs(self, worker_id: int) -> AsyncIterator[str]:
        q: asyncio.Queue[str | None] = asyncio.Queue()
        self.follow_queues.append(q)
        try:
            while True:
                item = await q.get()
                if item is None:
                    return
                yield item
        finally:
            self.follow_queues.remove(q)

    async def reset_oom(self, worker_id: int) -> None:
        self.oom_resets.append(worker_id)
        self.workers[worker_id] = replace(self.workers[worker_id], oom_step=0, oom_step_name=None)

    async def reload(self) -> ReloadResult:
        await self._issue("reload", ())
        r = self.reload_result
        if r.applied and self.roll_on_reload:
            # As the agent's rolling restart does (all at once here): the workers whose
            # command changed stop, start and come back ready.
            for i in r.restarted:
                if i in self.workers and not self._quarantined(i):
                    self._set(i, Phase.STOPPING, in_gateway=False)
                    self._spawn(self._come_up(i, stop_first=True))
        return r

    async def release_gpu(self, gpu: int) -> list[str]:
        await self._issue("release-gpu", (gpu,))
        if self.release_problems:
            return list(self.release_problems)
        held = [
            i
            for i, w in sorted(self.workers.items())
            if w.phase is Phase.QUARANTINED and w.quarantine is not None and w.quarantine.gpu == gpu
        ]
        if not held:
            return [f"no worker is quarantined on GPU {gpu}"]
        for i in held:
            self._set(i, Phase.PENDING, quarantine=None, stop_intent=None)
            self._spawn(self._come_up(i, stop_first=False))
        return []

    async def release_worker(self, worker: int) -> list[str]:
        await self._issue("release-worker", (worker,))
        w = self.workers[worker]
        if w.phase is not Phase.QUARANTINED:
            return [f"worker {worker} is not quarantined (it is {w.phase}): nothing to release"]
        if self.release_problems:
            return list(self.release_problems)
        self._set(worker, Phase.PENDING, quarantine=None, stop_intent=None)
        self._spawn(self._come_up(worker, stop_first=False))
        return []

    async def drain_host(self, timeout: float | None) -> HostDrainResult:
        await self._issue("drain-host", ())
        self.drain_timeouts.append(timeout)
        self.held_out_since = time.time()
        for i in self.workers:
            self.workers[i] = replace(self.workers[i], in_gateway=False)
        ids = tuple(sorted(self.workers))
        drained = tuple(i for i in ids if i not in self.drain_left)
        return HostDrainResult(
            ids, drained, dict(self.drain_left), self.step, dict(self.drain_unconfirmed)
        )

    async def undrain_host(self) -> tuple[int, ...]:
        await self._issue("undrain-host", ())
        self.held_out_since = None
        for i, w in self.workers.items():
            if w.phase is Phase.READY and self.gateway is not None:
                self.workers[i] = replace(w, in_gateway=True)
        return tuple(sorted(self.workers))

    # --- test helpers ---

    def quarantine(
        self,
        worker: int,
        *,
        gpu: int | None = None,
        reason: str = "xid 79",
        detail: str = XID_79_DETAIL,
    ) -> None:
        """Set `worker`'s GPU aside (its first GPU unless `gpu` says): stopped, QUARANTINED."""
        w = self.workers[worker]
        g = w.gpus[0] if gpu is None else gpu
        by = dict(w.quarantines_by_reason)
        by[reason] = by.get(reason, 0) + 1
        self.workers[worker] = replace(w, quarantines_by_reason=MappingProxyType(by))
        self._set(
            worker,
            Phase.QUARANTINED,
            pid=None,
            in_gateway=False,
            quarantine=Quarantine(g, reason, detail, time.time()),
            # As the supervisor's: why it stopped (a test may show it still STOPPING).
            stop_intent=StopIntent.QUARANTINE,
            last_action=f"GPU {g} quarantined ({reason}); not restarted until released",
        )

    async def aclose(self) -> None:
        """Cancel the phase changes still scheduled."""
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def push_log(self, line: str | None) -> None:
        """Deliver a line (None ends the stream) to every follower."""
        for q in list(self.follow_queues):
            q.put_nowait(line)
