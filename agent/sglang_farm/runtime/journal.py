"""I/O: the systemd runtime's journal: following worker output, and ordering exits after it.

`JournalFollower` polls: every `POLL_S` it runs a one-shot `journalctl -o json` after the
last cursor it read, restricted to the farm's worker units and to the fields it reads
(`follow_args`), and turns each entry into `LogLine`s (the worker's own lines and
systemd's lines about the unit, as `journalctl -u` shows them). Not `journalctl
--follow`: under the agent unit's ProtectKernelTunables= or ProtectControlGroups=,
`--follow` delivered no new entry at all (systemd 252: its inotify wake-ups came, the
entries did not), while a one-shot read after a cursor sees every entry; those two
directives are worth more than a process every half second.
It does not use `journalctl -u 'sglang@*'`: journalctl expands such a pattern once, at
start, against the unit names already in the journal (systemd's journalctl.c,
`add_units`), so a worker unit that had not logged yet would never be followed, and with
none at all journalctl exits ("No data available"). Instead the follower names each unit
it knows, learns new ones from systemd's "Starting" entry for them (logged before the
unit's first process runs), and then reads again after that entry's cursor with the new
unit among its matches, so nothing is lost or read twice. An entry longer than
`LINE_LIMIT` is skipped, never replayed: one such entry must not blind the follower.
A failed read (journald restarting) is retried from the same cursor; only after
`FOLLOW_FAILURES_BEFORE_SINCE` failures in a row is the cursor given up, for the
wall-clock second of the last entry read (never "now": the lines in between would be lost).

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
import math
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection

import structlog

from sglang_farm.runtime import Emit, Exited, LogLine, RuntimeEvent, Started

log = structlog.get_logger("sglang_farm.runtime.journal")

# systemd's own journal lines when a unit's main process is gone: the worker's output ends here.
SYSTEMD_EXIT_LINES = re.compile(r"Main process exited, code=|Failed with result '")
# How often the follower reads the journal: a worker's line reaches the classifier and
# `farmctl logs -f` at most this late (an exit waits for its lines: `ExitOrdering`).
POLL_S = 0.5
# Delay before reading again after journalctl failed (journald restarted, ...).
FOLLOW_RETRY_S = 1.0
# Failed reads in a row after which the follower stops asking for its last cursor (one
# journalctl cannot seek to any more: its file vacuumed or rotated away) and reads from
# the wall-clock second of the last entry it read instead. Fewer failures are retried
# from the cursor: a journald restart must not hide the lines logged meanwhile.
FOLLOW_FAILURES_BEFORE_SINCE = 5
# The longest journalctl output line (one entry) the follower reads; longer ones are skipped.
# With `--all` a MESSAGE comes whole (without it, journalctl prints null for any field of
# 4 KiB or more); a worker's stdout line is at most journald's LineMax= (48 KiB by default).
LINE_LIMIT = 1 << 20
# Read size for journalctl's output.
_CHUNK = 1 << 16
# The only fields the follower reads (journalctl adds __CURSOR and the timestamps anyway).
FOLLOW_FIELDS = ("MESSAGE", "_SYSTEMD_UNIT", "UNIT", "_PID", "__CURSOR")
# systemd's MESSAGE_ID for "Starting <unit>..." (SD_MESSAGE_UNIT_STARTING, systemd's
# src/systemd/sd-messages.h): how the follower learns of a worker unit it does not know yet.
UNIT_STARTING = "7d4958e842da4a758f6c1cdc7b36dcc5"


# When the live follower has not delivered a worker's exit line within the grace: read
# the unit's journal directly (a one-shot journalctl after the last cursor seen) up to
# this many times, this far apart, each bounded by CATCH_UP_TIMEOUT_S; then the exit
# goes out with whatever lines came. journald itself may be a moment behind an exit
# that D-Bus already reported, hence more than one try.
CATCH_UP_TRIES = 3
CATCH_UP_RETRY_S = 1.0
CATCH_UP_TIMEOUT_S = 5.0
# journald stores PID 1's "Starting" entry (its native socket) and the new unit's stdout
# (a stream) in whichever order it reads them, so a unit's first lines may come before the
# entry the follower learns the unit from. On learning one, its entries from this long
# before that entry are read once (each emitted once, by cursor).
LEARNED_LOOKBACK_S = 5.0
# How many emitted entries' cursors are remembered, so that an entry read both by a
# catch-up and by the live follower is emitted once.
_EMITTED_MEMORY = 10_000


class ExitOrdering:
    """Passes events on, holding each `Exited` until the journal's exit line (or `grace`).

    `live(worker)` says whether the runtime still believes the worker's process runs:
    systemd writes two exit lines per exit, and the second one, arriving when nothing of
    the worker is live, must not pre-empt the next process's exit.

    `catch_up(worker)`, when given, is awaited once the grace has passed without the exit
    line: it reads the worker's journal entries the live follower has not delivered
    (`JournalFollower.catch_up`) and feeds them here, so the exit still goes out after its
    last lines (an OOM traceback) even when the live follower went silent. Bounded:
    `CATCH_UP_TRIES` tries `CATCH_UP_RETRY_S` apart.
    """

    def __init__(
        self,
        emit: Emit,
        grace: float,
        live: Callable[[int], bool],
        catch_up: Callable[[int], Awaitable[None]] | None = None,
    ) -> None:
        self._emit = emit
        self._grace = grace
        self._live = live
        self._catch_up = catch_up
        self._pending: dict[int, Exited] = {}
        self._line_seen: set[int] = set()
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self._tasks: dict[int, asyncio.Task[None]] = {}

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
                    self._timers[w] = loop.call_later(self._grace, self._expired, w)

    def _expired(self, worker: int) -> None:
        """The grace passed without the exit line: catch up from the journal, then release."""
        self._timers.pop(worker, None)
        if self._catch_up is None or worker not in self._pending:
            self._release(worker)
            return
        self._tasks[worker] = asyncio.get_running_loop().create_task(
            self._catch_up_then_release(worker), name=f"sf-journal-catch-up-{worker}"
        )

    async def _catch_up_then_release(self, worker: int) -> None:
        assert self._catch_up is not None
        try:
            for attempt in range(CATCH_UP_TRIES):
                if attempt:
                    await asyncio.sleep(CATCH_UP_RETRY_S)
                try:
                    await self._catch_up(worker)
                except Exception as exc:  # task root: the exit must still go out
                    log.warning("journal_catch_up_failed", worker=worker, error=str(exc))
                if worker not in self._pending:
                    return  # the exit line came: released by `feed`
            log.warning(
                "worker_exit_lines_missing",
                worker=worker,
                why="the journal had no exit line for it; its failure is classified "
                "from the lines that came",
            )
        finally:
            self._tasks.pop(worker, None)
            self._release(worker)

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
        for task in self._tasks.values():
            task.cancel()
        self._tasks.clear()


def follow_args(
    units: Collection[str], *, after_cursor: str | None, since: int | None = None
) -> list[str]:
    """Pure: the one-shot journalctl command line of one poll of `units` (and nothing else
    of the host): it prints the entries after its position and exits.

    Matches, as `journalctl -u` builds them for each unit: the unit's own output
    (`_SYSTEMD_UNIT=`) and systemd's lines about it (`_PID=1` and `UNIT=`); plus
    systemd's "Starting" entries of any unit, to learn of new worker units. Two matches
    on one field are alternatives, matches on different fields all apply, `+` separates
    alternatives (journalctl(1), MATCHES). Position: after `after_cursor`; else from the
    wall-clock second `since`; else none (`--lines=0`).
    """
    args = ["journalctl", "--quiet", "--no-pager", "--all", "--output=json"]
    args.append("--output-fields=" + ",".join(FOLLOW_FIELDS))
    if after_cursor is not None:
        args.append(f"--after-cursor={after_cursor}")
    elif since is not None:
        args.append(f"--since=@{since}")
    else:
        args.append("--lines=0")
    names = sorted(units)
    if names:
        args += [*(f"_SYSTEMD_UNIT={u}" for u in names), "+"]
        args += ["_PID=1", *(f"UNIT={u}" for u in names), "+"]
    args += ["_PID=1", f"MESSAGE_ID={UNIT_STARTING}"]
    return args


def catch_up_args(units: Collection[str], *, after_cursor: str | None, since: int) -> list[str]:
    """Pure: a one-shot journalctl (no --follow) of `units`' entries after `after_cursor`
    (else from the wall-clock second `since`), with the follower's matches and fields."""
    args = ["journalctl", "--quiet", "--no-pager", "--all", "--output=json"]
    args.append("--output-fields=" + ",".join(FOLLOW_FIELDS))
    if after_cursor is not None:
        args.append(f"--after-cursor={after_cursor}")
    else:
        args.append(f"--since=@{since}")
    names = sorted(units)
    args += [*(f"_SYSTEMD_UNIT={u}" for u in names), "+"]
    args += ["_PID=1", *(f"UNIT={u}" for u in names)]
    return args


