"""I/O: workers as systemd units `sglang@N.service`, driven over the system D-Bus with pystemd.

`SystemdRuntime` runs the commands (Start/Stop/Restart/KillUnit, Reload, property
reads) on ONE thread that owns one bus connection, takes the units' changes from the
signal watcher (`systemd_watch`) and turns them into `Started`/`Exited` with the pure
`unit_state.observe`; `runtime.journal` follows their output. Generated units go to
/run/systemd/system (`install_units`). Why each of these, in docs/systemd.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

import structlog
from pystemd.dbusexc import DBusBaseError
from pystemd.dbuslib import DBus
from pystemd.systemd1 import Manager

from sglang_farm.errors import RuntimeFailure
from sglang_farm.runtime import Emit, Running
from sglang_farm.runtime.journal import ExitOrdering, JournalFollower
from sglang_farm.runtime.systemd_bus import (
    DEST,
    SERVICE_IFACE,
    UNIT_IFACE,
    dbus_error_text,
    get_all,
    list_units,
    read_state,
    unit_path,
)
from sglang_farm.runtime.systemd_watch import UnitWatcher
from sglang_farm.runtime.unit_files import (
    UnitChanges,
    secrets_changed_workers,
    write_secrets,
    write_units,
)
from sglang_farm.runtime.unit_procs import proc_argv, unit_pids
from sglang_farm.runtime.unit_secrets import credentials_dir, render_secrets
from sglang_farm.runtime.unit_state import (
    Tracked,
    UnitState,
    exec_start_argv,
    observe,
    unit_state_from,
    units_of,
    worker_of,
)
from sglang_farm.runtime.unit_syntax import worker_unit as unit_name
from sglang_farm.sglang.argv import Command
from sglang_farm.spec import FarmSpec

UnitFiles = Mapping[PurePosixPath, str]

log = structlog.get_logger("sglang_farm.runtime.systemd")

T = TypeVar("T")

RUN_UNIT_DIR = "/run/systemd/system"

# A stop that outlives its timeout gets SIGKILL; then this long for the cgroup to empty.
_KILL_GRACE = 10.0
# D-Bus calls are local and answer in milliseconds; systemd itself may take a while
# during a daemon-reload, which sd-bus bounds at 25 s per call.
_LOG_TAIL_TIMEOUT = 10.0


# --- unit files ------------------------------------------------------------------


def install_units(
    files: Mapping[PurePosixPath, str], root: str | Path = RUN_UNIT_DIR
) -> UnitChanges:
    """Write rendered units under `root` (`unit_files.write_units`: atomic, skips identical files,
    removes our stale drop-ins). Raises RuntimeFailure when the folder cannot be written."""
    try:
        return write_units(Path(root), files)
    except OSError as exc:
        raise RuntimeFailure(
            f"cannot write unit files under {root}: {exc.strerror or exc}; "
            "the agent must run as root (it is a system service)"
        ) from exc


def install_secrets(files: Mapping[str, bytes], folder: str | PurePosixPath) -> frozenset[int]:
    """Write the workers' secret files (`unit_files.write_secrets`: folder 0700, files 0600);
    return the workers whose files changed (`unit_files.secrets_changed_workers`). Raises
    RuntimeFailure when the folder cannot be written."""
    try:
        existed = {n for n in files if (Path(folder) / n).is_file()}
        changes = write_secrets(Path(folder), files)
    except OSError as exc:
        raise RuntimeFailure(
            f"cannot write the workers' secret files under {folder}: {exc.strerror or exc}; "
            "the agent must run as root and [farm] state_dir be writable to it"
        ) from exc
    if changes.changed:
        # Names only: the contents are secrets.
        log.info("secrets_installed", written=changes.written, removed=changes.removed)
    return secrets_changed_workers(changes, existed)


# --- the runtime -----------------------------------------------------------------------


class SystemdRuntime:
    """Runtime over systemd units. Workers outlive the agent; `close` leaves them running.

    Build it on the loop, then `await open()` (the other methods open it on first use).
    `emit` is called on the loop thread.
    """

    name = "systemd"

    workers_outlive_agent = True

    def __init__(
        self,
        emit: Emit,
        *,
        prefix: str = "sglang",
        follow_logs: bool = True,
        units: Callable[[FarmSpec, Mapping[int, Command]], UnitFiles] | None = None,
        exit_grace: float = 0.0,
        ready_gate_wait: float = 30.0,
    ) -> None:
        """`units` renders the unit files for `prepare` (None: units are installed by hand).

        `exit_grace`: how long a worker's exit waits for its last journal lines (see
        `journal.ExitOrdering`). `ready_gate_wait`: how long `confirm_ready` waits for the
        unit to leave `activating`.
        """
        self._ordering = ExitOrdering(emit, exit_grace, self._live, self._catch_up)
        self._emit = self._ordering.feed
        self._prefix = prefix
        self._follow_logs = follow_logs
        self._units = units
        self._ready_gate_wait = ready_gate_wait
        self._tracked: dict[int, Tracked] = {}
        self._changed = asyncio.Event()
        self._jobs: dict[str, asyncio.Future[str]] = {}
        self._done_jobs: dict[str, str] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._bus: Any = None  # owned by the executor's single thread
        self._refd: set[str] = set()  # units we hold a reference on (see _ref)
        self._watcher: UnitWatcher | None = None
        self._watch_error: BaseException | None = None
        self._follower: JournalFollower | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        # One unit install at a time (render, write, daemon-reload): two launches
        # preparing at once must not interleave, or the older flags could land last.
        self._install_lock = asyncio.Lock()
        # Units found running at adoption whose worker the config no longer names.
        self.strays: tuple[Running, ...] = ()

    # -- lifecycle ---------------------------------------------------------------

    async def open(self) -> None:
        """Connect, subscribe to systemd's signals, seed unit states, start the log follower."""
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sf-systemd")
        try:
            await self._call(self._connect)
            watcher = UnitWatcher(
                self._prefix, self._post_states, self._post_jobs, self._post_error
            )
            self._watcher = watcher
            watcher.start()
            await asyncio.to_thread(watcher.ready.wait)
            if self._watch_error is not None:
                raise RuntimeFailure(
                    f"cannot follow systemd over D-Bus: {dbus_error_text(self._watch_error)}; "
                    "is systemd PID 1 and dbus running?"
                ) from self._watch_error
        except BaseException:
            await self.close()  # a failed open leaves a closed runtime: build a new one
            raise
        if self._follow_logs:
            self._follower = JournalFollower(self._emit, lambda u: worker_of(u, self._prefix))
            self._follower.start()
        log.info("systemd_runtime_open", units=sorted(self._tracked))

    async def close(self) -> None:
        """Stop watching and following; the units keep running."""
        if self._closed:
            return
        self._closed = True
        if self._follower is not None:
            await self._follower.close()
        self._ordering.close()
        if self._watcher is not None:
            await asyncio.to_thread(self._watcher.stop)
        if self._executor is not None:
            with contextlib.suppress(Exception):
                await self._call(self._disconnect)
            self._executor.shutdown(wait=False)
        for fut in self._jobs.values():
            fut.cancel()

    # -- commands ----------------------------------------------------------------

    async def start(self, worker: int, command: Command) -> None:
        """Queue the unit's start job and return; Started follows from systemd's signals.

        `command` is not used: under systemd the command line lives in the unit's
        drop-in (install it, and daemon-reload, before starting). Should systemd still
        hold an older definition of the unit than its files (an agent that died between
        writing them and daemon-reload), it re-reads them first: a worker never starts
        from a stale definition.
        """
        unit = unit_name(worker, self._prefix)
        async with self._install_lock:
            if await self._call(self._stale, [unit]):
                log.warning("units_stale", units=[unit], action="daemon-reload")
                await self.daemon_reload()
        await self._job("StartUnit", worker)

    async def prepare(self, spec: FarmSpec, commands: Mapping[int, Command]) -> frozenset[int]:
        """Install every worker's drop-in (running `commands`); daemon-reload only on change.

        Called before each launch, so a unit always starts with the command line the agent
        means (its OOM-ladder step applied). Returns the workers whose secret files changed.
        """
        if self._units is None:
            return frozenset()
        render = self._units
        async with self._install_lock:
            # The secret files first (root-only), then the drop-ins that name them.
            secrets = render_secrets(spec, commands)
            changed = await asyncio.to_thread(install_secrets, secrets, credentials_dir(spec))
            # Rendered under the lock: calls install in the order they were made.
            await self._apply_units(render(spec, commands), RUN_UNIT_DIR)
        return changed

    async def confirm_ready(self, worker: int) -> bool:
        """The unit turns `active` only when its readiness gate (ExecStartPost=) passed.

        The agent calls a worker ready only then, so `systemctl` and the farm never disagree.
        """
        try:
            st = await self.wait_for(
                worker, lambda u: u.active_state != "activating", self._ready_gate_wait
            )
        except TimeoutError:
            return False
        return st.active_state == "active"

    def exit_pending(self, worker: int) -> bool:
        return self._ordering.pending(worker)

    async def worker_pids(self, worker: int) -> frozenset[int]:
        """The processes of the unit's cgroup (its MainPID's, checked to be the unit's own)."""
        t = self._tracked.get(worker)
        if t is None or not t.state.running:
            return frozenset()
        unit = unit_name(worker, self._prefix)
        return await asyncio.to_thread(unit_pids, t.state.main_pid, unit)

    async def _catch_up(self, worker: int) -> None:
        """The worker's journal lines the live follower has not delivered (see
        `journal.ExitOrdering`): read once, straight from the journal."""
        if self._follower is not None:
            await self._follower.catch_up([unit_name(worker, self._prefix)])

    def _live(self, worker: int) -> bool:
        t = self._tracked.get(worker)
        return t is not None and t.live_pid is not None

    async def stop(self, worker: int, timeout: float) -> None:
        """Stop the unit and wait until its stop job finished; SIGKILL all after `timeout`.

        systemd sends SIGTERM, and SIGKILL after the unit's TimeoutStopSec=; should the
        job still run after `timeout` (a longer TimeoutStopSec=), every process of the
        unit gets SIGKILL here. Emits Exited (from the signals) before returning.
        """
        unit = unit_name(worker, self._prefix)
        job = await self._job("StopUnit", worker)
        try:
            await asyncio.wait_for(self._job_done(job), timeout)
        except TimeoutError:
            log.warning("worker_stop_timeout", worker=worker, unit=unit, timeout_s=timeout)
            await self._call(self._kill, unit, int(signal.SIGKILL))
            try:
                await asyncio.wait_for(self._job_done(job), _KILL_GRACE)
            except TimeoutError as exc:
                raise RuntimeFailure(
                    f"{unit} still stopping {timeout + _KILL_GRACE:g}s after StopUnit, "
                    f"even after SIGKILL; see `systemctl status {unit}`"
                ) from exc
        # The job finished: read the final state through the same path as signals, so
        # Exited is out before we return even if its signal is still in flight.
        state = await self._call(self._read_unit, unit)
        self._apply({unit: state}, silent=False)

    async def adopt(self, configured: Collection[int] | None = None) -> Mapping[int, Running]:
        """Worker units found activating/active with a main process (they survive the agent),
        each with the command line it runs (`Running.argv`).

        With `configured` (the config's worker ids), a running unit whose worker is not
        among them is a stray: it holds a GPU and a port for a worker the config no
        longer has (a config shrunk while the agent was down). It is logged
        (`worker_stray`, warning), left out of the result, kept in `strays`, and stopped:
        its stop job is queued (SIGTERM: SGLang drains, then SIGKILL after the unit's
        TimeoutStopSec=) without waiting, so adoption is not delayed by it.
        """
        await self.open()
        units = await self._call(self._list, ("active", "activating", "reloading"))
        found: dict[int, Running] = {}
        strays: list[Running] = []
        for unit in units:
            worker = worker_of(unit, self._prefix)
            if worker is None:
                continue
            state, argv = await self._call(self._read_adoption, unit)
            self._apply({unit: state}, silent=True)
            if not state.running:
                continue
            running = Running(worker, state.main_pid, state.active_state == "active", argv)
            if configured is not None and worker not in configured:
                strays.append(running)
            else:
                found[worker] = running
        self.strays = tuple(strays)
        for stray in strays:
            unit = unit_name(stray.worker, self._prefix)
            log.warning(
                "worker_stray",
                worker=stray.worker,
                unit=unit,
                pid=stray.pid,
                argv=list(stray.argv) if stray.argv else None,
                action="stop",
                why="the config names no such worker; it holds a GPU and a port",
            )
            await self._job("StopUnit", stray.worker)
        log.info("systemd_adopted", workers=sorted(found), strays=[r.worker for r in strays])
        return found

    async def daemon_reload(self) -> None:
        """`systemctl daemon-reload`: call only when unit files changed."""
        await self.open()
        await self._call(self._reload)

    async def apply_units(
        self, files: Mapping[PurePosixPath, str], root: str | Path = RUN_UNIT_DIR
    ) -> UnitChanges:
        """Install rendered units; daemon-reload if something changed, or if systemd still
        holds an older definition of one of these units than its files (NeedDaemonReload:
        an agent that died between writing the files and reloading). One install at a
        time."""
        async with self._install_lock:
            return await self._apply_units(files, root)

    async def _apply_units(
        self, files: Mapping[PurePosixPath, str], root: str | Path
    ) -> UnitChanges:
        changes = await asyncio.to_thread(install_units, files, root)
        if changes.changed:
            await self.daemon_reload()
            log.info("units_installed", written=changes.written, removed=changes.removed)
            return changes
        stale = await self._call(self._stale, units_of(files))
        if stale:
            log.warning("units_stale", units=stale, action="daemon-reload")
            await self.daemon_reload()
        return changes

    async def unit_state(self, worker: int) -> UnitState:
        """A fresh read of the unit's properties over D-Bus."""
        await self.open()
        return await self._call(self._read_unit, unit_name(worker, self._prefix))

    def known_state(self, worker: int) -> UnitState | None:
        """The state last seen through signals (no I/O)."""
        t = self._tracked.get(worker)
        return t.state if t is not None else None

    async def wait_for(
        self, worker: int, predicate: Callable[[UnitState], bool], timeout: float
    ) -> UnitState:
        """Wait until the signal-fed state of `worker` satisfies `predicate`.

        Raises TimeoutError naming the last state seen.
        """
        await self.open()
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while True:
            state = self.known_state(worker)
            if state is not None and predicate(state):
                return state
            left = end - loop.time()
            if left <= 0:
                raise TimeoutError(f"worker {worker}: last state {state}")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)

    def log_tail(self, worker: int, lines: int) -> list[str]:
        """The unit's last `lines` journal lines, oldest first (blocking: runs journalctl)."""
        unit = unit_name(worker, self._prefix)
        cmd = ["journalctl", "--no-pager", "-q", "-u", unit, "-o", "cat", "-n", str(lines)]
        try:
            r = subprocess.run(
                cmd, capture_output=True, text=True, errors="replace", timeout=_LOG_TAIL_TIMEOUT
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeFailure(f"cannot read the journal of {unit}: {exc}") from exc
        if r.returncode != 0:
            raise RuntimeFailure(f"journalctl -u {unit} failed: {r.stderr.strip()}")
        return r.stdout.splitlines()

    # -- internals: command thread ---------------------------------------------

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        if self._loop is None:
            await self.open()
        if self._closed and fn is not self._disconnect:
            raise RuntimeFailure("the systemd runtime is closed")
        assert self._executor is not None
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _connect(self) -> None:
        bus = DBus()
        try:
            bus.open()
        except DBusBaseError as exc:
            raise RuntimeFailure(
                f"cannot connect to the system D-Bus: {dbus_error_text(exc)}; "
                "the systemd runtime needs systemd as PID 1 and dbus running "
                "(or use --runtime process)"
            ) from exc
        self._bus = bus

    def _disconnect(self) -> None:
        if self._bus is not None:
            self._bus.close()
            self._bus = None
            self._refd.clear()

    def _manager_call(self, method: str, *args: Any) -> Any:
        manager = Manager(bus=self._bus)
        manager.load()
        return getattr(manager.Manager, method)(*args)

    def _unit_job(self, method: str, unit: str) -> str:
        try:
            self._ref(unit)
            job = self._manager_call(method, unit.encode(), b"replace")
        except DBusBaseError as exc:
            raise RuntimeFailure(
                f"systemd refused {method} {unit}: {dbus_error_text(exc)}; "
                f"see `systemctl status {unit}` and `systemctl cat {unit}`"
            ) from exc
        return job.decode() if isinstance(job, bytes) else str(job)

    def _ref(self, unit: str) -> None:
        """Hold a reference on the unit for as long as our bus connection lives.

        Without one, systemd unloads ("garbage-collects") a unit soon after it turns
        inactive, and a later read shows a fresh unit with ExecMainCode/Status/Result
        gone: the stop's exit status would be lost.
        """
        if unit not in self._refd:
            self._bus.call_method(DEST, unit_path(unit), UNIT_IFACE, b"Ref", [])
            self._refd.add(unit)

    def _kill(self, unit: str, signo: int) -> None:
        try:
            self._manager_call("KillUnit", unit.encode(), b"all", signo)
        except DBusBaseError as exc:
            raise RuntimeFailure(
                f"systemd refused KillUnit {unit}: {dbus_error_text(exc)}"
            ) from exc

    def _reload(self) -> None:
        try:
            self._manager_call("Reload")
        except DBusBaseError as exc:
            raise RuntimeFailure(f"systemctl daemon-reload failed: {dbus_error_text(exc)}") from exc

    def _read_unit(self, unit: str) -> UnitState:
        try:
            self._ref(unit)
            return read_state(self._bus, unit)
        except DBusBaseError as exc:
            raise RuntimeFailure(
                f"cannot read the state of {unit}: {dbus_error_text(exc)}"
            ) from exc

    def _read_adoption(self, unit: str) -> tuple[UnitState, tuple[str, ...] | None]:
        """The unit's state and the command line its main process runs: its own
        /proc/PID/cmdline (what it was really started with, whatever was reloaded since),
        else the unit's ExecStart=."""
        try:
            self._ref(unit)
            service = get_all(self._bus, unit, SERVICE_IFACE)
            state = unit_state_from(get_all(self._bus, unit, UNIT_IFACE), service)
        except DBusBaseError as exc:
            raise RuntimeFailure(
                f"cannot read the state of {unit}: {dbus_error_text(exc)}"
            ) from exc
        argv = proc_argv(state.main_pid) if state.main_pid > 0 else None
        return state, argv or exec_start_argv(service)

    def _stale(self, units: list[str]) -> list[str]:
        """The units among `units` whose files changed since systemd last read them."""
        try:
            return [
                u
                for u in units
                if get_all(self._bus, u, UNIT_IFACE).get("NeedDaemonReload") is True
            ]
        except DBusBaseError as exc:
            raise RuntimeFailure(
                f"cannot read NeedDaemonReload of {', '.join(units)}: {dbus_error_text(exc)}"
            ) from exc

    def _list(self, states: tuple[str, ...]) -> list[str]:
        try:
            return list_units(self._bus, self._prefix, states)
        except DBusBaseError as exc:
            raise RuntimeFailure(
                f"cannot list {self._prefix}@ units: {dbus_error_text(exc)}"
            ) from exc

    async def _job(self, method: str, worker: int) -> str:
        unit = unit_name(worker, self._prefix)
        job = await self._call(self._unit_job, method, unit)
        log.info("unit_job_queued", worker=worker, unit=unit, method=method, job=job)
        return job

    async def _job_done(self, job: str) -> str:
        """Wait for JobRemoved of `job`; returns its result ("done", "canceled", ...)."""
        if job in self._done_jobs:
            return self._done_jobs.pop(job)
        fut = self._jobs.get(job)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._jobs[job] = fut
        return await asyncio.shield(fut)

    # -- internals: from the watcher thread (posted to the loop) -------------------

    def _post_states(self, states: dict[str, UnitState], silent: bool) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # loop closed: nobody is listening anymore
            self._loop.call_soon_threadsafe(self._apply, states, silent)

    def _post_jobs(self, jobs: list[tuple[str, str, str]]) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._jobs_removed, jobs)

    def _post_error(self, exc: BaseException) -> None:
        self._watch_error = exc
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._watch_failed, exc)

    def _watch_failed(self, exc: BaseException) -> None:
        log.error("systemd_watch_failed", error=dbus_error_text(exc))

    def _apply(self, states: dict[str, UnitState], silent: bool) -> None:
        for unit, state in states.items():
            worker = worker_of(unit, self._prefix)
            if worker is None:
                continue
            prev = self._tracked.get(worker)
            tracked, events = observe(worker, prev, state, silent=silent)
            self._tracked[worker] = tracked
            if prev is None or prev.state != state:
                log.debug(
                    "unit_state",
                    worker=worker,
                    active_state=state.active_state,
                    sub_state=state.sub_state,
                    main_pid=state.main_pid,
                    result=state.result,
                )
            for ev in events:
                self._emit(ev)
        self._changed.set()

    def _jobs_removed(self, jobs: list[tuple[str, str, str]]) -> None:
        for job, _unit, result in jobs:
            fut = self._jobs.pop(job, None)
            if fut is not None:
                if not fut.done():
                    fut.set_result(result)
            else:
                self._done_jobs[job] = result
                # Only jobs someone may still wait for matter; keep the memory bounded.
                while len(self._done_jobs) > 256:
                    self._done_jobs.pop(next(iter(self._done_jobs)))


__all__ = [
    "RUN_UNIT_DIR",
    "SystemdRuntime",
    "install_secrets",
    "install_units",
]
