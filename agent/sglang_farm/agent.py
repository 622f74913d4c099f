"""I/O: the agent. Wires the runtime, health probes, log classification and the pure supervisor.

Events flow one way: the runtime and the probes report into one queue; `_pump` feeds
them to the `Supervisor`; the returned actions are carried out as tasks (launch, stop)
and notes are logged. After every change a fresh immutable `FarmView` is swapped in,
which the control socket and the exporter read without ever waiting on a worker.

Liveness: every `health.period` each ready worker must have answered its probe. A probe
still outstanding when the period ends counts as a failed beat (the request is left to
finish, never duplicated: SGLang's `/health` runs a generation and piles up when polled
concurrently, sgl-project/sglang#35884). So a hung worker is caught within
`failure_threshold x period` plus at most one period, however long `health.timeout` is.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import httpx
import structlog

from sglang_farm import state as state_store
from sglang_farm.classify import LogClassifier
from sglang_farm.cmdline import Command, build_command
from sglang_farm.failures import Failure, FailureKind, RestartReason
from sglang_farm.health import probe
from sglang_farm.ladder import apply_ladder, next_step
from sglang_farm.ops import GpuMemory, ReloadResult
from sglang_farm.preflight import resolve_flags
from sglang_farm.runtime import Emit, Exited, LogLine, Runtime, RuntimeEvent, Started
from sglang_farm.spec import FarmSpec, FlagValue
from sglang_farm.supervisor import (
    Action,
    Event,
    FailureSeen,
    HealthFailed,
    HealthPassed,
    Launch,
    Launched,
    Note,
    Policy,
    ProcessExited,
    RestartRequested,
    StopRequested,
    Supervisor,
    Terminate,
    WorkerState,
)
from sglang_farm.views import FarmView, Phase, RestartRecord, WorkerView

log = structlog.get_logger("sglang_farm.agent")

# systemd's own journal lines when a unit's main process is gone: the worker's output ends here.
_SYSTEMD_EXIT_LINES = re.compile(r"Main process exited, code=|Failed with result '")

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
PORT_FREE_WAIT_S = 30.0  # SGLang's SIGKILL "only queues the teardown": ports free within seconds


def port_is_free(host: str, port: int) -> bool:
    """True if nothing listens on host:port (we can bind it ourselves)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


