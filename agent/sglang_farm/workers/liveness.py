"""I/O: when each worker's health is probed, and what a probe's answer (or silence) means.

Readiness while loading: once the worker's process is launched, its readiness route
(`/ready` where SGLang has it, else `/health`: `sglang/ready_route`) is polled every
`startup.poll_interval` until it answers 200, the runtime agrees
(`Runtime.confirm_ready`) and the socket listening on the worker's port is held by the
worker's own processes (`portowner`); then `HealthPassed`. Any local user can bind the
port while SGLang loads (it binds only after loading): a listener of another process or
another user is reported as `PortTaken`; one that cannot be traced at all keeps the
worker loading.

Liveness once ready: every `health.period` the worker must have answered its probe. A
probe still outstanding when the period ends counts as a failed beat (the request is left
to finish, never duplicated: SGLang's `/health` runs a generation and piles up when
polled concurrently, sgl-project/sglang#35884). So a hung worker is caught within
`failure_threshold x period` plus at most one period, however long `health.timeout` is.
A beat that passed is checked against the port's listener too (cheap while it is the
socket already verified): a listener that is no longer the worker's is `PortTaken`.

The supervisor decides what failed beats mean; this module only schedules probes and
reports their results as events.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection
from typing import Any

import structlog

from sglang_farm.host.listeners import OwnerKind, Ownership, connect_host
from sglang_farm.host.portowner import PortOwner
from sglang_farm.runtime import Runtime
from sglang_farm.sglang.health import Prober, ProbeResult
from sglang_farm.sglang.ready_route import next_route, readiness_routes
from sglang_farm.spec import FarmSpec
from sglang_farm.workers.events import Event, HealthFailed, HealthPassed, PortTaken
from sglang_farm.workers.phase import Phase
from sglang_farm.workers.phase_sets import SERVING
from sglang_farm.workers.records import WorkerState

log = structlog.get_logger("sglang_farm.workers.liveness")


class LivenessWatcher:
    """Probes one worker for as long as it is in the farm (a task per worker)."""

    def __init__(
        self,
        worker: int,
        *,
        spec: Callable[[], FarmSpec],
        state: Callable[[int], WorkerState | None],
        prober: Prober,
        port_owner: PortOwner,
        runtime: Runtime,
        feed: Callable[[int, Event], None],
        wait_change: Callable[[int, float | None], Awaitable[None]],
        clock: Callable[[], float],
    ) -> None:
        self.worker = worker
        self._spec = spec
        self._state = state
        self._prober = prober
        self._port_owner = port_owner
        self._said_unseen: float | None = None  # the launch an unseen listener was logged for
        self._runtime = runtime
        self._feed = feed
        self._wait_change = wait_change
        self._clock = clock
        self._pending: asyncio.Task[ProbeResult] | None = None
        self._counted = False
        self._sent_at = 0.0
        # Which of the readiness routes this launch is asked on (a 404 moves it on).
        self._route_launch: float | None = None
        self._route_at = 0

    async def run(self) -> None:
        try:
            while True:
                s = self._state(self.worker)
                if s is None:
                    return  # removed from the farm by a reload
                if s.phase is Phase.STARTING:
                    await self._readiness(s)
                elif s.phase in SERVING:
                    await self._liveness(s)
                else:
                    await self._wait_change(self.worker, None)
        finally:
            self._drop_pending()  # never leave a probe running against a stale address

    def _drop_pending(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
        self._pending = None

    def _url(self) -> str:
        # Read each time: a reload may change [health] or the worker's address.
        spec = self._spec()
        return spec.worker(self.worker).base_url + spec.health.path

    def _same_process(self, launched: float | None, phases: Collection[Phase]) -> bool:
        cur = self._state(self.worker)
        return cur is not None and cur.launched_at == launched and cur.phase in phases

    async def _readiness(self, s: WorkerState) -> None:
        self._drop_pending()  # a probe of the previous process; its answer is moot
        spec = self._spec()
        if s.pid is None:
            # Not launched yet (waiting for its port, or for systemd): whatever answers on
            # that port now is not this worker.
            await self._wait_change(self.worker, spec.startup.poll_interval)
            return
        routes = readiness_routes(spec.health.ready_path, spec.health.path)
        if self._route_launch != s.launched_at:
            self._route_launch, self._route_at = s.launched_at, 0
        at = min(self._route_at, len(routes) - 1)
        w = spec.worker(self.worker)
        res = await self._prober.probe(w.base_url + routes[at], spec.health.timeout)
        moved = next_route(routes, at, res.status)
        if moved != at and self._same_process(s.launched_at, (Phase.STARTING,)):
            self._route_at = moved
            log.info(
                "worker_ready_route",
                worker=self.worker,
                gpus=list(w.gpus),
                route=routes[moved],
                why=f"{routes[at]} answered 404: this SGLang has no {routes[at]} route "
                f"(SGLang before 0.5.20); readiness is asked on {routes[moved]}",
            )
            return  # ask the next route now
        if res.ok and self._same_process(s.launched_at, (Phase.STARTING,)):
            # Whatever answered must be the worker itself, not a process that bound its
            # port first (SGLang binds only after loading). Asked before the runtime's
            # confirmation, which may wait for a readiness gate the squatter never passes.
            own = await self._ownership(fresh=True)
            if not self._same_process(s.launched_at, (Phase.STARTING,)):
                return
            if own.kind is OwnerKind.OURS:
                ok = await self._runtime.confirm_ready(self.worker)
                if ok and self._same_process(s.launched_at, (Phase.STARTING,)):
                    self._feed(self.worker, HealthPassed())
                    return
            elif own.kind is OwnerKind.FOREIGN:
                self._feed(self.worker, PortTaken(own.port, own.holder()))
                return
            elif self._said_unseen != s.launched_at:
                self._said_unseen = s.launched_at
                log.warning(
                    "worker_port_owner_unknown",
                    worker=self.worker,
                    port=own.port,
                    holder=own.holder() if own.kind is OwnerKind.UNSEEN else None,
                    why=f"/health answered but the listener is {own.kind}: not proven the "
                    "worker's own, so it is not ready yet",
                )
        await self._wait_change(self.worker, spec.startup.poll_interval)

    async def _ownership(self, *, fresh: bool = False) -> Ownership:
        w = self._spec().worker(self.worker)
        return await self._port_owner.check(
            connect_host(w.host),
            w.port,
            lambda: self._runtime.worker_pids(self.worker),
            fresh=fresh,
            whose=self.worker,
        )

    async def _liveness(self, s: WorkerState) -> None:
        hp = self._spec().health
        if self._pending is None:
            self._pending = asyncio.create_task(self._prober.probe(self._url(), hp.timeout))
            self._counted = False  # this probe has not been counted as a missed beat yet
            self._sent_at = self._clock()
        started = self._clock()
        done: set[Any]
        done, _ = await asyncio.wait({self._pending}, timeout=hp.period)
        if not self._same_process(s.launched_at, SERVING):
            return
        if self._runtime.exit_pending(self.worker):
            # Its exit is known, only its last log lines are awaited: a failed probe now
            # says nothing about a hang.
            await self._wait_change(self.worker, hp.period)
            return
        if not done:
            self._feed(
                self.worker, HealthFailed(f"no answer within {hp.period:g} s", self._sent_at)
            )
            self._counted = True
            return
        res = self._pending.result()
        self._pending = None
        if self._counted and not res.ok:
            return  # its silence was counted already, beat by beat: not twice; probe again now
        if res.local_error:
            # The agent's own trouble (out of fds, no buffers): says nothing about the
            # worker. The beat is skipped, never counted as the worker's failure.
            log.warning(
                "probe_local_error",
                worker=self.worker,
                detail=res.detail,
                hint="the agent is short of a resource (see LimitNOFILE); the worker is not blamed",
            )
        elif res.ok:
            ev = await self._beat_owner()
            if self._same_process(s.launched_at, SERVING):
                self._feed(self.worker, ev)
        else:
            self._feed(self.worker, HealthFailed(res.detail, self._sent_at))
        rest = hp.period - (self._clock() - started)
        if rest > 0:
            await self._wait_change(self.worker, rest)

    async def _beat_owner(self) -> Event:
        """A passed beat, judged by whose socket answered it (the worker's, or not)."""
        own = await self._ownership()
        if own.kind is OwnerKind.OURS:
            return HealthPassed()
        if own.kind is OwnerKind.FOREIGN:
            return PortTaken(own.port, own.holder())
        # A listener no process of its own holds (or none at all, after an answer):
        # the beat proves nothing of the worker; a failed beat, as a silence would be.
        what = own.holder() if own.kind is OwnerKind.UNSEEN else "no listener"
        return HealthFailed(f"port {own.port}: {what}, not the worker's", self._sent_at)
