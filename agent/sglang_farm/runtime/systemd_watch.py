"""I/O: the thread that follows systemd's signals for the worker units (`UnitWatcher`).

State changes come from D-Bus signals, not polling: the watcher subscribes
(Manager.Subscribe; systemd sends unit signals only while someone is subscribed),
matches PropertiesChanged on unit objects and JobRemoved on the manager, sleeps in
select() on the bus fd (plus a wake-up pipe for close), reads the touched `sglang@`
units' properties on a second connection, and hands the snapshots and finished jobs
to call-backs (the runtime posts them to its loop). It owns both its connections.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
from collections.abc import Callable
from typing import Any

from pystemd.dbuslib import DBus, path_decode, path_encode

from sglang_farm.runtime.systemd_bus import (
    DEST,
    MANAGER_IFACE,
    MANAGER_PATH,
    PROPS_IFACE,
    UNIT_PREFIX_PATH,
    list_units,
    read_state,
)
from sglang_farm.runtime.unit_state import UnitState, worker_of

# Bounded wait for the watcher thread to exit at close (it wakes at once via the pipe).
_JOIN_TIMEOUT = 5.0


class UnitWatcher(threading.Thread):
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
        self._path_prefix = bytes(path_encode(UNIT_PREFIX_PATH, f"{prefix}@".encode()))
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
                self._pending.add(bytes(path_decode(path, UNIT_PREFIX_PATH)).decode())

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
            sig.match_signal(DEST, None, PROPS_IFACE, b"PropertiesChanged", on_props)
            sig.match_signal(DEST, MANAGER_PATH, MANAGER_IFACE, b"JobRemoved", on_job)
            sig.call_method(DEST, MANAGER_PATH, MANAGER_IFACE, b"Subscribe", [])
            fd = sig.get_fd()
            self._drain(sig, fd)
            self._pending.clear()
            # Seed after subscribing, so no change between the two can be missed.
            seed = {u: read_state(query, u) for u in list_units(query, self._prefix)}
            self._on_states(seed, True)
            self.ready.set()
            while not self._stopping:
                readable, _, _ = select.select([fd, self._wake_r], [], [])
                if self._wake_r in readable:
                    break
                self._drain(sig, fd)
                if self._pending:
                    states = {u: read_state(query, u) for u in sorted(self._pending)}
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