class Agent:
    """One farm: its supervisor, runtime, probes and views. Implements `ops.FarmOps`."""

    def __init__(
        self,
        spec: FarmSpec,
        runtime_factory: Callable[[Emit], Runtime],
        *,
        config_loader: Callable[[], FarmSpec] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.spec = spec
        self._config_loader = config_loader
        self._clock = clock
        self._wall = wall
        self._queue: asyncio.Queue[RuntimeEvent] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self.runtime = runtime_factory(self._emit)
        self.sup = Supervisor(spec.worker_ids, self._policy(spec))
        self._classifiers: dict[int, LogClassifier] = {}
        self._changed: dict[int, asyncio.Event] = {w: asyncio.Event() for w in spec.worker_ids}
        self._any_change = asyncio.Condition()
        self._followers: dict[int, set[asyncio.Queue[str]]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._worker_tasks: dict[int, asyncio.Task[None]] = {}
        self._busy: set[int] = set()
        self._started_at = wall()
        # One HTTP client for all probes: each client loads a CA bundle (~0.7 MiB and up to
        # 0.1 s of the loop each), and every probe is plain HTTP to the worker anyway.
        self.http = httpx.AsyncClient(
            trust_env=False,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )
        self._tick_wake = asyncio.Event()
        self._persisted: dict[int, dict[str, Any]] = {}
        self._last_keys: dict[int, tuple[Phase, int | None, float | None]] = {}
        self._last_refresh: object = None
        self._state_path = Path(spec.farm.state_dir) / "state.json"
        self.gpu_memory_source: Callable[[], Sequence[GpuMemory]] = lambda: ()
        self.queue_source: Callable[[], Mapping[int, float]] = dict
        self.on_view: list[Callable[[FarmView], None]] = []
        # systemd: install the worker's drop-in (its current flags) before StartUnit.
        self.before_launch: Callable[[int], Awaitable[None]] | None = None
        # The doctor's blocking failures for a worker (empty: may start); see daemon.py.
        self.preflight: Callable[[int], list[Failure]] | None = None
        # Compute capability per GPU index (from NVML), for attention_backend = "auto".
        self.compute_caps: dict[int, tuple[int, int]] = {}
        # systemd: the unit turns `active` only when its readiness gate passed; the agent
        # calls a worker ready only then, so `systemctl` and the farm never disagree.
        self.ready_gate: Callable[[int], Awaitable[bool]] | None = None
        # systemd: the journal may deliver a worker's last lines after D-Bus reported its
        # exit; wait (at most this long) for systemd's own "Main process exited" line.
        self.exit_grace = 0.0
        self._pending_exits: dict[int, Exited] = {}
        self._exit_line_seen: set[int] = set()
        self._view = self._build_view()

    # ---- wiring --------------------------------------------------------------------------

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
        w = self.spec.worker(worker)
        gpu = w.gpus[0] if len(w.gpus) == 1 else ",".join(map(str, w.gpus))
        return log.bind(worker=worker, gpu=gpu)  # type: ignore[no-any-return]

    # ---- the loop ------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event, *, ready: Callable[[], object] | None = None) -> None:
        """Adopt or start the farm, supervise until `stop` is set, then shut down."""
        saved = self._restore_state()
        adopted = await self.runtime.adopt()
        now = self._clock()
        held: set[int] = set()
        if adopted:
            # The agent restarted while workers run (crash, upgrade): a worker that had given
            # up, or that an operator stopped, stays so; it is not this restart's to start.
            for wid, d in saved.items():
                phase = d.get("phase")
                if (
                    wid in self.sup.workers
                    and wid not in adopted
                    and phase in ("failed", "stopped")
                ):
                    self.sup.workers[wid] = self.sup.workers[wid].enter(Phase(phase), now)
                    held.add(wid)
        for wid, running in adopted.items():
            if wid in self.sup.workers:
                self.sup.workers[wid] = self.sup.workers[wid].enter(
                    Phase.STARTING, now, pid=running.pid, launched_at=now
                )
                # An active unit passed its readiness gate: its OOMs are serving-time ones.
                self._classifiers[wid] = LogClassifier(serving=running.active)
                self._bind(wid).info("worker_adopted", pid=running.pid, active=running.active)
        pump = self.spawn(self._pump())
        ticker = self.spawn(self._ticker())
        for wid in self.spec.worker_ids:
            self._worker_tasks[wid] = self.spawn(self._watch(wid))
        log.info(
            "farm_starting",
            farm=self.spec.farm.name,
            runtime=self.runtime.name,
            workers=len(self.spec.workers),
            canary=self.spec.startup.canary,
            parallel=self.spec.startup.parallel,
        )
        if held:
            log.info(
                "workers_held",
                workers=sorted(held),
                why="failed or stopped before the agent restarted",
            )
        start = [w for w in self.spec.worker_ids if w not in held]
        # fresh=False: a restarted agent keeps each worker's remembered back-off position.
        self._apply_actions(self.sup.start(start, self._clock(), fresh=False))
        if ready is not None:
            ready()
        await stop.wait()
        log.info("farm_stopping", runtime=self.runtime.name)
        if self.runtime.name == "process":
            await self._stop_all()
        for t in (ticker, *self._worker_tasks.values()):
            t.cancel()
        pump.cancel()
        for t in list(self._tasks):
            t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.runtime.close()
        await self.http.aclose()
        log.info("farm_stopped")

    async def _stop_all(self) -> None:
        ids = [w for w, s in self.sup.workers.items() if s.phase is not Phase.STOPPED]
        for wid in ids:
            self._feed(wid, StopRequested())
        # Stops run concurrently; wait until every process tree is gone (bounded by stop_timeout).
        deadline = self._clock() + self.spec.restart.stop_timeout + 10
        while self._clock() < deadline and any(
            s.phase is Phase.STOPPING for s in self.sup.workers.values()
        ):
            await self._drain_once(0.1)

    async def _drain_once(self, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                ev = await self._queue.get()
            self._on_runtime_event(ev)

    async def _pump(self) -> None:
        while True:
            ev = await self._queue.get()
            self._on_runtime_event(ev)

    async def _ticker(self) -> None:
        """Time-based rules (back-off end, load deadline), evaluated when one is due.

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
                self._exit_line_seen.discard(w)  # lines about an earlier process
                if self.sup.workers[w].phase is Phase.STARTING:
                    self._feed(w, Launched(pid))
            case LogLine(worker=w, text=text):
                for q in self._followers.get(w, ()):
                    with contextlib.suppress(asyncio.QueueFull):
                        q.put_nowait(text)
                failure = self._classifier(w).feed(text)
                if failure is not None:
                    self._bind(w).warning(
                        "worker_failure_seen", kind=str(failure.kind), summary=failure.summary
                    )
                    self._feed(w, FailureSeen(failure))
                if _SYSTEMD_EXIT_LINES.search(text):
                    pending = self._pending_exits.pop(w, None)
                    if pending is not None:
                        self._finish_exit(pending)
                    elif self._process_live(w):
                        # The line came before D-Bus reported the exit. (systemd writes two
                        # such lines per exit; the second, arriving when no process is
                        # live, must not pre-empt the next process's exit.)
                        self._exit_line_seen.add(w)
            case Exited(worker=w):
                if self.exit_grace > 0 and w not in self._exit_line_seen:
                    self._pending_exits[w] = ev
                    self.spawn(self._finish_exit_later(ev))
                else:
                    self._finish_exit(ev)

    async def _finish_exit_later(self, ev: Exited) -> None:
        await asyncio.sleep(self.exit_grace)
        if self._pending_exits.get(ev.worker) is ev:
            del self._pending_exits[ev.worker]
            self._finish_exit(ev)

    def _finish_exit(self, ev: Exited) -> None:
        w = ev.worker
        self._exit_line_seen.discard(w)
        failure = self._classifier(w).finish(ev.status, ev.result)
        self._classifiers.pop(w, None)
        self._bind(w).info(
            "worker_exited",
            status=ev.status,
            result=ev.result,
            failure=str(failure.kind) if failure else None,
        )
        self._feed(w, ProcessExited(ev.status, failure))

    def _process_live(self, worker: int) -> bool:
        s = self.sup.workers[worker]
        return s.pid is not None and s.phase in (
            Phase.STARTING,
            Phase.READY,
            Phase.UNHEALTHY,
            Phase.STOPPING,
        )

    def _classifier(self, worker: int) -> LogClassifier:
        c = self._classifiers.get(worker)
        if c is None:
            c = self._classifiers[worker] = LogClassifier()
        return c

    def _feed(self, worker: int, event: Event) -> None:
        self._apply_actions(self.sup.handle(worker, event, self._clock()))

    def _apply_actions(self, actions: list[Action], *, wake: bool = True) -> None:
        for a in actions:
            match a:
                case Launch(worker=w):
                    self.spawn(self._launch(w))
                case Terminate(worker=w):
                    self.spawn(self.runtime.stop(w, self.spec.restart.stop_timeout))
                case Note(event="oom_step_spread", fields=fields):
                    self._log_note("oom_step_spread", dict(fields))
                    restart = fields.get("restart")
                    if isinstance(restart, list) and restart:
                        self.spawn(self._rolling_restart(restart, RestartReason.OOM))
                case Note(event=event, fields=fields):
                    self._log_note(event, dict(fields))
        if wake:
            self._tick_wake.set()  # a new back-off or load deadline may now be the nearest
        self._refresh()

    def _log_note(self, event: str, fields: dict[str, object]) -> None:
        wid = fields.pop("worker", None)
        logger = self._bind(wid) if isinstance(wid, int) and wid in self.sup.workers else log
        level = "warning" if event in _WARNINGS else "info"
        getattr(logger, level)(event, **fields)

    # ---- launching -----------------------------------------------------------------------

    def flags_for(self, worker: int, spec: FarmSpec | None = None) -> dict[str, FlagValue]:
        """The worker's SGLang flags now: the config's, with its OOM-ladder step applied."""
        spec = spec or self.spec
        step = self.sup.workers[worker].oom_step if worker in self.sup.workers else 0
        step = min(step, len(spec.oom.steps))  # the ladder may have been shortened
        w = spec.worker(worker)
        flags, _changes = apply_ladder(w.flags, spec.oom.steps, step)
        return resolve_flags(flags, self.compute_caps.get(w.gpus[0]))

    def command_for(self, worker: int, spec: FarmSpec | None = None) -> Command:
        """The exact command line the worker runs now (its OOM-ladder step applied)."""
        spec = spec or self.spec
        return build_command(spec.farm, spec.worker(worker), self.flags_for(worker, spec))

    async def _launch(self, worker: int) -> None:
        """Carry out a Launch: preflight, a free port, the drop-in (systemd), the start.

        The supervisor may change its mind while this awaits (an operator's stop or
        restart): the launch is then abandoned, or what it started is stopped again.
        """
        blog = self._bind(worker)
        launched = self.sup.workers[worker].launched_at

        def still_wanted() -> bool:
            s = self.sup.workers.get(worker)
            return s is not None and s.phase is Phase.STARTING and s.launched_at == launched

        def abandon(failure: Failure | None) -> None:
            # The stop (or this failure) finds no process: report the "exit" ourselves.
            self._feed(worker, ProcessExited(None, failure))

        try:
            w = self.spec.worker(worker)
            step = min(self.sup.workers[worker].oom_step, len(self.spec.oom.steps))
            flags, changes = apply_ladder(w.flags, self.spec.oom.steps, step)
            for ch in changes:
                blog.warning(
                    "oom_ladder_flag", flag=ch.flag, old=ch.old, new=ch.new, step=ch.step_name
                )
            cmd = build_command(
                self.spec.farm, w, resolve_flags(flags, self.compute_caps.get(w.gpus[0]))
            )
            self._classifiers[worker] = LogClassifier()
            self._exit_line_seen.discard(worker)
            blocking = self.preflight(worker) if self.preflight is not None else []
            if blocking:
                blog.error("worker_preflight_failed", problems=[f.summary for f in blocking])
                abandon(blocking[0])
                return
            # SGLang binds its port only after a full model load: a clash found then costs
            # minutes. Polling: the kernel offers no event for "a port became free".
            deadline = self._clock() + PORT_FREE_WAIT_S
            while not port_is_free(w.host, w.port) and self._clock() < deadline:
                await asyncio.sleep(0.2)
                if not still_wanted():
                    abandon(None)
                    return
            if not port_is_free(w.host, w.port):
                blog.error("worker_port_busy", port=w.port)
                abandon(
                    Failure(
                        FailureKind.PORT_IN_USE,
                        f"port {w.port} on {w.host} is in use by another process; not started",
                        f"find the owner with `ss -ltnp 'sport = :{w.port}'` and stop it, "
                        f"or give worker {worker} another port in the config",
                    )
                )
                return
            blog.info("worker_launching", port=w.port, argv=list(cmd.argv))
            if self.before_launch is not None:
                await self.before_launch(worker)
            if not still_wanted():
                abandon(None)
                return
            await self.runtime.start(worker, cmd)
            if self.sup.workers[worker].phase is Phase.STOPPING:
                # Stopped while starting: the Terminate found nothing yet; stop it now.
                await self.runtime.stop(worker, self.spec.restart.stop_timeout)
        except Exception as exc:  # task root: any launch error becomes this worker's failure
            blog.error("worker_launch_failed", error=str(exc))
            abandon(
                Failure(
                    FailureKind.CRASH,
                    f"could not be started: {exc}",
                    "check farm.python in the config and the runtime's log",
                )
            )

    # ---- probes --------------------------------------------------------------------------

    async def _watch(self, worker: int) -> None:
        """Health probes for one worker: readiness while loading, liveness once ready."""
        client = self.http  # shared by every worker's probes
        pending: asyncio.Task[Any] | None = None
        try:
            while True:
                s = self.sup.workers.get(worker)
                if s is None:
                    return
                # Read each time: a reload may change [health] or the worker's address.
                hp = self.spec.health
                url = self.spec.worker(worker).base_url + hp.path
                launched = s.launched_at
                if s.phase is Phase.STARTING:
                    if pending is not None:
                        pending.cancel()  # a probe of the previous process; its answer is moot
                    pending = None
                    if s.pid is None:
                        # Not launched yet (waiting for its port, or for systemd): whatever
                        # answers on that port now is not this worker.
                        await self._wait_change(worker, self.spec.startup.poll_interval)
                        continue
                    res = await probe(client, url, hp.timeout)
                    if res.ok and self.ready_gate is not None:
                        res = replace(res, ok=await self.ready_gate(worker))
                    cur = self.sup.workers.get(worker)
                    if res.ok and cur is not None and cur.launched_at == launched:
                        self._feed(worker, HealthPassed())
                        continue
                    await self._wait_change(worker, self.spec.startup.poll_interval)
                elif s.phase in (Phase.READY, Phase.UNHEALTHY):
                    if pending is None:
                        pending = asyncio.create_task(probe(client, url, hp.timeout))
                    started = self._clock()
                    done, _ = await asyncio.wait({pending}, timeout=hp.period)
                    cur = self.sup.workers.get(worker)
                    if (
                        cur is None
                        or cur.launched_at != launched
                        or cur.phase not in (Phase.READY, Phase.UNHEALTHY)
                    ):
                        continue
                    if worker in self._pending_exits:
                        # Its exit is known, only its last log lines are awaited: a failed
                        # probe now says nothing about a hang.
                        await self._wait_change(worker, hp.period)
                        continue
                    if done:
                        res = pending.result()
                        pending = None
                        self._feed(worker, HealthPassed() if res.ok else HealthFailed(res.detail))
                        rest = hp.period - (self._clock() - started)
                        if rest > 0:
                            await self._wait_change(worker, rest)
                    else:
                        self._feed(worker, HealthFailed(f"no answer within {hp.period:g} s"))
                else:
                    await self._wait_change(worker, None)

        finally:
            if pending is not None:
                pending.cancel()  # never leave a probe running against a stale address

    async def _wait_change(self, worker: int, timeout: float | None) -> None:
        ev = self._changed[worker]
        ev.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await ev.wait()

    # ---- views and state -----------------------------------------------------------------

    def _refresh(self) -> None:
        # Most events (a passing probe of a ready worker) change nothing: skip the rebuild.
        current = (dict(self.sup.workers), self.sup.rollout, self.sup.rollout_reason)
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
        self._save_state()
        for cb in self.on_view:
            cb(self._view)
        self.spawn(self._notify_all())

    async def _notify_all(self) -> None:
        async with self._any_change:
            self._any_change.notify_all()

    def _build_view(self) -> FarmView:
        now_m, now_w = self._clock(), self._wall()
        offset = now_w - now_m
        workers = []
        for ws in self.spec.workers:
            s = self.sup.workers.get(ws.id) or WorkerState(ws.id)
            step = s.oom_step
            workers.append(
                WorkerView(
                    id=ws.id,
                    gpus=ws.gpus,
                    port=ws.port,
                    base_url=ws.base_url,
                    phase=s.phase,
                    since=s.since + offset if s.since else self._started_at,
                    pid=s.pid,
                    restarts=tuple(RestartRecord(at + offset, r) for at, r in s.restarts),
                    restarts_by_reason=MappingProxyType(dict(s.restarts_by_reason)),
                    oom_events_by_kind=MappingProxyType(dict(s.oom_events)),
                    last_failure=s.last_failure,
                    last_failure_at=s.last_failure_at + offset if s.last_failure_at else None,
                    last_action=s.last_action,
                    oom_step=step,
                    oom_step_name=self.spec.oom.steps[step - 1].name
                    if 0 < step <= len(self.spec.oom.steps)
                    else None,
                    last_load_seconds=s.last_load_seconds,
                )
            )
        return FarmView(
            name=self.spec.farm.name,
            runtime=self.runtime.name if hasattr(self, "runtime") else "",
            workers=tuple(workers),
            config_source=self.spec.source,
            started_at=self._started_at,
            rollout=str(self.sup.rollout),
            rollout_reason=self.sup.rollout_reason,
        )

    def _restore_state(self) -> dict[int, dict[str, Any]]:
        saved = state_store.load(self._state_path)
        offset = self._clock() - self._wall()
        for wid, d in saved.items():
            if wid in self.sup.workers:
                try:
                    restored = state_store.restore_worker(self.sup.workers[wid], d, offset)
                except (TypeError, ValueError, AttributeError) as exc:
                    log.warning(
                        "state_worker_skipped",
                        worker=wid,
                        error=str(exc),
                        hint="its remembered restarts are dropped; the farm goes on",
                    )
                    continue
                self.sup.workers[wid] = restored
        self._persisted = saved
        if saved:
            log.info("state_restored", path=str(self._state_path), workers=len(saved))
        return saved

    def _save_state(self) -> None:
        offset = self._wall() - self._clock()
        data = {w: state_store.worker_to_dict(s, offset) for w, s in self.sup.workers.items()}

        # Wall-clock conversions drift by microseconds; compare without the times.
        def key(d: dict[int, dict[str, Any]]) -> object:
            return {
                w: (
                    v["failures"],
                    v["oom_step"],
                    len(v["restarts"]),
                    v["restarts_by_reason"],
                    v["oom_events"],
                    v["last_action"],
                    v["last_load_seconds"],
                    v.get("phase"),
                )
                for w, v in d.items()
            }

        if key(data) == key(self._persisted):
            return
        try:
            state_store.save(self._state_path, data)
            self._persisted = data
        except OSError as exc:
            log.error(
                "state_save_failed",
                path=str(self._state_path),
                error=str(exc),
                hint="check state_dir in the config and its permissions",
            )

    # ---- FarmOps -------------------------------------------------------------------------

    def view(self) -> FarmView:
        return self._view

    def gpu_memory(self) -> Sequence[GpuMemory]:
        return self.gpu_memory_source()

    def queue_depths(self) -> Mapping[int, float]:
        return self.queue_source()

    async def start(self, worker_ids: Sequence[int]) -> None:
        self._apply_actions(self.sup.start(list(worker_ids), self._clock()))

    async def stop(self, worker_ids: Sequence[int]) -> None:
        for wid in worker_ids:
            self._feed(wid, StopRequested())
        await self._wait_until(
            lambda: all(
                self.sup.workers[w].phase in (Phase.STOPPED, Phase.FAILED) for w in worker_ids
            ),
            self.spec.restart.stop_timeout + 15,
        )

    async def restart(self, worker_ids: Sequence[int]) -> None:
        if len(worker_ids) == 1:
            self._feed(worker_ids[0], RestartRequested(RestartReason.MANUAL))
            return
        self.spawn(self._rolling_restart(list(worker_ids), RestartReason.MANUAL))

    async def _rolling_restart(self, ids: list[int], reason: RestartReason) -> None:
        """Restart in waves of `startup.parallel`, so the rest of the farm keeps serving."""
        wave = max(1, min(self.spec.startup.parallel, len(ids) - 1))
        for i in range(0, len(ids), wave):
            chunk = ids[i : i + wave]
            for wid in chunk:
                if wid in self.sup.workers:
                    self._feed(wid, RestartRequested(reason))
            await self._wait_until(
                lambda c=chunk: all(  # type: ignore[misc]
                    self.sup.workers[w].phase in (Phase.READY, Phase.FAILED, Phase.STOPPED)
                    for w in c
                    if w in self.sup.workers
                ),
                self.spec.startup.load_timeout + self.spec.restart.stop_timeout,
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

    async def reload(self) -> ReloadResult:
        from sglang_farm.errors import ConfigError

        if self._config_loader is None:
            return ReloadResult(
                applied=False, problems=("this agent was started without a config file",)
            )
        try:
            new = self._config_loader()
        except ConfigError as exc:
            log.error("reload_rejected", problems=list(exc.problems))
            return ReloadResult(applied=False, problems=exc.problems)
        old_ids, new_ids = set(self.spec.worker_ids), set(new.worker_ids)
        shared = sorted(old_ids & new_ids)
        changed = [w for w in shared if self.command_for(w) != self.command_for(w, new)]
        added, removed = sorted(new_ids - old_ids), sorted(old_ids - new_ids)
        if removed:
            await self.stop(removed)
        self.spec = new
        self.sup.policy = self._policy(new)
        for wid in removed:
            self.sup.workers.pop(wid, None)
            t = self._worker_tasks.pop(wid, None)
            if t:
                t.cancel()
        for wid in added:
            self.sup.workers[wid] = WorkerState(wid)
            self._changed[wid] = asyncio.Event()
            self._worker_tasks[wid] = self.spawn(self._watch(wid))
        log.info("reload_applied", restarted=changed, added=added, removed=removed)
        if added:
            await self.start(added)
        if changed:
            self.spawn(self._rolling_restart(changed, RestartReason.CONFIG))
        self._last_refresh = None  # the spec changed (ports, names): rebuild the view
        self._refresh()
        return ReloadResult(
            applied=True, restarted=tuple(changed), added=tuple(added), removed=tuple(removed)
        )
