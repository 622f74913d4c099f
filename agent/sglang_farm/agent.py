"""I/O: the agent: inputs into supervisor events, and the supervisor's actions carried out.

Inputs: the runtime's events (a start; a log line and an exit, read by `workers/logs`),
the liveness probes (`workers/liveness`), the pollers' NVML and worker snapshots
(`workers/observations`), the gateway (`workers/gateway_sync`, `workers/drain`), the clock (the
ticker), the operator's commands (`operations.FarmControl`), a reload (`reloader`) and
the canary analysis (`canary.driver`), each through the narrow surface those modules
name. Each becomes an event about a worker (`feed`: `Supervisor.handle`) or a farm-level
command (`submit`, the one way in for the modules that change the farm: a
`workers.commands` command, `Supervisor.submit`; only this module touches the
supervisor); the actions returned are carried out here (a launch
through the `Launcher`, a stop through the runtime, a drain watched) and its notes are
logged (`workers/notes`). After every change a fresh immutable `FarmView` is built
(`farm_view.build_view`) and swapped in (`publisher`), which the control socket and the
exporter read without ever waiting on a worker; what must survive an agent restart goes
to the `StateStore`.

Nothing here decides: which workers stay held on adoption, the waves of a rolling
restart, the OOM step spreading to the farm, a failing GPU, a busy or wedged worker,
how long a stop may take and a reload's effects are the core's decisions (`workers/`,
`workers/gpu_health`, `staging/`, `canary/`). Nothing here asks which runtime it drives
either: what differs is a method of the `Runtime` protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import sys
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import structlog

from sglang_farm.canary.driver import CanaryDriver  # issue 23
from sglang_farm.canary.driver import Host as CanaryHost  # issue 23
from sglang_farm.collaborators import Collaborators
from sglang_farm.errors import AgentCrashed
from sglang_farm.farm_view import FarmView, build_view
from sglang_farm.gpus.snapshot import FleetSnapshot
from sglang_farm.host.keyguard import KeyGuard
from sglang_farm.host.portowner import ProcPortOwner
from sglang_farm.publisher import Publisher
from sglang_farm.reloader import Reloader
from sglang_farm.runtime import Emit, Exited, LogLine, Runtime, RuntimeEvent, Started
from sglang_farm.sglang.argv import Command
from sglang_farm.sglang.commands import ladder_changes, worker_command, worker_commands
from sglang_farm.sglang.failures import RestartReason
from sglang_farm.sglang.health import HttpProber
from sglang_farm.sglang.load import WorkerStats
from sglang_farm.spec import FarmSpec, gpu_field
from sglang_farm.staging.driver import StageDriver
from sglang_farm.staging.failure import StageError
from sglang_farm.staging.runner import thread_stager
from sglang_farm.staging.stale import old_copy_removal
from sglang_farm.staging.state import StageResult, StagingView
from sglang_farm.state import StateStore
from sglang_farm.ticker import Ticker
from sglang_farm.workers.commands import FarmCommand, Reconfigure, RestartRolling, Start
from sglang_farm.workers.drain import Drains, HttpInFlight
from sglang_farm.workers.gateway_fleet import GatewayFleet
from sglang_farm.workers.launcher import Launcher
from sglang_farm.workers.liveness import LivenessWatcher
from sglang_farm.workers.loading import loading
from sglang_farm.workers.logs import WorkerLogs
from sglang_farm.workers.notes import (
    ROUTED_WAIT_S,
    farmctl_command,
    note_level,
    rollout_summary,
)
from sglang_farm.workers.observations import Observations
from sglang_farm.workers.phase import Phase
from sglang_farm.workers.supervisor import (
    STOP_SLACK_S,
    Action,
    Drain,
    Event,
    FailureSeen,
    Launch,
    Launched,
    Note,
    Policy,
    ProcessExited,
    Rollout,
    StopRequested,
    Supervisor,
    Terminate,
    WorkerState,
    drifted_workers,
    farm_policy,
    stop_budget,
)

log = structlog.get_logger("sglang_farm.agent")


async def _first(*aws: Coroutine[Any, Any, Any]) -> None:
    """Return once the first of `aws` is done; the others are cancelled."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()


