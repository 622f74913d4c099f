"""I/O: workers as systemd units `sglang@N.service`, driven over the system D-Bus with pystemd.

This is the only module that imports pystemd. What it does:

- Commands (StartUnit/StopUnit/RestartUnit/KillUnit, mode "replace", Reload,
  ListUnitsByPatterns, property reads) run on ONE dedicated thread that owns one bus
  connection: pystemd is blocking and sd-bus connections are not thread-safe, so
  nothing of it runs on the event loop and no connection is shared between threads.
- State changes come from D-Bus signals, not polling: a watcher thread subscribes
  (Manager.Subscribe; systemd sends unit signals only while someone is subscribed),
  matches PropertiesChanged on unit objects and JobRemoved on the manager, sleeps in
  select() on the bus fd (plus a wake-up pipe for close), reads the touched
  `sglang@` units' properties on a second connection, and posts the snapshots to the
  loop with `call_soon_threadsafe`. The loop turns snapshots into `Started`/`Exited`
  with the pure `observe()`.
- Output: `runtime.journal` follows the journal into `LogLine`s and holds each exit
  until the worker's last lines are in; `log_tail` runs `journalctl -u sglang@N -o cat -n K`.

Where generated units go: **/run/systemd/system** (see `install_units`). The static
template `sglang@.service` ships in /lib/systemd/system; everything derived from
farm.toml is a drop-in the agent regenerates at each start. /run is the right place
for that: it vanishes at reboot, so no stale generated state outlives the config it
came from (an /etc drop-in left by an old config or an uninstalled package would keep
applying, and /etc is the administrator's, who may override us there: /etc beats /run
in systemd's search path). A worker cannot start before the agent has rendered its
drop-in (the template has no ExecStart=), which is what we want after a reboot.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import subprocess
import threading
from collections.abc import Callable, Collection, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

import structlog
from pystemd.dbusexc import DBusBaseError
from pystemd.dbuslib import DBus, apply_signature, path_decode, path_encode
from pystemd.systemd1 import Manager

from sglang_farm.errors import RuntimeFailure
from sglang_farm.runtime import Emit, Exited, Running, RuntimeEvent, Started
from sglang_farm.runtime.journal import ExitOrdering, JournalFollower
from sglang_farm.runtime.unit_files import (
    UnitChanges,
    secrets_changed_workers,
    write_secrets,
    write_units,
)
from sglang_farm.sglang_argv import Command
from sglang_farm.spec import FarmSpec
from sglang_farm.unit_secrets import credentials_dir, render_secrets
from sglang_farm.unit_syntax import GATEWAY_UNIT
from sglang_farm.unit_syntax import worker_unit as unit_name

UnitFiles = Mapping[PurePosixPath, str]

log = structlog.get_logger("sglang_farm.runtime.systemd")

T = TypeVar("T")

RUN_UNIT_DIR = "/run/systemd/system"

_DEST = b"org.freedesktop.systemd1"
_MANAGER_PATH = b"/org/freedesktop/systemd1"
_MANAGER_IFACE = b"org.freedesktop.systemd1.Manager"
_UNIT_PREFIX_PATH = b"/org/freedesktop/systemd1/unit"
_PROPS_IFACE = b"org.freedesktop.DBus.Properties"
_UNIT_IFACE = b"org.freedesktop.systemd1.Unit"
_SERVICE_IFACE = b"org.freedesktop.systemd1.Service"

# siginfo si_code values systemd reports as ExecMainCode (waitid(2)).
CLD_EXITED, CLD_KILLED, CLD_DUMPED = 1, 2, 3

_RUNNING_STATES = frozenset({"activating", "active", "reloading"})
_DOWN_STATES = frozenset({"inactive", "failed"})
# A stop that outlives its timeout gets SIGKILL; then this long for the cgroup to empty.
_KILL_GRACE = 10.0
# D-Bus calls are local and answer in milliseconds; systemd itself may take a while
# during a daemon-reload, which sd-bus bounds at 25 s per call.
_LOG_TAIL_TIMEOUT = 10.0
# Bounded wait for the watcher thread to exit at close (it wakes at once via the pipe).
_JOIN_TIMEOUT = 5.0


# --- pure part -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class UnitState:
    """The properties of one worker unit that the farm reads."""

    active_state: str = "inactive"
    sub_state: str = "dead"
    main_pid: int = 0
    exec_main_pid: int = 0
    exec_main_code: int = 0  # 0 while running; CLD_* once the main process exited
    exec_main_status: int = 0
    result: str = "success"
    n_restarts: int = 0

    @property
    def running(self) -> bool:
        return self.active_state in _RUNNING_STATES and self.main_pid > 0

    @property
    def exit_status(self) -> int | None:
        """The last main process's exit: >= 0 exit code, < 0 killing signal, None if unknown."""
        return exit_status(self.exec_main_code, self.exec_main_status)