class LineSplitter:
    """Pure: bytes in, whole lines out; a line longer than `limit` is dropped, not kept.

    `feed` returns the complete lines (without the newline) and how many over-long lines
    it dropped; the rest of a dropped line is discarded as it arrives, up to its newline.
    Memory stays within `limit` plus one chunk, however long the line.
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._buf = bytearray()
        self._skipping = False

    def feed(self, chunk: bytes) -> tuple[list[bytes], int]:
        lines: list[bytes] = []
        dropped = 0
        start = 0
        while start < len(chunk):
            nl = chunk.find(b"\n", start)
            end = len(chunk) if nl < 0 else nl
            if not self._skipping:
                self._buf += chunk[start:end]
                if len(self._buf) > self._limit:
                    self._buf.clear()
                    self._skipping = True
                    dropped += 1
            if nl < 0:
                break
            if not self._skipping:
                lines.append(bytes(self._buf))
            self._buf.clear()
            self._skipping = False
            start = nl + 1
        return lines, dropped


def _message_text(msg: object) -> str | None:
    """journalctl's JSON for MESSAGE: a string, a byte array (not UTF-8), or a list of those."""
    if isinstance(msg, str):
        return msg
    if isinstance(msg, list):
        if all(isinstance(b, int) and 0 <= b <= 255 for b in msg):
            return bytes(msg).decode("utf-8", "replace")  # journald keeps non-UTF-8 as bytes
        parts = [t for t in map(_message_text, msg) if t is not None]  # the field repeated
        return "\n".join(parts) if parts else None
    return None  # null: a field journalctl did not print


