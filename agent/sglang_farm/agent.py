"""I/O: the agent: the event pump between the runtime and probes and the pure supervisor.

Events flow one way: the runtime and the liveness watchers report into the supervisor
(`Supervisor.handle`); the actions it returns are carried out here (a launch through the
`Launcher`, a stop through the runtime) and its notes are logged. After every change a
fresh immutable `FarmView` is built (`farm_view.build_view`) and swapped in, which the
control socket and the exporter read without ever waiting on a worker; what must
survive an agent restart goes to the `StateStore`.

Nothing here decides: which workers stay held on adoption, the waves of a rolling
restart, the OOM step spreading to the farm and a reload's effects are the supervisor's
(and `reload_plan`'s) decisions. Nothing here asks which runtime it drives either: what
differs is a method of the `Runtime` protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from sglang_farm import xid
from sglang_farm.canary.driver import CanaryDriver, Gate, Scrape  # issue 23
from sglang_farm.canary.driver import Host as CanaryHost  # issue 23
from sglang_farm.classify import LogClassifier
from sglang_farm.control.farm_api import GpuMemory, ReloadResult
from sglang_farm.drain import HttpInFlight, InFlight, watch_drain
from sglang_farm.errors import ConfigError
from sglang_farm.failures import Failure, RestartReason
from sglang_farm.farm_view import FarmView, build_view
from sglang_farm.gateway.port import Gateway
from sglang_farm.gateway_sync import MembershipSync
from sglang_farm.gpu_health import gpu_faults, pending_remaps
from sglang_farm.gpu_snapshot import FleetSnapshot
from sglang_farm.health import HttpProber, Prober
from sglang_farm.ladder import next_step
from sglang_farm.launcher import Launcher, Preflight
from sglang_farm.liveness import LivenessWatcher
from sglang_farm.paths import DEFAULT_CONFIG_PATH
from sglang_farm.phase import Phase
from sglang_farm.portowner import PortOwner, ProcPortOwner
from sglang_farm.ports import PortState, port_state
from sglang_farm.progress import judge
from sglang_farm.reload_plan import (
    ModelChange,
    Refused,
    model_change,
    plan_reload,
    reload_effects,
    stage_refused,
)
from sglang_farm.runtime import Emit, Exited, LogLine, Runtime, RuntimeEvent, Started
from sglang_farm.sglang_argv import Command
from sglang_farm.spec import FarmSpec
from sglang_farm.staging.driver import StageDriver
from sglang_farm.staging.failure import StageError
from sglang_farm.staging.installed import process_started
from sglang_farm.staging.runner import Stager, thread_stager
from sglang_farm.staging.stale import loading, old_copy_removal
from sglang_farm.staging.state import StageResult, StagingView
from sglang_farm.state import StateStore
from sglang_farm.supervisor import (
    Action,
    Drain,
    Event,
    FailureSeen,
    GpuFailing,
    Launch,
    Launched,
    Note,
    Policy,
    ProcessExited,
    ProgressSeen,
    ReleaseRequested,
    StopRequested,
    Supervisor,
    Terminate,
    Wedged,
    WorkerState,
)
from sglang_farm.worker_commands import ladder_changes, worker_command, worker_commands
from sglang_farm.worker_load import WorkerStats

log = structlog.get_logger("sglang_farm.agent")

_WARNINGS = frozenset(
    {
        "worker_failed",
        "worker_gave_up",
        "canary_failed",
        "rollout_halted",
        "health_failed",
        "worker_terminating",
    }
)
TICK_MAX_S = 5.0  # the longest the time-based rules go unevaluated (a safety net)


@dataclass(frozen=True, slots=True)
class FarmStats:
    """The pollers' latest figures the control socket shows (never blocks)."""

    gpu_memory: Callable[[], Sequence[GpuMemory]] = lambda: ()
    queue_depths: Callable[[], Mapping[int, float]] = dict


