"""I/O: the systemd runtime's journal: following worker output, and ordering exits after it.

`JournalFollower` runs one `journalctl -f -o json` for every `sglang@` unit and turns
each entry into `LogLine`s (the worker's own lines and systemd's lines about the unit,
as `journalctl -u` shows them).

`ExitOrdering` exists because the journal and D-Bus are two channels: systemd may report
a unit's exit over D-Bus before the journal has delivered the worker's last lines (the
CUDA OOM text, the traceback). The classifier needs those lines before the exit is
judged, so an `Exited` is held until systemd's own "Main process exited" line for the
unit has come through the journal, or `grace` seconds have passed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import Callable

import structlog

from sglang_farm.runtime import Emit, Exited, LogLine, RuntimeEvent, Started

log = structlog.get_logger("sglang_farm.runtime.journal")

# systemd's own journal lines when a unit's main process is gone: the worker's output ends here.
SYSTEMD_EXIT_LINES = re.compile(r"Main process exited, code=|Failed with result '")
# Delay before re-running a journalctl follower that died (journald restarted, ...).
FOLLOW_RETRY_S = 1.0


class ExitOrdering:
    """Passes events on, holding each `Exited` until the journal's exit line (or `grace`).

    `live(worker)` says whether the runtime still believes the worker's process runs:
    systemd writes two exit lines per exit, and the second one, arriving when nothing of
    the worker is live, must not pre-empt the next process's exit.
    """

    def __init__(self, emit: Emit, grace: float, live: Callable[[int], bool]) -> None:
        self._emit = emit
        self._grace = grace
        self._live = live
        self._pending: dict[int, Exited] = {}
        self._line_seen: set[int] = set()
        self._timers: dict[int, asyncio.TimerHandle] = {}

    def pending(self, worker: int) -> bool:
        """True while the worker's exit is known and only its last log lines are awaited."""
        return worker in self._pending

    def feed(self, ev: RuntimeEvent) -> None:
        match ev:
            case Started(worker=w):
                self._line_seen.discard(w)  # lines about an earlier process
                self._emit(ev)
            case LogLine(worker=w, text=text):
                self._emit(ev)
                if SYSTEMD_EXIT_LINES.search(text):
                    if w in self._pending:
                        self._release(w)
                    elif self._live(w):
                        self._line_seen.add(w)  # the line came before D-Bus reported the exit
            case Exited(worker=w):
                if self._grace <= 0 or w in self._line_seen:
                    self._line_seen.discard(w)
                    self._emit(ev)
                else:
                    self._pending[w] = ev
                    loop = asyncio.get_running_loop()
                    self._timers[w] = loop.call_later(self._grace, self._release, w)

    def _release(self, worker: int) -> None:
        timer = self._timers.pop(worker, None)
        if timer is not None:
            timer.cancel()
        ev = self._pending.pop(worker, None)
        self._line_seen.discard(worker)
        if ev is not None:
            self._emit(ev)

    def close(self) -> None:
        for t in self._timers.values():
            t.cancel()
        self._timers.clear()


def worker_entry_lines(
    entry: object, worker_of: Callable[[str], int | None]
) -> tuple[int | None, list[str], str | None]:
    """Pure: one journal JSON entry -> (worker, its lines, cursor)."""
    if not isinstance(entry, dict):
        return None, [], None
    unit = entry.get("_SYSTEMD_UNIT")
    worker = worker_of(unit) if isinstance(unit, str) else None
    if worker is None and entry.get("_PID") == "1" and isinstance(entry.get("UNIT"), str):
        worker = worker_of(entry["UNIT"])  # systemd's own line about the unit
    lines: list[str] = []
    if worker is not None:
        msg = entry.get("MESSAGE")
        if isinstance(msg, list):  # journald stores non-UTF-8 messages as byte arrays
            msg = bytes(b for b in msg if isinstance(b, int)).decode("utf-8", "replace")
        if isinstance(msg, str):
            lines = msg.splitlines() or [""]
    c = entry.get("__CURSOR")
    return worker, lines, c if isinstance(c, str) else None


class JournalFollower:
    """Feeds `LogLine` events from the journal until closed; restarts journalctl if it dies."""

    def __init__(self, emit: Emit, worker_of: Callable[[str], int | None]) -> None:
        self._emit = emit
        self._worker_of = worker_of
        self._closed = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._follow(), name="sf-journal-follow")

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _follow(self) -> None:
        cursor: str | None = None
        while not self._closed:
            args = ["journalctl", "-f", "-q", "-o", "json", "--no-pager"]
            args += ["--after-cursor", cursor] if cursor else ["-n", "0"]
            try:
                proc = await asyncio.create_subprocess_exec(
                    *args,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.DEVNULL,
                    limit=1 << 20,
                )
            except OSError as exc:
                log.error("journal_follow_failed", error=str(exc))
                await asyncio.sleep(FOLLOW_RETRY_S)
                continue
            assert proc.stdout is not None  # asked for with PIPE
            try:
                async for raw in proc.stdout:
                    cursor = self._line(raw) or cursor
            except (asyncio.LimitOverrunError, ValueError) as exc:
                log.warning("journal_line_skipped", error=str(exc))
            finally:
                if proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
                    await proc.wait()
            if not self._closed:
                log.warning("journal_follow_restarting", returncode=proc.returncode)
                await asyncio.sleep(FOLLOW_RETRY_S)

    def _line(self, raw: bytes) -> str | None:
        try:
            entry = json.loads(raw)
        except ValueError:
            return None
        worker, lines, cursor = worker_entry_lines(entry, self._worker_of)
        if worker is not None:
            for line in lines:
                self._emit(LogLine(worker, line))
        return cursor