def entry_unit(entry: object, worker_of: Callable[[str], int | None]) -> str | None:
    """Pure: the worker unit an entry is from (its output) or about (systemd's line), or None."""
    if not isinstance(entry, dict):
        return None
    unit = entry.get("_SYSTEMD_UNIT")
    if isinstance(unit, str) and worker_of(unit) is not None:
        return unit
    about = entry.get("UNIT")
    if entry.get("_PID") == "1" and isinstance(about, str) and worker_of(about) is not None:
        return about  # systemd's own line about the unit
    return None


def worker_entry_lines(
    entry: object, worker_of: Callable[[str], int | None]
) -> tuple[int | None, list[str], str | None]:
    """Pure: one journal JSON entry -> (worker, its lines, cursor)."""
    if not isinstance(entry, dict):
        return None, [], None
    unit = entry_unit(entry, worker_of)
    worker = worker_of(unit) if unit is not None else None
    lines: list[str] = []
    if worker is not None:
        msg = _message_text(entry.get("MESSAGE"))
        if msg is not None:
            lines = msg.splitlines() or [""]
    c = entry.get("__CURSOR")
    return worker, lines, c if isinstance(c, str) else None


def _known_units(text: str, worker_of: Callable[[str], int | None]) -> set[str]:
    """Pure: the worker units among `journalctl --field=_SYSTEMD_UNIT` output lines."""
    return {u for u in text.splitlines() if worker_of(u) is not None}