@dataclass(frozen=True, slots=True)
class AgentHooks:
    """What the agent is wired to, given at construction (nothing is set afterwards).

    `gateway`: membership follows readiness there (`gateway_sync`); planned stops drain.
    `preflight(spec, worker)`: the doctor's blocking failures for a worker (empty: may
    start). `compute_caps`: compute capability per GPU index (attention_backend = "auto").
    `observers`: called with every new farm view. `stats`: the pollers' figures.
    """

    prober: Prober | None = None
    # With [gateway]: the gateway workers are registered with, and how a draining
    # worker's requests in flight are counted.
    gateway: Gateway | None = None
    in_flight: InFlight | None = None
    preflight: Preflight | None = None
    # Re-gather the doctor's facts for this config (a reload, an operator's start): what
    # a fixed model path or a new flag changes is judged anew, not from the start's report.
    refresh_preflight: Callable[[FarmSpec], Awaitable[None]] | None = None
    compute_caps: Mapping[int, tuple[int, int]] = field(default_factory=dict)
    # Re-check a quarantined GPU through NVML before its worker is released: the problems
    # that keep it set aside (empty: clear).
    check_gpu: Callable[[int], Awaitable[list[str]]] | None = None
    # Issue 23: how the canary analysis reads a /metrics (None: HTTP; tests: synthetic).
    canary_scrape: Scrape | None = None
    canary_gate: Gate | None = None  # and how it runs the eval gate (None: evalrun.run_gate)
    observers: Sequence[Callable[[FarmView], None]] = ()
    stats: FarmStats = FarmStats()
    port_state: Callable[[str, int], PortState] = port_state
    # Whose socket listens on a worker's port: only the worker's own makes it ready
    # (None: `portowner.ProcPortOwner`, over /proc).
    port_owner: PortOwner | None = None
    # [model]: how the model is staged before the rollout (None: `stage_model` in a thread).
    stager: Stager | None = None
    # When a worker's process started (pid -> wall time; None: unknown): an adopted worker
    # that started before its model copy was installed is restarted onto it.
    process_started: Callable[[int], float | None] = process_started


def _xid_detail(code: int) -> str:
    """What a quarantine's reason says about XID `code`: NVIDIA's meaning and action."""
    info = xid.classify(code)
    return f"{info.meaning}; NVIDIA's action: {info.action_text}"