@dataclass(frozen=True, slots=True)
class Tracked:
    """What the loop knows of one unit: its last state and which main PID is reported live."""

    state: UnitState
    live_pid: int | None = None  # Started emitted, Exited not yet
    ended_pid: int | None = None  # the last PID Exited was emitted for


def exit_status(code: int, status: int) -> int | None:
    """Map systemd's ExecMainCode/ExecMainStatus to the farm's status (CLD_KILLED 9 -> -9)."""
    if code == CLD_EXITED:
        return status
    if code in (CLD_KILLED, CLD_DUMPED):
        return -status
    return None


def worker_of(unit: str, prefix: str = "sglang") -> int | None:
    """`sglang@3.service` -> 3; None for any other unit."""
    head = f"{prefix}@"
    if not (unit.startswith(head) and unit.endswith(".service")):
        return None
    inst = unit[len(head) : -len(".service")]
    return int(inst) if inst.isdecimal() else None


def observe(
    worker: int, prev: Tracked | None, new: UnitState, *, silent: bool = False
) -> tuple[Tracked, list[RuntimeEvent]]:
    """Fold one observed unit state into what is known; return the events it implies.

    Snapshots may skip intermediate states (systemd coalesces signals and we read
    the newest properties), and may arrive stale; each rule copes with both.
    `silent` seeds the state (agent start, adoption) without events.
    """
    live = prev.live_pid if prev is not None else None
    ended = prev.ended_pid if prev is not None else None
    events: list[RuntimeEvent] = []
    if live is not None:
        if new.exec_main_pid == live and new.exec_main_code != 0:
            # running -> exited: systemd recorded how this very process ended.
            events.append(Exited(worker, live, new.exit_status, new.result))
            ended, live = live, None
        elif new.main_pid != live and (new.main_pid != 0 or new.active_state in _DOWN_STATES):
            # running -> gone without its exit record (a newer run replaced it already).
            events.append(Exited(worker, live, None, new.result))
            ended, live = live, None
    elif (
        prev is not None
        and prev.state.active_state in _RUNNING_STATES | {"deactivating"}
        and new.active_state in _DOWN_STATES
        and new.exec_main_pid not in (0, ended)
        and new.exec_main_pid != prev.state.exec_main_pid
    ):
        # activating -> failed before a MainPID was ever seen (exec failed at once).
        events.append(Exited(worker, new.exec_main_pid, new.exit_status, new.result))
        ended = new.exec_main_pid
    if live is None and new.running and new.main_pid != ended:
        # -> a new main process while activating/active: a (re)start of the worker.
        events.append(Started(worker, new.main_pid))
        live = new.main_pid
    return Tracked(new, live, ended), ([] if silent else events)


def unit_state_from(unit_props: Mapping[str, Any], service_props: Mapping[str, Any]) -> UnitState:
    """Build a UnitState from GetAll() dicts (str keys; bytes values decoded here)."""

    def s(v: Any, default: str) -> str:
        return v.decode() if isinstance(v, bytes) else (v if isinstance(v, str) else default)

    def i(v: Any) -> int:
        return int(v) if isinstance(v, int) else 0

    return UnitState(
        active_state=s(unit_props.get("ActiveState"), "inactive"),
        sub_state=s(unit_props.get("SubState"), "dead"),
        main_pid=i(service_props.get("MainPID")),
        exec_main_pid=i(service_props.get("ExecMainPID")),
        exec_main_code=i(service_props.get("ExecMainCode")),
        exec_main_status=i(service_props.get("ExecMainStatus")),
        result=s(service_props.get("Result"), "success"),
        n_restarts=i(service_props.get("NRestarts")),
    )


def exec_start_argv(service_props: Mapping[str, Any]) -> tuple[str, ...] | None:
    """The argv of the unit's (last) ExecStart= from a Service GetAll() dict, or None.

    The property is `a(sasbttttuii)`: per command, the path, the argv, and run-time
    fields; a worker's drop-in has exactly one command.
    """
    commands = service_props.get("ExecStart")
    if not isinstance(commands, list | tuple) or not commands:
        return None
    entry = commands[-1]
    if not isinstance(entry, list | tuple) or len(entry) < 2:
        return None
    argv = entry[1]
    if not isinstance(argv, list | tuple):
        return None
    return tuple(a.decode() if isinstance(a, bytes) else str(a) for a in argv)