async def _reap(proc: asyncio.subprocess.Process) -> None:
    """Kill `proc` if it still runs and wait for it: a journalctl is never left behind,
    even when the read that started it is cancelled (the farm stopping)."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    await proc.wait()


class JournalFollower:
    """Feeds `LogLine` events from the journal until closed, reading it every `POLL_S`.

    `worker_of` maps a unit name to its worker id (None for any other unit): it decides
    which units are the farm's, so the follower needs no list of workers. At start it
    seeds its units from the journal (units that logged before: workers this agent
    adopts), then learns new ones as systemd starts them.
    """

    def __init__(self, emit: Emit, worker_of: Callable[[str], int | None]) -> None:
        self._emit = emit
        self._worker_of = worker_of
        self._closed = False
        self._task: asyncio.Task[None] | None = None
        self._units: set[str] = set()
        self._cursor: str | None = None
        self._since = int(time.time())  # where a follower without any cursor yet starts
        # The wall-clock second of the last entry read (journalctl's __REALTIME_TIMESTAMP):
        # where reading starts again when its cursor cannot be read after any more.
        self._last_entry_s: int | None = None
        self._failures = 0  # failed reads in a row
        # Cursors of entries already emitted (live or by a catch-up), oldest first.
        self._emitted: OrderedDict[str, None] = OrderedDict()
        # Units learned in the last read, with their "Starting" entry's wall-clock time.
        self._learned: list[tuple[str, float]] = []

    @property
    def units(self) -> frozenset[str]:
        """The units followed now."""
        return frozenset(self._units)

    def start(self) -> None:
        self._task = asyncio.create_task(self._follow(), name="sf-journal-follow")

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _seed(self) -> None:
        """Units that have logged before (those of workers that outlived an agent)."""
        try:
            proc = await asyncio.create_subprocess_exec(
                "journalctl", "--quiet", "--no-pager", "--field=_SYSTEMD_UNIT",
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
            try:
                out, _ = await proc.communicate()
            finally:
                await _reap(proc)  # closed mid-read: no journalctl left running, unreaped
        except OSError as exc:
            log.warning("journal_seed_failed", error=str(exc))
            return
        self._units |= _known_units(out.decode("utf-8", "replace"), self._worker_of)

    async def _follow(self) -> None:
        await self._seed()
        while not self._closed:
            args = follow_args(self._units, after_cursor=self._cursor, since=self._since)
            try:
                proc = await asyncio.create_subprocess_exec(
                    *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
                )
            except OSError as exc:
                log.error("journal_follow_failed", error=str(exc))
                await asyncio.sleep(FOLLOW_RETRY_S)
                continue
            assert proc.stdout is not None  # asked for with PIPE
            new_unit = False
            done = False
            try:
                new_unit = await self._read(proc.stdout)
                done = not new_unit  # read to its end: journalctl is exiting by itself
            finally:
                if done:  # journalctl ends by itself: its status says whether it failed
                    await proc.wait()
                else:  # a new unit (the rest is read again, with it matched), or closing
                    await _reap(proc)
            if new_unit:
                self._failures = 0
                log.info("journal_follow_units", units=sorted(self._units))
                await self._read_learned()
            elif proc.returncode != 0 and not self._closed:
                self._failed(proc.returncode)
                await asyncio.sleep(FOLLOW_RETRY_S)
            else:
                self._failures = 0
                await asyncio.sleep(POLL_S)

    def _failed(self, returncode: int | None) -> None:
        """One failed read: retry from the cursor (journald restarting), but after
        `FOLLOW_FAILURES_BEFORE_SINCE` failures in a row give the cursor up (one journalctl
        cannot seek to fails every read after it) and read from the last entry's second:
        never from "now", which would drop what was logged in between. The entries of that
        second read again are dropped by the emitted-cursor memory."""
        self._failures += 1
        if self._cursor is None or self._failures < FOLLOW_FAILURES_BEFORE_SINCE:
            log.warning(
                "journal_read_failed",
                returncode=returncode,
                failures=self._failures,
                retry_from="cursor" if self._cursor is not None else "since",
                since=None if self._cursor is not None else self._since,
            )
            return
        if self._last_entry_s is not None:
            self._since = self._last_entry_s
        log.warning(
            "journal_cursor_abandoned",
            returncode=returncode,
            failures=self._failures,
            cursor=self._cursor,
            since=self._since,
            why="journalctl failed every read after this cursor; reading from the "
            "last entry's second instead",
        )
        self._cursor = None
        self._failures = 0

    async def _read(self, stream: asyncio.StreamReader) -> bool:
        """Handle journalctl's lines until it ends (False) or names a new unit (True)."""
        splitter = LineSplitter(LINE_LIMIT)
        while chunk := await stream.read(_CHUNK):
            lines, dropped = splitter.feed(chunk)
            if dropped:
                # The next entry's cursor moves past it; a restart before that reads it
                # once more and skips it again: never a loop.
                log.warning("journal_entry_skipped", count=dropped, limit_bytes=LINE_LIMIT)
            for raw in lines:
                if self._line(raw):
                    return True  # the rest of this output is read again, with the new unit
        return False

    async def _read_learned(self) -> None:
        """The lines of the units just learned that journald stored before their
        "Starting" entry (LEARNED_LOOKBACK_S before it); each entry is emitted once."""
        learned, self._learned = self._learned, []
        for unit, at_s in learned:
            try:
                await self.catch_up([unit], since=at_s - LEARNED_LOOKBACK_S)
            except OSError as exc:
                log.warning("journal_lookback_failed", unit=unit, error=str(exc))

    async def catch_up(
        self,
        units: Collection[str],
        timeout: float = CATCH_UP_TIMEOUT_S,
        *,
        since: float | None = None,
    ) -> None:
        """Emit `units`' entries the live follower has not delivered yet (a one-shot read
        after its last cursor, or from the wall-clock second `since`), each entry once
        whichever reader sees it first. Bounded by `timeout`; raises OSError when
        journalctl cannot run."""
        if since is None:
            args = catch_up_args(units, after_cursor=self._cursor, since=self._since)
        else:
            args = catch_up_args(units, after_cursor=None, since=math.floor(since))
        proc = await asyncio.create_subprocess_exec(
            *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
        )
        assert proc.stdout is not None  # asked for with PIPE
        splitter = LineSplitter(LINE_LIMIT)

        async def read(stream: asyncio.StreamReader) -> None:
            while chunk := await stream.read(_CHUNK):
                for raw in splitter.feed(chunk)[0]:
                    self._entry(raw)

        try:
            await asyncio.wait_for(read(proc.stdout), timeout)
        except TimeoutError:
            log.warning("journal_catch_up_timeout", units=sorted(units), after_s=timeout)
        finally:
            await _reap(proc)

    def _entry(self, raw: bytes) -> object:
        """Emit one entry's lines unless emitted before; returns the parsed entry (None: bad)."""
        try:
            entry = json.loads(raw.decode("utf-8", "replace"))
        except ValueError:
            return None
        worker, lines, cursor = worker_entry_lines(entry, self._worker_of)
        if cursor is not None:
            if cursor in self._emitted:
                return entry
            self._emitted[cursor] = None
            if len(self._emitted) > _EMITTED_MEMORY:
                self._emitted.popitem(last=False)
        if worker is not None:
            for line in lines:
                self._emit(LogLine(worker, line))
        return entry

    def _line(self, raw: bytes) -> bool:
        """Emit one entry's lines; True when it is about a unit not followed until now."""
        entry = self._entry(raw)
        if entry is None:
            return False
        c = entry.get("__CURSOR") if isinstance(entry, dict) else None
        cursor = c if isinstance(c, str) else None
        if cursor is not None:
            self._cursor = cursor
        stamp = entry.get("__REALTIME_TIMESTAMP") if isinstance(entry, dict) else None
        at_s: float | None = None
        if isinstance(stamp, str) and stamp.isdigit():
            self._last_entry_s = int(stamp) // 1_000_000  # microseconds, as a string
            at_s = int(stamp) / 1e6
        unit = entry_unit(entry, self._worker_of)
        if unit is None or unit in self._units:
            return False
        self._units.add(unit)
        self._learned.append((unit, at_s if at_s is not None else float(self._since)))
        return cursor is not None  # without a cursor, it is followed from the next restart