class Agent:
    """One farm: its supervisor, runtime, probes and views. Implements `farm_api.FarmOps`."""

    def __init__(
        self,
        spec: FarmSpec,
        runtime_factory: Callable[[Emit], Runtime],
        *,
        config_loader: Callable[[], FarmSpec] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        hooks: AgentHooks = AgentHooks(),
    ) -> None:
        # Issue 23: the canary analysis; a restarted agent may start on the last accepted
        # config instead of the file's (its change rejected, or not judged yet).
        self._canary = CanaryDriver(
            spec, scrape=hooks.canary_scrape, caps=hooks.compute_caps, gate=hooks.canary_gate
        )
        spec = self._canary.spec
        self._spec = spec
        self._config_loader = config_loader
        self._clock = clock
        self._wall = wall
        self._hooks = hooks
        self._queue: asyncio.Queue[RuntimeEvent] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self.runtime = runtime_factory(self._emit)
        self.sup = Supervisor(spec.worker_ids, self._policy(spec))
        self._prober = hooks.prober or HttpProber()
        self._port_owner = hooks.port_owner or ProcPortOwner()
        self._launcher = Launcher(
            self,
            self.runtime,
            clock=clock,
            preflight=hooks.preflight,
            port_state=hooks.port_state,
            log_for=self._bind,
            port_owner=self._port_owner,
        )
        self._store = StateStore(Path(spec.farm.state_dir) / "state.json", clock, wall)
        self._sync = (
            MembershipSync(
                hooks.gateway,
                spec=lambda: self._spec,
                # Issue 23: a canary waiting for its eval gate is kept out of the gateway.
                states=lambda: self._canary.gateway_states(self.sup.workers),
                feed=self.feed,
                on_status=self._gateway_changed,
            )
            if hooks.gateway is not None
            else None
        )
        self._in_flight = hooks.in_flight or HttpInFlight()
        self._last_fleet: FleetSnapshot | None = None
        self._last_change: dict[int, float | None] = {}
        self._classifiers: dict[int, LogClassifier] = {}
        self._changed: dict[int, asyncio.Event] = {w: asyncio.Event() for w in spec.worker_ids}
        self._any_change = asyncio.Condition()
        self._followers: dict[int, set[asyncio.Queue[str]]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._worker_tasks: dict[int, asyncio.Task[None]] = {}
        self._started_at = wall()
        self._tick_wake = asyncio.Event()
        # State-changing commands wait for this: restore and adoption first (a stop issued
        # before would be saved over the remembered state), and one reload at a time.
        self._startup: str | None = "the agent is restoring its state and adopting running workers"
        self._changes = asyncio.Lock()
        self._state_dirty = asyncio.Event()
        self._last_keys: dict[int, tuple[Phase, int | None, float | None]] = {}
        self._last_refresh: object = None
        self._stages = StageDriver(
            spec,
            hooks.stager or thread_stager,
            on_change=self._stage_changed,
            clock=clock,
            wall=wall,
            process_started=hooks.process_started,
        )
        # The workers the rollout starts once a stage succeeds (a failed stage holds them).
        self._held_by_stage: list[int] | None = None
        # Remembered at once (one small file): status shows the farm's history while the
        # agent adopts, never a blank farm.
        self._remembered = self._store.restore(self.sup, {w.id: w.gpus for w in spec.workers})
        self._canary.attach(self._canary_host())  # issue 23
        self._view = self._build_view()

    # ---- wiring --------------------------------------------------------------------------

    def _canary_host(self) -> CanaryHost:
        """Issue 23: what the canary analysis (canary/driver.py) may do to the farm."""

        def set_spec(spec: FarmSpec) -> None:  # a rollback: the accepted config in force
            self._spec = spec
            self.sup.reconfigure(self._policy(spec), (), ())

        def refresh() -> None:
            self._last_refresh = None
            self._refresh()

        return CanaryHost(
            spec=lambda: self._spec,
            set_spec=set_spec,
            sup=self.sup,
            apply=self._apply_actions,
            spawn=self.spawn,
            refresh=refresh,
            reload=self.reload,
            startup_done=lambda: self._startup is None,
            clock=self._clock,
            wall=self._wall,
            gateway=self._spec.gateway.enabled,
        )

    @property
    def spec(self) -> FarmSpec:
        return self._spec

    @staticmethod
    def _policy(spec: FarmSpec) -> Policy:
        steps = spec.oom.steps

        def oom_next(current: int, failure: Failure) -> int | None:
            return next_step(current, steps, failure)

        return Policy.from_spec(spec, oom_next)

    def _emit(self, event: RuntimeEvent) -> None:
        """Runtime callback; safe from any thread."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            log.error("agent_task_failed", error=repr(exc), exc_info=exc)

    def _bind(self, worker: int) -> structlog.typing.FilteringBoundLogger:
        w = self._spec.worker(worker)
        gpu = w.gpus[0] if len(w.gpus) == 1 else ",".join(map(str, w.gpus))
        bound: structlog.typing.FilteringBoundLogger = log.bind(worker=worker, gpu=gpu)
        return bound

    def worker_state(self, worker: int) -> WorkerState | None:
        return self.sup.workers.get(worker)

    # ---- the loop ------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event, *, ready: Callable[[], object] | None = None) -> None:
        """Adopt or start the farm, supervise until `stop` is set, then shut down."""
        remembered = self._remembered
        running = await self.runtime.adopt(configured=self._spec.worker_ids)
        adoption = self.sup.adopt(
            {w: r.pid for w, r in running.items()},
            remembered,
            self._clock(),
            serving={w for w, r in running.items() if r.active},
        )
        for wid in adoption.adopted:
            # An active unit passed its readiness gate: its OOMs are serving-time ones.
            self._classifiers[wid] = LogClassifier(serving=running[wid].active)
            self._bind(wid).info("worker_adopted", pid=running[wid].pid, active=running[wid].active)
        # Secrets changed while the agent was down (the argv does not show them).
        resecreted = await self.runtime.prepare(self._spec, self.commands())
        if self._sync is not None:
            self._sync.start()
        self.spawn(self._state_writer())
        pump = self.spawn(self._pump())
        ticker = self.spawn(self._ticker())
        for wid in self._spec.worker_ids:
            self._worker_tasks[wid] = self.spawn(self._watcher(wid).run())
        log.info(
            "farm_starting",
            farm=self._spec.farm.name,
            runtime=self.runtime.name,
            workers=len(self._spec.workers),
            canary=self._spec.startup.canary,
            parallel=self._spec.startup.parallel,
        )
        self._apply_actions(list(adoption.actions))
        start = [w for w in self._spec.worker_ids if w not in adoption.held]
        drifted = sorted(
            w
            for w, r in running.items()
            if w in adoption.adopted
            and (w in resecreted or (r.argv is not None and r.argv != self.command_for(w).argv))
        )
        if self._spec.model is None:
            self._begin_rollout(start, drifted)
            self._startup = None
        else:
            # The rollout waits on the stage; the agent is up meanwhile (status shows the
            # progress), so READY comes first: a long copy does not run into the start timeout.
            self._startup = "the agent is staging the model first (farmctl status shows it)"
            self.spawn(self._stage_then_start(start, drifted))
        if ready is not None:
            ready()
        await stop.wait()
        log.info("farm_stopping", runtime=self.runtime.name)
        self._stages.cancel.set()  # the copy under way stops at once
        if not self.runtime.workers_outlive_agent:
            await self._stop_all()
        for t in (ticker, *self._worker_tasks.values()):
            t.cancel()
        pump.cancel()
        for t in list(self._tasks):
            t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._sync is not None:
            await self._sync.close()
        await asyncio.to_thread(self._store.save, dict(self.sup.workers))  # the last word
        await self.runtime.close()
        await self._prober.aclose()
        log.info("farm_stopped")

    def _begin_rollout(self, start: Sequence[int], drifted: Sequence[int]) -> None:
        # fresh=False: a restarted agent keeps each worker's remembered back-off position.
        self._apply_actions(self.sup.start(list(start), self._clock(), fresh=False))
        if drifted:
            # Adopted, but started with another command line than the config renders now
            # (a config edited while the agent was down), or loaded a model copy that has
            # been replaced since: restarted in waves, drained.
            log.warning("workers_drifted", workers=list(drifted))
            self._apply_actions(
                self.sup.restart_rolling(list(drifted), RestartReason.CONFIG, self._clock())
            )

    # ---- model staging (docs/staging.md) ---------------------------------------------------

    @property
    def _staging(self) -> StagingView | None:
        return self._stages.view

    def _stage_changed(self) -> None:
        self._last_refresh = None
        self._refresh()

    def _loaded(self) -> list[int]:
        return loading(self.sup.workers)

    async def _stage_then_start(self, start: Sequence[int], drifted: Sequence[int]) -> None:
        """At agent start: stage, then the rollout; a failed stage starts no worker."""
        try:
            loaded = self._loaded()  # adopted workers still running
            try:
                result = await self._stages.stage(self._spec, keep_old=bool(loaded))
            except StageError:
                self._held_by_stage = list(start)
                log.warning("rollout_waits_on_stage", workers=list(start))
                return
            drifted = sorted({*drifted, *await self._on_old_copy(result)})
            # The workers of the config in force now (never one a reload has removed).
            start = [w for w in start if w in self.sup.workers]
            drifted = [w for w in drifted if w in self.sup.workers]
            if self._hooks.refresh_preflight is not None:
                # The doctor looked before the model was in place: it judges the copy now.
                await self._hooks.refresh_preflight(self._spec)
            self._begin_rollout(start, drifted)
            self._after_swap(result)
        finally:
            self._startup = None

    async def _on_old_copy(self, result: StageResult) -> list[int]:
        """Running workers that load a copy other than the one now at model_path."""
        pids = {w: self.sup.workers[w].pid for w in self._loaded()}
        return await self._stages.on_old_copy(result, pids)

    def _after_swap(self, result: StageResult) -> None:
        """The previous copy goes once no worker loads from it (after the rolling restart)."""
        if (action := old_copy_removal(result, self._spec)) is not None:
            self.spawn(self._stages.remove_old_copy(action, self._rolled))

    async def _rolled(self, timeout: float) -> bool:
        return await self._wait_until(lambda: not self.sup.rolling, timeout)

    def _watcher(self, worker: int) -> LivenessWatcher:
        return LivenessWatcher(
            worker,
            spec=lambda: self._spec,
            state=self.worker_state,
            prober=self._prober,
            port_owner=self._port_owner,
            runtime=self.runtime,
            feed=self.feed,
            wait_change=self._wait_change,
            clock=self._clock,
        )

    async def _stop_all(self) -> None:
        ids = [w for w, s in self.sup.workers.items() if s.phase is not Phase.STOPPED]
        for wid in ids:
            self.feed(wid, StopRequested())
        # Stops run concurrently (each drained first when there is a gateway); wait until
        # every process tree is gone (bounded by the drain budget and stop_timeout).
        drain = self._spec.gateway.drain_timeout if self._spec.gateway.enabled else 0.0
        deadline = self._clock() + drain + self._spec.restart.stop_timeout + 10
        while self._clock() < deadline and any(
            s.phase in (Phase.STOPPING, Phase.DRAINING) for s in self.sup.workers.values()
        ):
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.1):
                    ev = await self._queue.get()
                self._on_runtime_event(ev)

    async def _pump(self) -> None:
        while True:
            ev = await self._queue.get()
            self._on_runtime_event(ev)

    async def _ticker(self) -> None:
        """Time-based rules (back-off end, load deadline, wave timeout), evaluated when due.

        Sleeps until the supervisor's next deadline (or until an action may have set a new
        one), so an idle farm wakes this loop every TICK_MAX_S at most.
        """
        while True:
            now = self._clock()
            due = self.sup.next_deadline(now)
            wait = TICK_MAX_S if due is None else min(TICK_MAX_S, max(0.0, due - now))
            self._tick_wake.clear()
            with contextlib.suppress(TimeoutError):
                # asyncio.timeout, not wait_for: in 3.11 wait_for can swallow a cancellation
                # that races with the event, and this loop would never end.
                async with asyncio.timeout(wait):
                    await self._tick_wake.wait()
            self._apply_actions(self.sup.tick(self._clock()), wake=False)

    def _on_runtime_event(self, ev: RuntimeEvent) -> None:
        if ev.worker not in self.sup.workers:
            return
        match ev:
            case Started(worker=w, pid=pid):
                if self.sup.workers[w].phase is Phase.STARTING:
                    self.feed(w, Launched(pid))
            case LogLine(worker=w, text=text):
                for q in self._followers.get(w, ()):
                    with contextlib.suppress(asyncio.QueueFull):
                        q.put_nowait(text)
                failure = self._classifier(w).feed(text)
                if failure is not None:
                    self._bind(w).warning(
                        "worker_failure_seen", kind=str(failure.kind), summary=failure.summary
                    )
                    self.feed(w, FailureSeen(failure))
            case Exited(worker=w):
                failure = self._classifier(w).finish(ev.status, ev.result)
                self._classifiers.pop(w, None)
                self._bind(w).info(
                    "worker_exited",
                    status=ev.status,
                    result=ev.result,
                    failure=str(failure.kind) if failure else None,
                )
                self.feed(w, ProcessExited(ev.status, failure))

    def _classifier(self, worker: int) -> LogClassifier:
        c = self._classifiers.get(worker)
        if c is None:
            c = self._classifiers[worker] = LogClassifier()
        return c

    def feed(self, worker: int, event: Event) -> None:
        """One event about one worker into the supervisor; its actions carried out."""
        self._apply_actions(self.sup.handle(worker, event, self._clock()))

    def tick(self) -> None:
        """Evaluate the time-based rules now (the ticker does this when one is due)."""
        self._apply_actions(self.sup.tick(self._clock()))

    def _apply_actions(self, actions: list[Action], *, wake: bool = True) -> None:
        for a in actions:
            match a:
                case Launch(worker=w):
                    self._before_launch(w)
                    self.spawn(self._launcher.launch(w))
                case Terminate(worker=w):
                    self.spawn(self.runtime.stop(w, self._spec.restart.stop_timeout))
                case Drain(worker=w):
                    self.spawn(self._watch_drain(w))
                case Note(event=event, fields=fields):
                    self._log_note(event, dict(fields))
        if wake:
            self._tick_wake.set()  # a new back-off or load deadline may now be the nearest
        self._refresh()

    async def _watch_drain(self, worker: int) -> None:
        sync = self._sync
        await watch_drain(
            worker,
            state=self.worker_state,
            gateway_routes_nothing=lambda: sync is None or not sync.up,
            in_flight=self._in_flight,
            base_url=lambda: self._spec.worker(worker).base_url,
            feed=self.feed,
        )

    # ---- GPU health -----------------------------------------------------------------------

    def observe_fleet(self, fleet: FleetSnapshot) -> None:
        """The NVML poller's latest snapshot: set aside the workers whose GPU is failing.

        Which faults count is `gpu_health`'s (pure) decision over NVIDIA's XID catalog;
        only the workers on the failing GPU are touched, never the rest of the farm.
        """
        faults = gpu_faults(
            self._last_fleet, fleet, quarantines=xid.quarantines, describe=_xid_detail
        )
        self._last_fleet = fleet
        remaps = pending_remaps(fleet)
        for wid, s in list(self.sup.workers.items()):
            gpus = self._spec.worker(wid).gpus
            fault = next((f for f in faults if f.gpu in gpus), None)
            if fault is not None:
                self.feed(wid, GpuFailing(fault.gpu, fault.reason, fault.detail))
                continue
            remapped = next((g for g in gpus if g in remaps), None)
            if remapped is not None and s.phase in (Phase.PENDING, Phase.BACKOFF):
                # At a (re)start: a GPU with row remaps pending needs a reset first.
                self.feed(
                    wid,
                    GpuFailing(
                        remapped,
                        "pending row remaps",
                        "NVML reports row remaps pending: reset the GPU before it is used",
                    ),
                )

    def observe_stats(self, stats: Mapping[int, WorkerStats]) -> None:
        """The worker pollers' latest figures: progress excuses a slow /health (busy); no
        progress with requests running and an idle GPU restarts the worker (wedged)."""
        now = self._wall()
        for wid, st in stats.items():
            s = self.sup.workers.get(wid)
            if s is None or wid not in self._spec.worker_ids:
                continue
            verdict = judge(
                self._last_change.get(wid),
                st,
                gpu_util=self._gpu_util(wid),
                stall_window=self._spec.health.stall_window,
                now=now,
            )
            self._last_change[wid] = st.changed_at
            if verdict.progressed:
                self.feed(wid, ProgressSeen())
            if verdict.wedged is not None and s.phase in (Phase.READY, Phase.UNHEALTHY):
                self.feed(wid, Wedged(verdict.wedged))

    def _gpu_util(self, worker: int) -> float | None:
        """The busiest of the worker's GPUs, per the last NVML snapshot (None: unknown)."""
        fleet = self._last_fleet
        if fleet is None or not fleet.nvml_up or fleet.simulated:
            return None
        utils = [
            g.utilization_gpu_ratio
            for i in self._spec.worker(worker).gpus
            if (g := fleet.gpu(i)) is not None and g.utilization_gpu_ratio is not None
        ]
        return max(utils) if utils else None

    async def release_gpu(self, gpu: int) -> list[str]:
        """Start the workers quarantined on `gpu` again, once NVML says it is clear.

        Returns what keeps it set aside (its quarantine then stays); empty when released.
        """
        held = [
            w
            for w, s in self.sup.workers.items()
            if s.phase is Phase.QUARANTINED and s.quarantine is not None and s.quarantine.gpu == gpu
        ]
        if not held:
            # A worker a reload moved onto `gpu` keeps a quarantine naming its old GPU.
            moved = [
                w
                for w, s in self.sup.workers.items()
                if s.phase is Phase.QUARANTINED and gpu in self._spec.worker(w).gpus
            ]
            return [f"no worker is quarantined on GPU {gpu}"] + [
                f"worker {w} uses GPU {gpu} and is quarantined for another GPU: release it "
                f"with farmctl release-gpu --worker {w}"
                for w in moved
            ]
        return await self._release(held, [gpu])

    async def release_worker(self, worker: int) -> list[str]:
        """Start `worker` again out of its quarantine, whichever GPU the quarantine names,
        once NVML says each GPU it uses now is clear (a reload may have moved it)."""
        s = self.sup.workers[worker]
        if s.phase is not Phase.QUARANTINED:
            return [f"worker {worker} is not quarantined (it is {s.phase}): nothing to release"]
        return await self._release([worker], self._spec.worker(worker).gpus)

    async def _release(self, held: Sequence[int], gpus: Sequence[int]) -> list[str]:
        if self._hooks.check_gpu is None:
            return ["this agent has no NVML to check the GPU with ([metrics] gpu_source)"]
        problems = [p for g in gpus for p in await self._hooks.check_gpu(g)]
        if problems:
            log.warning(
                "gpu_release_refused",
                gpu=gpus[0] if len(gpus) == 1 else ",".join(map(str, gpus)),
                workers=list(held),
                problems=problems,
            )
            return problems
        async with self._changes:
            for wid in held:
                self.feed(wid, ReleaseRequested())
        return []

    def _gateway_changed(self) -> None:
        """The gateway went up or down: the view (status, metrics) says so at once."""
        self._last_refresh = None
        self._refresh()

    def _before_launch(self, worker: int) -> None:
        """A new process: a fresh log classifier, and the OOM-ladder flags it runs with."""
        self._classifiers[worker] = LogClassifier()
        for ch in ladder_changes(self._spec, worker, self._oom_step(worker)):
            self._bind(worker).warning(
                "oom_ladder_flag", flag=ch.flag, old=ch.old, new=ch.new, step=ch.step_name
            )

    def _log_note(self, event: str, fields: dict[str, object]) -> None:
        if event == "rollout_done":
            fields.update(self._ready_line(fields["ready"], fields["workers"]))
        wid = fields.pop("worker", None)
        logger = self._bind(wid) if isinstance(wid, int) and wid in self.sup.workers else log
        level = "warning" if event in _WARNINGS else "info"
        getattr(logger, level)(event, **fields)

    def _ready_line(self, ready: object, workers: object) -> dict[str, object]:
        """What the rollout's end says beside its counts: the farm, the one URL users call,
        and the command to try next, as one line a person reads (`summary`)."""
        spec = self._spec
        front = self._sync.gateway_url if self._sync is not None else None
        config = "" if spec.source == DEFAULT_CONFIG_PATH else f" --config {spec.source}"
        try_next = f"farmctl{config} status"
        door = f"front door {front}" if front else "no gateway: farmctl endpoints lists workers"
        return {
            "farm": spec.farm.name,
            "front_door": front,
            "next": try_next,
            "summary": f"{spec.farm.name}: {ready}/{workers} ready · {door} · try: {try_next}",
        }

    # ---- command lines -------------------------------------------------------------------

    def _oom_step(self, worker: int) -> int:
        return self.sup.workers[worker].oom_step if worker in self.sup.workers else 0

    def oom_steps(self) -> dict[int, int]:
        """Each worker's OOM-ladder step now (what `worker_commands` applies)."""
        return {w: s.oom_step for w, s in self.sup.workers.items()}

    def commands(self, spec: FarmSpec | None = None) -> dict[int, Command]:
        """The exact command line each worker runs now (`worker_commands.worker_commands`)."""
        if spec is None:  # issue 23: during a canary analysis, each worker's own config
            return {w: self.command_for(w) for w in self._spec.worker_ids}
        return worker_commands(spec, self.oom_steps(), self._hooks.compute_caps)

    def command_for(self, worker: int, spec: FarmSpec | None = None) -> Command:
        """The exact command line the worker runs now (its OOM-ladder step applied)."""
        caps = self._hooks.compute_caps
        spec = spec or self._canary.spec_for(worker, self._spec)  # issue 23: canary only
        return worker_command(spec, worker, self._oom_step(worker), caps)

    # ---- views and state -----------------------------------------------------------------

    async def _wait_change(self, worker: int, timeout: float | None) -> None:
        ev = self._changed.get(worker)
        if ev is None:
            return  # removed by a reload; its watcher ends at its next look
        ev.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await ev.wait()

    def _refresh(self) -> None:
        # Most events (a passing probe of a ready worker) change nothing: skip the rebuild.
        current = (
            dict(self.sup.workers),
            self.sup.rollout,
            self.sup.rollout_reason,
            self._staging,
        )
        if current == self._last_refresh:
            return
        self._last_refresh = current
        self._view = self._build_view()
        for wid, s in self.sup.workers.items():
            key = (s.phase, s.pid, s.launched_at)
            prev = self._last_keys.get(wid)
            if prev == key:
                continue
            self._last_keys[wid] = key
            if prev is not None and prev[0] != s.phase:
                self._bind(wid).info("worker_state", state=str(s.phase), was=str(prev[0]))
            ev = self._changed.get(wid)
            if ev is not None:
                ev.set()
        self._state_dirty.set()  # written off the loop (an fsync per change: not here)
        if self._sync is not None:
            self._sync.update()
        for cb in self._hooks.observers:
            cb(self._view)
        self.spawn(self._notify_all())
        self._canary.observe()  # issue 23: the canary's window starts, fails or ends

    async def _state_writer(self) -> None:
        """One writer, off the event loop, always of the latest states (changes coalesce)."""
        while True:
            await self._state_dirty.wait()
            self._state_dirty.clear()
            await asyncio.to_thread(self._store.save, dict(self.sup.workers))

    async def _notify_all(self) -> None:
        async with self._any_change:
            self._any_change.notify_all()

    def _build_view(self) -> FarmView:
        return build_view(
            self._spec,
            self.sup.workers,
            runtime=self.runtime.name,
            rollout=str(self.sup.rollout),
            rollout_reason=self.sup.rollout_reason,
            started_at=self._started_at,
            mono_to_wall=self._wall() - self._clock(),
            argv={w: self.command_for(w).argv for w in self._spec.worker_ids},
            gateway=self._sync.status() if self._sync is not None else None,
            staging=self._staging,
            canary=self._canary.view(),  # issue 23: FarmView.canary
        )

    # ---- FarmOps -------------------------------------------------------------------------

    def view(self) -> FarmView:
        return self._view

    def gpu_memory(self) -> Sequence[GpuMemory]:
        return self._hooks.stats.gpu_memory()

    def queue_depths(self) -> Mapping[int, float]:
        return self._hooks.stats.queue_depths()

    def startup_pending(self) -> str | None:
        """Why state-changing commands must wait now, or None (see control.handlers)."""
        return self._startup

    async def start(self, worker_ids: Sequence[int]) -> None:
        """Start workers; while a failed stage holds the farm, stage again first (raises
        StageError when it fails again: nothing starts)."""
        async with self._changes:
            stale: list[int] = []
            if self._staging is not None and self._staging.blocks_rollout:
                result = await self._stages.stage(self._spec, keep_old=bool(self._loaded()))
                self._held_by_stage = None
                stale = await self._on_old_copy(result)
                self._after_swap(result)
            if self._hooks.refresh_preflight is not None:
                await self._hooks.refresh_preflight(self._spec)
            ids = [w for w in worker_ids if w in self.sup.workers]
            self._apply_actions(self.sup.start(ids, self._clock()))
            if stale:
                # Adopted workers still on the previous copy roll to the staged one.
                log.warning("workers_on_old_model_copy", workers=stale)
                self._apply_actions(
                    self.sup.restart_rolling(stale, RestartReason.CONFIG, self._clock())
                )

    async def stop(self, worker_ids: Sequence[int], *, drain: bool = True) -> None:
        async with self._changes:
            ids = [w for w in worker_ids if w in self.sup.workers]
            for wid in ids:
                self.feed(wid, StopRequested(drain))
        budget = self._spec.gateway.drain_timeout if drain and self._spec.gateway.enabled else 0
        await self._wait_until(
            lambda: all(
                self.sup.workers[w].phase in (Phase.STOPPED, Phase.FAILED, Phase.QUARANTINED)
                for w in ids
                if w in self.sup.workers
            ),
            budget + self._spec.restart.stop_timeout + 15,
        )

    async def restart(self, worker_ids: Sequence[int], *, drain: bool = True) -> None:
        async with self._changes:
            self._apply_actions(
                self.sup.restart_rolling(
                    list(worker_ids), RestartReason.MANUAL, self._clock(), drain=drain
                )
            )

    async def _wait_until(self, cond: Callable[[], bool], timeout: float) -> bool:
        async def waiter() -> None:
            async with self._any_change:
                await self._any_change.wait_for(cond)

        try:
            async with asyncio.timeout(timeout):
                await waiter()
        except TimeoutError:
            return False
        return True

    async def logs(self, worker_id: int, lines: int) -> Sequence[str]:
        # In a thread: under systemd this runs journalctl, which must not stall the loop.
        return await asyncio.to_thread(self.runtime.log_tail, worker_id, lines)

    async def follow_logs(self, worker_id: int) -> AsyncIterator[str]:
        q: asyncio.Queue[str] = asyncio.Queue(maxsize=10000)
        self._followers.setdefault(worker_id, set()).add(q)
        try:
            while True:
                yield await q.get()
        finally:
            self._followers[worker_id].discard(q)

    def reset_oom(self, worker_id: int) -> None:
        self.sup.reset_oom(worker_id)
        self._bind(worker_id).info("oom_ladder_reset")
        self._refresh()

    def reload_on_signal(self) -> None:
        """SIGHUP: reload, unless the start-up (adoption, the first stage) is still under way:
        then refused with a log line, as the control socket's `busy` (a reload racing the
        start-up's rollout would start workers of the config it replaced)."""
        if self._startup is not None:
            log.warning(
                "reload_refused_during_startup",
                reason=self._startup,
                fix="send SIGHUP again (systemctl reload sglang-farm) once `farmctl status` "
                "shows the start-up done",
            )
            return
        self.spawn(self.reload())

    async def reload(self) -> ReloadResult:
        """Apply the config file if valid. One at a time (the control socket and SIGHUP
        alike), and worker commands wait for it: a restart racing the removal of its
        worker would otherwise leave a process nobody tracks."""
        async with self._changes:
            return await self._reload()

    async def _reload(self) -> ReloadResult:
        if self._config_loader is None:
            return ReloadResult(
                applied=False, problems=("this agent was started without a config file",)
            )
        try:
            # In a thread: the file read, and under systemd the account lookups (NSS).
            new = await asyncio.to_thread(self._config_loader)
        except ConfigError as exc:
            return _refused(Refused(exc.problems))
        # Issue 23: a change its canary rejected is refused; one under analysis (or held)
        # is superseded by this reload (its canary back on the accepted config first).
        if (rejected := self._canary.held(new)) is not None:
            return _refused(Refused((rejected,)))
        self._canary.supersede(new)
        old, serving = self._spec, self._staging
        change = model_change(old, new, stage_holds=serving is not None and serving.blocks_rollout)
        if isinstance(change, Refused):
            return _refused(change)
        staged: StageResult | None = None
        if change is ModelChange.RESTAGE:
            try:
                staged = await self._stages.stage(
                    new, keep_old=bool(self._loaded()), serving=serving
                )
            except StageError as exc:
                return _refused(stage_refused(new, exc))
        elif change is ModelChange.DROP:
            self._stages.publish(None)  # the model is no longer the farm's to stage
        if self._hooks.refresh_preflight is not None:
            await self._hooks.refresh_preflight(new)
        plan = plan_reload(
            {w: self.command_for(w, old) for w in old.worker_ids},
            {w: self.command_for(w, new) for w in new.worker_ids},
        )
        if plan.removed:
            for wid in plan.removed:
                self.feed(wid, StopRequested())
            await self._wait_until(
                lambda: all(
                    self.sup.workers[w].phase in (Phase.STOPPED, Phase.FAILED, Phase.QUARANTINED)
                    for w in plan.removed
                ),
                old.gateway.drain_timeout + old.restart.stop_timeout + 15,
            )
        self._spec = new
        self.sup.reconfigure(self._policy(new), plan.added, plan.removed)
        for wid in plan.removed:
            self._changed.pop(wid, None)
            t = self._worker_tasks.pop(wid, None)
            if t:
                t.cancel()
        for wid in plan.added:
            self._changed[wid] = asyncio.Event()
            self._worker_tasks[wid] = self.spawn(self._watcher(wid).run())
        log.info(
            "reload_applied",
            restarted=list(plan.changed),
            added=list(plan.added),
            removed=list(plan.removed),
        )
        held, self._held_by_stage = self._held_by_stage, None
        effects = reload_effects(
            plan,
            copy_replaced=staged is not None and not staged.current,
            loading=self._loaded(),
            held=held is not None,
            workers=new.worker_ids,
        )
        gated = self._canary.begin(old, new, effects.restart)  # issue 23: canary analysis
        if effects.start:
            self._apply_actions(self.sup.start(list(effects.start), self._clock()))
        if effects.restart:
            self._apply_actions(
                self.sup.restart_rolling(
                    list(effects.restart), RestartReason.CONFIG, self._clock(), gated=gated
                )
            )
        if staged is not None:
            self._after_swap(staged)
        self._last_refresh = None  # the spec changed (ports, names): rebuild the view
        self._refresh()
        return ReloadResult(
            applied=True, restarted=effects.restart, added=plan.added, removed=plan.removed
        )


def _refused(refused: Refused) -> ReloadResult:
    log.error("reload_rejected", problems=list(refused.problems))
    return ReloadResult(applied=False, problems=refused.problems)
