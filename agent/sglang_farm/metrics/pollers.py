"""I/O: the pollers behind the exporter, and the exporter itself.

Two background loops fill one immutable `MetricsState`: the GPU loop (NVML, or the
simulated GPUs of the demo; blocking calls in a thread) and the worker loop (each
serving worker's `/metrics` or `/v1/loads`, with a timeout). Every farm-view change
is folded in at once. A scrape only formats the latest state (`metrics.collectors`), so a
hung worker or GPU slows nothing but its own poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType
from typing import Any, Protocol

import structlog

from sglang_farm.control.farm_api import GpuMemory
from sglang_farm.farm_view import FarmView
from sglang_farm.gpus.nvml import choose_gpu_poller, read_ppid_map
from sglang_farm.gpus.simulated import FakeGpuPoller, process_bytes_for
from sglang_farm.gpus.snapshot import FleetSnapshot, GpuPoller, process_trees
from sglang_farm.host.keyguard import KeyGuard
from sglang_farm.metrics.collectors import MetricsState, ProbeStatus, build_registry
from sglang_farm.metrics.exporter import Exporter
from sglang_farm.sglang.argv import worker_api_key
from sglang_farm.sglang.health import LocalHttp
from sglang_farm.sglang.load import RecentAnswers, WorkerSample, WorkerStats, WorkerStatsTracker
from sglang_farm.sglang.stats import poll_worker
from sglang_farm.spec import FarmSpec
from sglang_farm.workers.phase_sets import SERVING_OR_DRAINING

log = structlog.get_logger("sglang_farm.metrics.pollers")


class PollWorker(Protocol):
    """How one worker is polled (`sglang.stats.poll_worker`; a test passes a fake)."""

    def __call__(
        self,
        client: LocalHttp,
        base_url: str,
        timeout: float,
        *,
        worker: int,
        known_version: str | None,
        api_key: str | None,
    ) -> Awaitable[WorkerSample]: ...


async def _after(delay: float, poll: Callable[[], Awaitable[WorkerSample]]) -> WorkerSample:
    """`poll()` after `delay`; made only then, so a loop cancelled during the delay (the
    agent stopping) leaves no coroutine that was never awaited."""
    await asyncio.sleep(delay)
    return await poll()


def make_gpu_poller(spec: FarmSpec) -> GpuPoller | None:
    count = max((g for w in spec.workers for g in w.gpus), default=-1) + 1
    return choose_gpu_poller(spec.metrics.gpu_source, count)


class MetricPollers:
    """Owns the GPU poller, the worker-stats poller and the exporter of one agent."""

    def __init__(
        self,
        config: Callable[[], FarmSpec],
        poller: GpuPoller | None,
        view: FarmView,
        *,
        on_fleet: Callable[[FleetSnapshot], None] | None = None,
        on_stats: Callable[[Mapping[int, WorkerStats]], None] | None = None,
        poll: PollWorker = poll_worker,
        read_ppids: Callable[[], Mapping[int, int]] = read_ppid_map,
        guard: KeyGuard | None = None,
    ) -> None:
        """`config`: the config in force (the agent's `spec`), read at every poll: a
        reload's workers, `[metrics]` intervals and API keys apply from the next poll on
        (issue 32, 4.1: the pollers kept the config they started with). `view`: the farm as
        it stands now; `on_view` keeps it current. `on_fleet` gets every GPU snapshot (the
        agent's GPU-health rules). `poll` polls one worker. `read_ppids`: every process's
        parent, read from /proc once per GPU poll for all workers (a test counts it).
        `guard`: a worker is polled only while its port is its own (`host.keyguard`: its
        API key goes to no other listener); None only where no key is sent (tests)."""
        self._config = config
        self._guard = guard
        self.poller = poller
        self._poll = poll
        self._read_ppids = read_ppids
        self._on_fleet = on_fleet
        self._on_stats = on_stats
        self._view = view
        self._state = MetricsState(snapshot_at=time.time(), farm=view)
        self.registry = build_registry(self.state)
        self.exporter: Exporter | None = None
        self._tracker = WorkerStatsTracker()
        self._stats: dict[int, WorkerStats] = {}
        self._probes: dict[str, ProbeStatus] = {}
        self._tasks: list[asyncio.Task[None]] = []

    def state(self) -> MetricsState:
        return self._state

    def _swap(self, **changes: Any) -> None:
        self._state = replace(self._state, snapshot_at=time.time(), **changes)

    async def start(self) -> None:
        # The listener is bound once: a reload's [metrics] listen applies at the next start.
        self.exporter = Exporter(self.registry, self.state, self._config().metrics.listen)
        if self.poller is not None:
            self._tasks.append(asyncio.create_task(self._gpu_loop(self.poller)))
        self._tasks.append(asyncio.create_task(self._worker_loop()))

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.exporter is not None:
            self.exporter.close()
        if self.poller is not None:
            self.poller.close()

    def on_view(self, view: FarmView) -> None:
        """The agent's observer: every new farm view is folded in at once."""
        self._view = view
        self._swap(farm=view)

    def gpu_memory(self) -> Sequence[GpuMemory]:
        fleet = self._state.fleet
        if fleet is None:
            return ()
        return tuple(
            GpuMemory(g.index, g.memory_used_bytes, g.memory_total_bytes, fleet.simulated)
            for g in fleet.gpus
            if g.memory_used_bytes is not None and g.memory_total_bytes is not None
        )

    def queue_depths(self) -> dict[int, float]:
        return {w: s.queued for w, s in self._state.workers.items() if s.queued is not None}

    def recent_answers(self) -> dict[int, RecentAnswers]:
        """Each serving worker's answers and 5xx of the last polls (issue 34 §2), where its
        SGLang counts them."""
        return {w: r for w, s in self._state.workers.items() if (r := s.recent) is not None}

    # ---- GPU loop ------------------------------------------------------------------

    async def _gpu_loop(self, poller: GpuPoller) -> None:
        while True:
            interval = self._config().metrics.gpu_poll_interval
            t0 = time.monotonic()
            try:
                pids = await asyncio.to_thread(self._worker_pids)
                if isinstance(poller, FakeGpuPoller):
                    self._assign_fake(poller, pids)
                fleet: FleetSnapshot = await asyncio.to_thread(poller.snapshot)
                ok = fleet.nvml_up
                # One swap per poll (each swap costs the next scrape a full re-format).
                self._probe("gpu", ok, time.monotonic() - t0, fleet=fleet, worker_pids=pids)
                if self._on_fleet is not None:
                    self._on_fleet(fleet)
            except Exception as exc:  # task root: a poller bug must not stop the exporter
                log.error("gpu_poll_failed", error=repr(exc))
                self._probe("gpu", False, time.monotonic() - t0)
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - t0)))

    def _worker_pids(self) -> dict[int, frozenset[int]]:
        """Each worker's process tree (main pid and descendants), from one read of /proc
        and one index of it for all workers."""
        view = self._view
        roots = {w.id: w.pid for w in view.workers if w.pid}
        if not roots:
            return {}
        return process_trees(roots, self._read_ppids())

    def _assign_fake(self, poller: FakeGpuPoller, pids: dict[int, frozenset[int]]) -> None:
        by_gpu: dict[int, set[int]] = {}
        sizes: dict[int, int] = {}
        for w in self._view.workers:  # the same farm `pids` was read from
            tree = pids.get(w.id, frozenset())
            # The simulated memory sits on one child (the scheduler), as SGLang's does.
            children = sorted(tree - {w.pid})
            holder = children[:1] or sorted(tree)[:1]
            by_gpu.setdefault(w.gpus[0], set()).update(holder)
            # Issue 31: as much as its --mem-fraction-static (the OOM ladder's) makes it.
            sizes.update(dict.fromkeys(holder, process_bytes_for(w.argv)))
        for gpu in range(len(by_gpu) and max(by_gpu) + 1):
            with contextlib.suppress(Exception):
                poller.assign(gpu, by_gpu.get(gpu, set()), sizes)

    # ---- worker loop ---------------------------------------------------------------

    async def _guarded_poll(
        self,
        client: LocalHttp,
        base_url: str,
        timeout: float,
        *,
        worker: int,
        known_version: str | None,
        api_key: str | None,
    ) -> WorkerSample:
        """`_poll`, once the listener on the worker's port is shown to be the worker's
        own; else a failed sample saying whose it is, and nothing sent there."""
        if self._guard is not None:
            why = await self._guard.refusal(worker, base_url)
            if why is not None:
                return WorkerSample(worker=worker, taken_at=time.time(), ok=False, error=why)
        return await self._poll(
            client, base_url, timeout, worker=worker, known_version=known_version, api_key=api_key
        )

    async def _worker_loop(self) -> None:
        client = LocalHttp()  # plain HTTP to local workers: a tenth of httpx's CPU per GET
        while True:
            spec = self._config()
            interval = spec.metrics.worker_poll_interval
            timeout = spec.metrics.worker_poll_timeout
            t0 = time.monotonic()
            view = self._view
            serving = [w for w in view.workers if w.phase in SERVING_OR_DRAINING]
            # Spread over half the interval, not all at once: a burst of 64 polls held the
            # event loop for tens of ms, the tail of every `status` and scrape landing in it.
            gap = interval / 2 / max(1, len(serving))
            samples = await asyncio.gather(
                *(
                    _after(
                        k * gap,
                        functools.partial(
                            self._guarded_poll,
                            client,
                            w.base_url,
                            timeout,
                            worker=w.id,
                            known_version=self._stats[w.id].sglang_version
                            if w.id in self._stats
                            else None,
                            api_key=worker_api_key(spec, w.id),
                        ),
                    )
                    for k, w in enumerate(serving)
                )
            )
            now = time.time()
            for sample in samples:
                self._stats[sample.worker] = self._tracker.update(
                    self._stats.get(sample.worker), sample, now
                )
            for wid in [w for w in self._stats if w not in {s.id for s in serving}]:
                del self._stats[wid]  # not serving: no figures rather than old ones
            self._probe(
                "workers",
                all(s.ok for s in samples),
                time.monotonic() - t0,
                workers=MappingProxyType(dict(self._stats)),
            )
            if self._on_stats is not None:
                self._on_stats(dict(self._stats))
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - t0)))

    def _probe(self, source: str, ok: bool, duration: float, **changes: Any) -> None:
        """Record a poll's verdict, swapping it in with the poll's own `changes` at once."""
        prev = self._probes.get(source)
        last = time.time() if ok else (prev.last_success_at if prev else None)
        self._probes[source] = ProbeStatus(ok, duration, last)
        if "worker_pids" in changes:
            changes["worker_pids"] = MappingProxyType(changes["worker_pids"])
        self._swap(probes=MappingProxyType(dict(self._probes)), **changes)