def proc_argv(pid: int, proc: str = "/proc") -> tuple[str, ...] | None:
    """The command line process `pid` runs (`/proc/PID/cmdline`); None if unreadable or empty."""
    try:
        with open(f"{proc}/{pid}/cmdline", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    if not raw:
        return None
    return tuple(a.decode("utf-8", "surrogateescape") for a in raw.rstrip(b"\0").split(b"\0"))


def unit_cgroup(pid: int, unit: str, proc: str = "/proc") -> str | None:
    """The line of `/proc/PID/cgroup` that puts process `pid` in unit `unit`'s own cgroup
    ("0::/system.slice/.../sglang@3.service", or on a hybrid host the
    "N:name=systemd:..." one), else None.

    `pid` is the MainPID systemd reports; a process cannot leave its unit's cgroup (the
    tree under system.slice is root's), so the unit's processes are its members.
    """
    try:
        with open(f"{proc}/{pid}/cgroup") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    ours = [ln for ln in lines if ln.rsplit("/", 1)[-1] == unit]
    ours.sort(key=lambda ln: not ln.startswith("0::"))  # the unified hierarchy first
    return ours[0] if ours else None


def cgroup_pids(path: str, root: str = "/sys/fs/cgroup") -> frozenset[int]:
    """Every process in cgroup `path` and the cgroups below it (`cgroup.procs`)."""
    out: set[int] = set()
    for dirpath, _dirs, _files in os.walk(root + path):
        try:
            with open(os.path.join(dirpath, "cgroup.procs")) as fh:
                out.update(int(x) for x in fh.read().split())
        except (OSError, ValueError):
            continue
    return frozenset(out)


def _cgroup_members(line: str, proc: str) -> frozenset[int]:
    """The processes whose `/proc/PID/cgroup` holds `line` (or a cgroup below it): the way
    when the cgroup file system is not where it is looked for."""
    out: set[int] = set()
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        try:
            with open(f"{proc}/{entry}/cgroup") as fh:
                lines = fh.read().splitlines()
        except OSError:
            continue
        if any(ln == line or ln.startswith(line + "/") for ln in lines):
            out.add(int(entry))
    return frozenset(out)


def unit_pids(
    main_pid: int, unit: str, proc: str = "/proc", root: str = "/sys/fs/cgroup"
) -> frozenset[int]:
    """The processes of `unit`, found from its main process's cgroup; empty if unknown."""
    line = unit_cgroup(main_pid, unit, proc)
    if line is None:
        return frozenset()
    hierarchy, _, path = line.partition(":")[2].partition(":")
    # cgroup v2 at /sys/fs/cgroup; on a hybrid host its unified tree and systemd's own
    # v1 tree are mounted below it.
    roots = [root, f"{root}/unified"] if not hierarchy else [f"{root}/systemd"]
    for r in roots:
        if os.path.isfile(f"{r}{path}/cgroup.procs"):
            return cgroup_pids(path, r) | {main_pid}
    return _cgroup_members(line, proc) | {main_pid}


def units_of(files: Iterable[PurePosixPath]) -> list[str]:
    """The unit names rendered files belong to: `sglang@3.service.d/50-farm.conf` ->
    `sglang@3.service`, a whole unit file -> itself; sorted, without duplicates."""
    names = {p.parts[0].removesuffix(".d") for p in files if p.parts}
    return sorted(n for n in names if n.endswith((".service", ".target")))


# --- pystemd adapter (blocking; runs on the command thread or the watcher thread) ----


def _unit_path(unit: str) -> bytes:
    return bytes(path_encode(_UNIT_PREFIX_PATH, unit.encode()))


def _decode_keys(d: Any) -> dict[str, Any]:
    if not isinstance(d, dict):
        return {}
    return {(k.decode() if isinstance(k, bytes) else str(k)): v for k, v in d.items()}


def _get_all(bus: Any, unit: str, iface: bytes) -> dict[str, Any]:
    # Reading a unit's object path loads the unit if needed (systemd's bus_unit_find),
    # so this works for units not loaded yet: they read as inactive/dead.
    reply = bus.call_method(
        _DEST, _unit_path(unit), _PROPS_IFACE, b"GetAll", apply_signature(b"s", [iface])
    )
    return _decode_keys(reply.body)


def _read_state(bus: Any, unit: str) -> UnitState:
    return unit_state_from(_get_all(bus, unit, _UNIT_IFACE), _get_all(bus, unit, _SERVICE_IFACE))


def _list_units(bus: Any, prefix: str, states: Iterable[str] = ()) -> list[str]:
    manager = Manager(bus=bus)
    manager.load()
    rows = manager.Manager.ListUnitsByPatterns(
        [s.encode() for s in states], [f"{prefix}@*.service".encode()]
    )
    return [r[0].decode() if isinstance(r[0], bytes) else str(r[0]) for r in rows]


def _dbus_error_text(exc: BaseException) -> str:
    return str(exc).strip() or exc.__class__.__name__


class _Watcher(threading.Thread):
    """Listens to systemd's signals; posts (unit, state) snapshots and finished jobs."""

    def __init__(
        self,
        prefix: str,
        on_states: Callable[[dict[str, UnitState], bool], None],
        on_jobs: Callable[[list[tuple[str, str, str]]], None],
        on_error: Callable[[BaseException], None],
    ) -> None:
        super().__init__(name="sf-systemd-watch", daemon=True)
        self._prefix = prefix
        self._path_prefix = bytes(path_encode(_UNIT_PREFIX_PATH, f"{prefix}@".encode()))
        self._on_states = on_states
        self._on_jobs = on_jobs
        self._on_error = on_error
        self._wake_r, self._wake_w = os.pipe()
        self._stopping = False
        self.ready = threading.Event()
        self._pending: set[str] = set()
        self._jobs: list[tuple[str, str, str]] = []
        self._hits = 0
        self._callbacks: tuple[Callable[..., None], ...] = ()

    def stop(self) -> None:
        self._stopping = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        self.join(_JOIN_TIMEOUT)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    # Callbacks run inside bus.process(); pystemd cannot surface their exceptions.
    def _on_props(self, msg: Any) -> None:
        self._hits += 1
        with contextlib.suppress(Exception):
            path = bytes(msg.get_path())
            if path.startswith(self._path_prefix):
                self._pending.add(bytes(path_decode(path, _UNIT_PREFIX_PATH)).decode())

    def _on_job_removed(self, msg: Any) -> None:
        self._hits += 1
        with contextlib.suppress(Exception):
            msg.process_reply(False)
            _id, job, unit, result = msg.body
            unit_s = unit.decode() if isinstance(unit, bytes) else str(unit)
            if worker_of(unit_s, self._prefix) is not None:
                job_s = job.decode() if isinstance(job, bytes) else str(job)
                res_s = result.decode() if isinstance(result, bytes) else str(result)
                self._jobs.append((job_s, unit_s, res_s))
                self._pending.add(unit_s)

    def _drain(self, sig: Any, fd: int) -> None:
        # sd_bus_process() handles one message per call and its return value is not
        # exposed by pystemd: call it until a call neither hit a callback nor returned
        # an unhandled message, and the socket has nothing more to read.
        while True:
            before = self._hits
            msg = sig.process()
            if self._hits == before and msg.is_empty():
                readable, _, _ = select.select([fd], [], [], 0)
                if not readable:
                    return

    def run(self) -> None:
        sig = DBus()
        query = DBus()
        try:
            sig.open()
            query.open()
            # pystemd sets an attribute on the callback (so no bound method) and keeps
            # only a raw pointer to it (so we hold the reference).
            self._callbacks = (
                lambda msg, error=None, userdata=None: self._on_props(msg),
                lambda msg, error=None, userdata=None: self._on_job_removed(msg),
            )
            on_props, on_job = self._callbacks
            sig.match_signal(_DEST, None, _PROPS_IFACE, b"PropertiesChanged", on_props)
            sig.match_signal(_DEST, _MANAGER_PATH, _MANAGER_IFACE, b"JobRemoved", on_job)
            sig.call_method(_DEST, _MANAGER_PATH, _MANAGER_IFACE, b"Subscribe", [])
            fd = sig.get_fd()
            self._drain(sig, fd)
            self._pending.clear()
            # Seed after subscribing, so no change between the two can be missed.
            seed = {u: _read_state(query, u) for u in _list_units(query, self._prefix)}
            self._on_states(seed, True)
            self.ready.set()
            while not self._stopping:
                readable, _, _ = select.select([fd, self._wake_r], [], [])
                if self._wake_r in readable:
                    break
                self._drain(sig, fd)
                if self._pending:
                    states = {u: _read_state(query, u) for u in sorted(self._pending)}
                    self._pending.clear()
                    self._on_states(states, False)
                if self._jobs:
                    # After the states: a finished job's unit state is already known.
                    jobs, self._jobs = self._jobs, []
                    self._on_jobs(jobs)
        except BaseException as exc:  # thread root: report to the loop, which logs it
            if not self._stopping:
                self._on_error(exc)
        finally:
            self.ready.set()
            for bus in (sig, query):
                with contextlib.suppress(Exception):
                    bus.close()


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
        self._watcher: _Watcher | None = None
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
            watcher = _Watcher(self._prefix, self._post_states, self._post_jobs, self._post_error)
            self._watcher = watcher
            watcher.start()
            await asyncio.to_thread(watcher.ready.wait)
            if self._watch_error is not None:
                raise RuntimeFailure(
                    f"cannot follow systemd over D-Bus: {_dbus_error_text(self._watch_error)}; "
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
                f"cannot connect to the system D-Bus: {_dbus_error_text(exc)}; "
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
                f"systemd refused {method} {unit}: {_dbus_error_text(exc)}; "
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
            self._bus.call_method(_DEST, _unit_path(unit), _UNIT_IFACE, b"Ref", [])
            self._refd.add(unit)

    def _kill(self, unit: str, signo: int) -> None:
        try:
            self._manager_call("KillUnit", unit.encode(), b"all", signo)
        except DBusBaseError as exc:
            raise RuntimeFailure(
                f"systemd refused KillUnit {unit}: {_dbus_error_text(exc)}"
            ) from exc

    def _reload(self) -> None:
        try:
            self._manager_call("Reload")
        except DBusBaseError as exc:
            raise RuntimeFailure(
                f"systemctl daemon-reload failed: {_dbus_error_text(exc)}"
            ) from exc

    def _read_unit(self, unit: str) -> UnitState:
        try:
            self._ref(unit)
            return _read_state(self._bus, unit)
        except DBusBaseError as exc:
            raise RuntimeFailure(
                f"cannot read the state of {unit}: {_dbus_error_text(exc)}"
            ) from exc

    def _read_adoption(self, unit: str) -> tuple[UnitState, tuple[str, ...] | None]:
        """The unit's state and the command line its main process runs: its own
        /proc/PID/cmdline (what it was really started with, whatever was reloaded since),
        else the unit's ExecStart=."""
        try:
            self._ref(unit)
            service = _get_all(self._bus, unit, _SERVICE_IFACE)
            state = unit_state_from(_get_all(self._bus, unit, _UNIT_IFACE), service)
        except DBusBaseError as exc:
            raise RuntimeFailure(
                f"cannot read the state of {unit}: {_dbus_error_text(exc)}"
            ) from exc
        argv = proc_argv(state.main_pid) if state.main_pid > 0 else None
        return state, argv or exec_start_argv(service)

    def _stale(self, units: list[str]) -> list[str]:
        """The units among `units` whose files changed since systemd last read them."""
        try:
            return [
                u
                for u in units
                if _get_all(self._bus, u, _UNIT_IFACE).get("NeedDaemonReload") is True
            ]
        except DBusBaseError as exc:
            raise RuntimeFailure(
                f"cannot read NeedDaemonReload of {', '.join(units)}: {_dbus_error_text(exc)}"
            ) from exc

    def _list(self, states: tuple[str, ...]) -> list[str]:
        try:
            return _list_units(self._bus, self._prefix, states)
        except DBusBaseError as exc:
            raise RuntimeFailure(
                f"cannot list {self._prefix}@ units: {_dbus_error_text(exc)}"
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
        log.error("systemd_watch_failed", error=_dbus_error_text(exc))

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


class UnitGateway:
    """The managed gateway as its own unit, `sglang-farm-gateway.service` (rendered into
    /run/systemd/system with the workers' drop-ins): systemd runs and restarts it, and it
    outlives the agent like the workers do."""

    def __init__(self, unit: str = GATEWAY_UNIT) -> None:
        self.unit = unit

    async def start(self) -> None:
        await asyncio.to_thread(self._start)

    def _start(self) -> None:
        try:
            with Manager() as m:
                m.Manager.StartUnit(self.unit.encode(), b"replace")
        except DBusBaseError as exc:
            raise RuntimeFailure(
                f"cannot start {self.unit}: {_dbus_error_text(exc)}; "
                f"see `systemctl status {self.unit}`"
            ) from exc

    async def close(self) -> None:
        """Nothing: the unit keeps routing while the agent restarts."""


__all__ = [
    "GATEWAY_UNIT",
    "RUN_UNIT_DIR",
    "SystemdRuntime",
    "Tracked",
    "UnitGateway",
    "UnitState",
    "exec_start_argv",
    "exit_status",
    "install_units",
    "observe",
    "proc_argv",
    "unit_name",
    "unit_state_from",
    "units_of",
    "worker_of",
]