def typed_from_here() -> tuple[str, str]:
    """How the rollout's "try:" command is typed from the agent's working directory:
    the farmctl beside the agent's interpreter (`.venv/bin/farmctl` in a checkout),
    unless the one on the PATH is that one (issue 31)."""
    cwd = os.getcwd()
    mine = os.path.join(os.path.dirname(sys.executable), "farmctl")
    if not os.path.exists(mine):
        return "farmctl", cwd
    found = shutil.which("farmctl")
    same = found is not None and os.path.realpath(found) == os.path.realpath(mine)
    return farmctl_command(mine, mine if same else found, cwd), cwd


class Agent:
    """One farm: its supervisor, runtime, probes and views (`operations.FarmControl`
    carries out the operator's commands on it)."""

    def __init__(
        self,
        spec: FarmSpec,
        runtime_factory: Callable[[Emit], Runtime],
        *,
        config_loader: Callable[[], FarmSpec] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        collaborators: Collaborators | None = None,
    ) -> None:
        # Issue 23: the canary analysis; a restarted agent may start on the last accepted
        # config instead of the file's (its change rejected, or not judged yet).
        collaborators = collaborators or Collaborators()
        c = collaborators
        self._port_owner = collaborators.port_owner or ProcPortOwner()
        # Every sender of a worker's API key asks this first (host.keyguard); the runtime
        # it asks is built below, once the config the agent starts on is known.
        self.key_guard = KeyGuard(
            lambda w: self.runtime.worker_pids(w), self._port_owner, gpu=self._gpus_of
        )
        self._canary = CanaryDriver(
            spec,
            CanaryHost(  # what the canary analysis may do to the farm, once it runs
                farm=self,
                rollout_over=self.rollout_over,
                spawn=self.spawn,
                refresh=self.republish,
                reload=lambda: self.reloader.reload(),
                startup_done=lambda: self._startup is None,
                clock=clock,
                wall=wall,
                gateway=lambda: self._spec.gateway.enabled,
                restore_model=lambda accepted: self._stages.restore_old_copy(accepted),
                key_guard=self.key_guard,
            ),
            scrape=c.canary_scrape,
            caps=c.compute_caps,
            gate=c.canary_gate,
            send=c.canary_probe_send,
        )
        spec = self._spec = self._canary.spec
        self.clock = clock
        self._wall = wall
        self._collaborators = collaborators
        self._queue: asyncio.Queue[RuntimeEvent] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self.runtime = runtime_factory(self._emit)
        self.supervisor = Supervisor(spec.worker_ids, farm_policy(spec))
        self._prober = collaborators.prober or HttpProber()
        self._launcher = Launcher(
            self.runtime,
            state=self.worker_state,
            feed=self.feed,
            plan=lambda w: (self._spec, self.command_for(w)),
            prepare=lambda spec: self.runtime.prepare(spec, self.commands()),
            clock=clock,
            preflight=collaborators.preflight,
            port_state=collaborators.port_state,
            log_for=self.log_for,
            port_owner=self._port_owner,
        )
        self._store = StateStore(Path(spec.farm.state_dir) / "state.json", clock, wall)
        self._sync = (
            GatewayFleet(  # issue 26: one sync per gateway ([gateway] urls)
                collaborators.gateways,
                spec=lambda: self._spec,
                states=lambda: self.supervisor.workers,
                # Issue 23: a canary waiting for its eval gate is kept out of the gateway.
                kept_out=lambda: self._canary.kept_out_of_gateway(),
                feed=self.feed,
                on_status=self.republish,
            )
            if collaborators.gateways
            else None
        )
        self.drains = Drains(
            state=self.worker_state,
            gateway_routes_nothing=lambda: self._sync is None or not self._sync.up,
            in_flight=collaborators.in_flight or HttpInFlight(),
            base_url=lambda w: self._spec.worker(w).base_url,
            feed=self.feed,
            clock=clock,
            unconfirmed=lambda ws: {} if self._sync is None else self._sync.unconfirmed_out(ws),
        )
        self._observed = Observations()
        self.worker_logs = WorkerLogs()
        self._changed: dict[int, asyncio.Event] = {w: asyncio.Event() for w in spec.worker_ids}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._summary: asyncio.Task[None] | None = None  # the rollout's end, until routed
        self._worker_tasks: dict[int, asyncio.Task[None]] = {}
        # Set when a vital task (see `spawn`) failed: `run` ends, raising AgentCrashed.
        self._crashed = asyncio.Event()
        self._crash: AgentCrashed | None = None
        self._started_at = wall()
        self._ticker = Ticker(
            next_deadline=lambda now: self.supervisor.next_deadline(now),
            tick=lambda: self.apply_actions(self.supervisor.tick(self.clock()), wake=False),
            clock=clock,
        )
        # State-changing commands wait for this: restore and adoption first (a stop issued
        # before would be saved over the remembered state), and one reload at a time.
        self._startup: str | None = "the agent is restoring its state and adopting running workers"
        self.changes = asyncio.Lock()
        self._last_refresh: object = None
        self._stages = StageDriver(
            spec,
            collaborators.stager or thread_stager,
            on_change=self.republish,
            clock=clock,
            wall=wall,
            process_started=collaborators.process_started,
        )
        # The workers the rollout starts once a stage succeeds (a failed stage holds them).
        self._held_by_stage: list[int] | None = None
        # Remembered at once (one small file): status shows the farm's history while the
        # agent adopts, never a blank farm.
        remembered = self._store.restore(
            self.supervisor.workers, {w.id: w.gpus for w in spec.workers}
        )
        self.supervisor.restore_remembered(remembered.states, remembered.held_out_since)
        self._remembered = dict(remembered.phases)
        self.reloader = Reloader(
            self,
            loader=config_loader,
            changes=self.changes,
            canary=self._canary,
            stages=self._stages,
            refresh_preflight=collaborators.refresh_preflight,
        )
        sync, on_view = self._sync, list[Callable[[FarmView], None]]()
        if sync is not None:
            on_view.append(lambda _view: sync.update())  # membership follows each change
        self._publisher = Publisher(
            build=self._build_view,
            changed=self._changed,
            save=self._save_state,
            after=(*on_view, *collaborators.observers),
            log_for=self.log_for,
        )

    # ---- wiring --------------------------------------------------------------------------

    @property
    def spec(self) -> FarmSpec:
        return self._spec

    def submit(self, command: FarmCommand) -> None:
        """The one way into the core for a farm-level command (`workers.commands`: the
        operator's, a reload's, the canary analysis's, the start-up's): the core decides,
        its actions are carried out here and the view published."""
        actions = self.supervisor.submit(command, self.clock())
        if isinstance(command, Reconfigure):
            self._spec = command.spec  # the config in force: what the actions run
            self._watchers_follow(command.added, command.removed)
            self._last_refresh = None  # the view is rebuilt: ports and names may differ
        self.apply_actions(actions)

    def _watchers_follow(self, added: Sequence[int], removed: Sequence[int]) -> None:
        """A watcher for each added worker, none left for a removed one."""
        for wid in removed:
            self._changed.pop(wid, None)
            t = self._worker_tasks.pop(wid, None)
            if t:
                t.cancel()
        for wid in added:
            self._changed[wid] = asyncio.Event()
            self._worker_tasks[wid] = self.spawn(
                self._watcher(wid).run(), vital=f"worker {wid}'s liveness watcher", worker=wid
            )

    def _emit(self, event: RuntimeEvent) -> None:
        """Runtime callback; safe from any thread."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    def spawn(
        self, coro: Any, *, vital: str | None = None, worker: int | None = None
    ) -> asyncio.Task[Any]:
        """Run `coro` as the agent's task. `vital` names a task the farm cannot run without
        (the event pump, the ticker, a watcher, the state writer): its failure ends the
        agent (`_task_done`); any other task's failure is logged and the agent goes on.
        `worker`: the worker the task is about, named in that log line."""
        task: asyncio.Task[Any] = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(functools.partial(self._task_done, vital=vital, worker=worker))
        return task

    def _task_done(
        self, task: asyncio.Task[Any], *, vital: str | None = None, worker: int | None = None
    ) -> None:
        self._tasks.discard(task)
        if task.cancelled() or (exc := task.exception()) is None:
            return
        if vital is None:
            log.error("agent_task_failed", error=repr(exc), exc_info=exc)
            return
        # Issue 32, 4.2: a pump that died left an agent answering `status` and pinging the
        # watchdog while nothing supervised the workers. It stops instead, and says so.
        outlive = self.runtime.workers_outlive_agent
        next_step = (
            "systemd restarts the agent (Restart=) and the new agent adopts the running workers"
            if outlive
            else "its workers stop with it; start the agent again (a service manager restarts it)"
        )
        if self._crash is None:
            self._crash = AgentCrashed(
                f"the agent stopped: its {vital} failed with {exc!r}; {next_step}; "
                "this is a bug of the farm: report it with the log line agent_task_crashed"
            )
        said = log
        if worker is not None and worker in self._spec.worker_ids:
            said = self.log_for(worker)
        said.critical(
            "agent_task_crashed",
            task=vital,
            error=repr(exc),
            what="the agent stops rather than run unsupervised",
            next_step=next_step,
            exc_info=exc,
        )
        self._crashed.set()

    def _gpus_of(self, worker: int) -> str | int | None:
        """The worker's GPU (its GPUs, comma-joined), None for one not (or no longer) known."""
        try:
            return gpu_field(self._spec.worker(worker).gpus)
        except KeyError:
            return None

    def log_for(self, worker: int) -> structlog.typing.FilteringBoundLogger:
        w = self._spec.worker(worker)
        bound: structlog.typing.FilteringBoundLogger = log.bind(
            worker=worker, gpu=gpu_field(w.gpus)
        )
        return bound

    def worker_state(self, worker: int) -> WorkerState | None:
        return self.supervisor.workers.get(worker)

    # ---- the loop ------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event, *, ready: Callable[[], object] | None = None) -> None:
        """Adopt or start the farm, supervise until `stop` is set, then shut down."""
        remembered = self._remembered
        running = await self.runtime.adopt(configured=self._spec.worker_ids)
        adoption = self.supervisor.adopt(
            {w: r.pid for w, r in running.items()},
            remembered,
            self.clock(),
            serving={w for w, r in running.items() if r.active},
        )
        for wid in adoption.adopted:
            # An active unit passed its readiness gate: its OOMs are serving-time ones.
            self.worker_logs.new_process(wid, serving=running[wid].active)
            self.log_for(wid).info(
                "worker_adopted", pid=running[wid].pid, active=running[wid].active
            )
        # Secrets changed while the agent was down (the argv does not show them).
        secrets_changed = await self.runtime.prepare(self._spec, self.commands())
        if self._sync is not None:
            self._sync.start()
        self.spawn(self._publisher.write_state(), vital="state writer")
        pump = self.spawn(self._pump(), vital="event pump")
        ticker = self.spawn(self._ticker.run(), vital="ticker")
        for wid in self._spec.worker_ids:
            self._worker_tasks[wid] = self.spawn(
                self._watcher(wid).run(), vital=f"worker {wid}'s liveness watcher", worker=wid
            )
        log.info(
            "farm_starting",
            farm=self._spec.farm.name,
            runtime=self.runtime.name,
            workers=len(self._spec.workers),
            canary=self._spec.startup.canary,
            parallel=self._spec.startup.parallel,
        )
        self.apply_actions(list(adoption.actions))
        start = [w for w in self._spec.worker_ids if w not in adoption.held]
        argv = {w: r.argv for w, r in running.items()}
        drifted = drifted_workers(
            adoption.adopted, argv, lambda w: self.command_for(w).argv, secrets_changed
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
        await _first(stop.wait(), self._crashed.wait())
        log.info("farm_stopping", runtime=self.runtime.name, crashed=self._crash is not None)
        if self._summary is not None:
            self._summary.cancel()  # a rollout's end not said yet is not said while stopping
        self._stages.cancel.set()  # the copy under way stops at once
        if not self.runtime.workers_outlive_agent and self._crash is None:
            # After a crash the core is not asked again: the runtime's close kills them.
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
        # The last word.
        await self._store.save_from(self.supervisor.workers, self.supervisor.held_out_since)
        await self.runtime.close()
        await self._prober.aclose()
        log.info("farm_stopped")
        if self._crash is not None:
            raise self._crash

    def _begin_rollout(self, start: Sequence[int], drifted: Sequence[int]) -> None:
        # fresh=False: a restarted agent keeps each worker's remembered back-off position.
        self.submit(Start(list(start), fresh=False))
        if drifted:
            # Adopted, but started with another command line than the config renders now
            # (a config edited while the agent was down), or loaded a model copy that has
            # been replaced since: restarted in waves, drained.
            log.warning("workers_drifted", workers=list(drifted))
            self.submit(RestartRolling(list(drifted), RestartReason.CONFIG))

    # ---- model staging (docs/staging.md) ---------------------------------------------------

    @property
    def _staging(self) -> StagingView | None:
        return self._stages.view

    def _loaded(self) -> list[int]:
        return loading(self.supervisor.workers)

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
            start = [w for w in start if w in self.supervisor.workers]
            drifted = [w for w in drifted if w in self.supervisor.workers]
            if self._collaborators.refresh_preflight is not None:
                # The doctor looked before the model was in place: it judges the copy now.
                await self._collaborators.refresh_preflight(self._spec)
            self._begin_rollout(start, drifted)
            self.after_swap(result)
        finally:
            self._startup = None

    async def restage(self) -> list[int]:
        """`farmctl start` while a failed stage holds the farm: stage again (StageError when
        it fails again); the running workers still on the previous copy, to roll."""
        if self._staging is None or not self._staging.blocks_rollout:
            return []
        result = await self._stages.stage(self._spec, keep_old=bool(self._loaded()))
        self._held_by_stage = None
        stale = await self._on_old_copy(result)
        self.after_swap(result)
        return stale

    def take_stage_hold(self) -> list[int] | None:
        """The workers a failed stage held back (a reload now starts them), or None."""
        held, self._held_by_stage = self._held_by_stage, None
        return held

    async def _on_old_copy(self, result: StageResult) -> list[int]:
        """Running workers that load a copy other than the one now at model_path."""
        pids = {w: self.supervisor.workers[w].pid for w in self._loaded()}
        launched = {w: at for w, (pid, at) in self._store.launches.items() if pids.get(w) == pid}
        return await self._stages.on_old_copy(result, pids, launched)

    def after_swap(self, result: StageResult) -> None:
        """The previous copy goes once no worker loads from it (after the rolling restart)."""
        if (action := old_copy_removal(result, self._spec)) is not None:
            self.spawn(self._stages.remove_old_copy(action, self._rolled))

    async def _rolled(self, timeout: float) -> bool:
        """The waves are over; while a canary's verdict gates them (issue 23), the old copy
        of the model is kept however long that takes."""
        while not await self.wait_until(lambda: not self.supervisor.rolling, timeout):
            if not self.supervisor.gated():
                return False
        return True

    def _watcher(self, worker: int) -> LivenessWatcher:
        return LivenessWatcher(
            worker,
            spec=lambda: self._spec,
            state=self.worker_state,
            prober=self._prober,
            port_owner=self._port_owner,
            runtime=self.runtime,
            feed=self.feed,
            wait_change=self._publisher.wait_worker,
            clock=self.clock,
        )

    async def _stop_all(self) -> None:
        ids = [w for w, s in self.supervisor.workers.items() if s.phase is not Phase.STOPPED]
        for wid in ids:
            self.feed(wid, StopRequested())
        # Stops run concurrently (each drained first when there is a gateway); wait until
        # every process tree is gone (bounded by the drain budget and stop_timeout).
        deadline = self.clock() + stop_budget(self.supervisor.policy) + STOP_SLACK_S
        while self.clock() < deadline and self.supervisor.stopping():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.1):
                    ev = await self._queue.get()
                self._on_runtime_event(ev)

    async def _pump(self) -> None:
        while True:
            ev = await self._queue.get()
            self._on_runtime_event(ev)

    def _on_runtime_event(self, ev: RuntimeEvent) -> None:
        if ev.worker not in self.supervisor.workers:
            return
        match ev:
            case Started(worker=w, pid=pid):
                if self.supervisor.workers[w].phase is Phase.STARTING:
                    self.feed(w, Launched(pid))
            case LogLine(worker=w, text=text):
                failure = self.worker_logs.line(w, text, self.clock())
                for slow in self.worker_logs.startups.take_slow():  # issue 34 §4
                    self.log_for(slow.worker).warning(
                        "worker_start_slow", phase=str(slow.slow.phase), why=slow.slow.text()
                    )
                if failure is not None:
                    self.log_for(w).warning(
                        "worker_failure_seen", kind=str(failure.kind), summary=failure.summary
                    )
                    self.feed(w, FailureSeen(failure))
            case Exited(worker=w):
                failure = self.worker_logs.exited(w, ev.status, ev.result)
                self.log_for(w).info(
                    "worker_exited",
                    status=ev.status,
                    result=ev.result,
                    failure=str(failure.kind) if failure else None,
                )
                self.feed(w, ProcessExited(ev.status, failure))

    def feed(self, worker: int, event: Event) -> None:
        """One event about one worker into the supervisor; its actions carried out."""
        self.apply_actions(self.supervisor.handle(worker, event, self.clock()))

    def apply_actions(self, actions: list[Action], *, wake: bool = True) -> None:
        for a in actions:
            match a:
                case Launch(worker=w):
                    self._before_launch(w)
                    self.spawn(self._launcher.launch(w))
                case Terminate(worker=w):
                    self.spawn(self.runtime.stop(w, self._spec.restart.stop_timeout))
                case Drain(worker=w):
                    self.spawn(self.drains.watch(w))
                case Note(event=event, fields=fields):
                    self._log_note(event, dict(fields))
        if wake:
            self._ticker.wake()  # a new back-off or load deadline may now be the nearest
        self.refresh()

    # ---- GPU health -----------------------------------------------------------------------

    def observe_fleet(self, fleet: FleetSnapshot) -> None:
        """The NVML poller's latest snapshot: reported to the workers on a failing GPU."""
        for wid, event in self._observed.of_fleet(fleet, self.worker_gpus()):
            self.feed(wid, event)

    def observe_stats(self, stats: Mapping[int, WorkerStats]) -> None:
        """The worker pollers' latest figures: reported as progress or a stall."""
        window, now = self._spec.health.stall_window, self._wall()
        for wid, event in self._observed.of_stats(
            stats, self.worker_gpus(), stall_window=window, now=now
        ):
            self.feed(wid, event)

    def worker_gpus(self) -> dict[int, tuple[int, ...]]:
        ids = self._spec.worker_ids
        return {w: self._spec.worker(w).gpus for w in self.supervisor.workers if w in ids}

    def republish(self) -> None:
        """The view is rebuilt now, whatever the workers' states: the gateway went up or
        down, the stage moved on, the config in force changed (status, metrics say so)."""
        self._last_refresh = None
        self.refresh()

    def _before_launch(self, worker: int) -> None:
        """A new process: a fresh log classifier, and the OOM-ladder flags it runs with."""
        self.worker_logs.new_process(worker, launched_at=self.clock())
        for ch in ladder_changes(self._spec, worker, self._oom_step(worker)):
            self.log_for(worker).warning(
                "oom_ladder_flag", flag=ch.flag, old=ch.old, new=ch.new, step=ch.step_name
            )

    def _log_note(self, event: str, fields: dict[str, object]) -> None:
        if event == "rollout_done":
            farmctl, cwd = typed_from_here()
            if self._sync is not None:  # said once users get it (issue 31)
                if self._summary is not None:
                    self._summary.cancel()  # a new rollout's end replaces the one not said
                self._summary = self.spawn(self._say_rollout_done(fields, farmctl, cwd))
                return
            fields.update(
                rollout_summary(
                    self._spec, None, fields["ready"], fields["workers"], farmctl=farmctl, cwd=cwd
                )
            )
        wid = fields.pop("worker", None)
        logger = (
            self.log_for(wid) if isinstance(wid, int) and wid in self.supervisor.workers else log
        )
        getattr(logger, note_level(event))(event, **fields)

    def _not_routed(self) -> list[int]:
        """The ready workers the gateway does not route (yet)."""
        return [w.id for w in self.view().workers if w.ready and not w.in_gateway]

    async def _say_rollout_done(self, fields: dict[str, object], farmctl: str, cwd: str) -> None:
        """The rollout's end with a gateway: said once the gateway routes every ready
        worker, or after `ROUTED_WAIT_S` naming those it does not route yet; the counts
        are the view's then."""
        await self._publisher.wait_until(
            lambda: not self._not_routed() or self.view().held_out_since is not None,
            ROUTED_WAIT_S,
        )
        assert self._sync is not None  # only called with a gateway
        view = self.view()
        fields.update(ready=view.ready_count, workers=len(view.workers))
        fields.update(
            rollout_summary(
                self._spec,
                self._sync.gateway_url,
                fields["ready"],
                fields["workers"],
                self._not_routed(),
                held_out=view.held_out_since is not None,
                farmctl=farmctl,
                cwd=cwd,
            )
        )
        getattr(log, note_level("rollout_done"))("rollout_done", **fields)

    # ---- command lines -------------------------------------------------------------------

    def _oom_step(self, worker: int) -> int:
        return self.supervisor.workers[worker].oom_step if worker in self.supervisor.workers else 0

    def oom_steps(self) -> dict[int, int]:
        """Each worker's OOM-ladder step now (what `worker_commands` applies)."""
        return {w: s.oom_step for w, s in self.supervisor.workers.items()}

    def commands(self, spec: FarmSpec | None = None) -> dict[int, Command]:
        """The exact command line each worker runs now (`worker_commands.worker_commands`)."""
        if spec is None:  # issue 23: during a canary analysis, each worker's own config
            return {w: self.command_for(w) for w in self._spec.worker_ids}
        return worker_commands(spec, self.oom_steps(), self._collaborators.compute_caps)

    def command_for(self, worker: int, spec: FarmSpec | None = None) -> Command:
        """The exact command line the worker runs now (its OOM-ladder step applied)."""
        caps = self._collaborators.compute_caps
        spec = spec or self._canary.spec_for(worker, self._spec)  # issue 23: canary only
        return worker_command(spec, worker, self._oom_step(worker), caps)

    # ---- views and state -----------------------------------------------------------------

    def refresh(self) -> None:
        # Most events (a passing probe of a ready worker) change nothing: skip the rebuild.
        current = (
            dict(self.supervisor.workers),
            self.supervisor.rollout,
            self.supervisor.rollout_reason,
            self._staging,
            len(self.supervisor.rolling),  # issue 26: farmctl wait reads it
            self.worker_logs.startups.version,  # issue 34 §4: a start's phase moved
        )
        if current == self._last_refresh:
            return
        self._last_refresh = current
        self._publisher.publish(self.supervisor.workers)
        self._canary.observe()  # issue 23: the canary's window starts, fails or ends

    def _build_view(self) -> FarmView:
        return build_view(
            self._spec,
            self.supervisor.workers,
            runtime=self.runtime.name,
            rollout=self.supervisor.rollout,
            rollout_reason=self.supervisor.rollout_reason,
            started_at=self._started_at,
            mono_to_wall=self._wall() - self.clock(),
            argv={w: self.command_for(w).argv for w in self._spec.worker_ids},
            gateway=self._sync.status() if self._sync is not None else None,
            staging=self._staging,
            canary=self._canary.view(),  # issue 23: FarmView.canary
            rolling=len(self.supervisor.rolling),  # issue 26: farmctl wait
            held_out_since=self.supervisor.held_out_since,  # issue 26: drain-host
            starts=self.worker_logs.startups.starts(),  # issue 34 §4: each start's phases
            slow_starts=self.worker_logs.startups.slow_phases(),  # ... and the slow ones
            state_alerts=(*self._store.alerts(), *self._canary.alerts()),  # issue 30
            state_save_failures=self._store.save_failures,
        )

    async def _save_state(self) -> None:
        """The publisher's save; a save that starts or ends a run of failures shows in
        the view at once (issue 30: `farmctl status` says the state is not saved)."""
        before = self._store.not_saved is None
        await self._store.save_from(self.supervisor.workers, self.supervisor.held_out_since)
        if before != (self._store.not_saved is None):
            self._publisher.view = self._build_view()

    async def save_state(self, change: str, undone: str) -> None:
        """A command's change saved before it answers (issue 30): raises
        `state.StateNotSaved` naming the file and why (`StateStore.save_now`)."""
        try:
            await self._store.save_now(
                self.supervisor.workers, self.supervisor.held_out_since, change, undone
            )
        finally:
            self._publisher.view = self._build_view()

    # ---- read by the operator's commands (operations.FarmControl) ------------------------

    def view(self) -> FarmView:
        return self._publisher.view

    def startup_pending(self) -> str | None:
        """Why state-changing commands must wait now, or None (see control.handlers)."""
        return self._startup

    def states(self) -> Mapping[int, WorkerState]:
        """Each configured worker's state now, read-only (the core's own, live: what a
        command waits on; `view()` is what readers see)."""
        return MappingProxyType(self.supervisor.workers)

    @property
    def policy(self) -> Policy:
        """The policy in force (the stop and drain budgets a command waits by)."""
        return self.supervisor.policy

    def rollout_over(self) -> bool:
        """The rollout is done and no rolling restart is in flight."""
        return self.supervisor.rollout is Rollout.DONE and not self.supervisor.rolling

    async def wait_until(self, cond: Callable[[], bool], timeout: float) -> bool:
        return await self._publisher.wait_until(cond, timeout)
