"""I/O: the managed gateway as a child of the agent (the process runtime and the demo).

Started once the agent runs, restarted with back-off if it exits, stopped with the
agent (SIGTERM; smg finishes what it routes within its shutdown grace, then SIGKILL).
It dies with the agent (`PR_SET_PDEATHSIG`) and is on record in `<state_dir>/children`
as "gateway", so a next agent stops one that outlived a `kill -9` (runtime/children).
Under systemd the gateway is a unit of its own instead (`sglang-farm-gateway.service`).

The back-off (`restart_delay`) doubles from 1 s to 10 min: a gateway that cannot start
at all (smg not installed) is tried, and logged, once per step, never every 30 s; one
that ran `STABLE_S` starts the schedule over.

Its output goes to a log file beside the farm's state (`gateway.log`): smg logs every
request, which would drown the agent's own console. Root writes it, in a folder the
agent may not own alone (the demo's /tmp): it is opened without following a symlink,
made 0640, and refused unless it is a plain file of the agent's own user (`open_log`).
smg writes it as JSON lines (`--log-json`: its text format carries ANSI colour codes
whatever the output is, and ignores NO_COLOR; measured with smg 1.13.0), at warn level
unless extra_args says otherwise (`QUIET_FLAGS`: at info it logs every request, the
farm's own polls first), and the file is
cut to its last half once it passes `LOG_MAX_BYTES` at a (re)start, so it cannot fill
the disk across restarts.

Bounded while it runs, too (issue 30, item 5: smg echoes a client's model name in a WARN
line, and 900 kB names gave 90 MB of log in 10 s). smg writes into a pipe the agent
reads (`GatewayLog`): a line longer than `LINE_MAX_BYTES` keeps its start and says how
much was cut; past half of `LOG_MAX_BYTES` the file is rotated to `gateway.log.1` (the
older one dropped), so both together stay under `LOG_MAX_BYTES`; a write that fails (a
full disk) drops the lines, says so once in the agent's log and, once writing works
again, in the file. smg itself never meets a full disk (it panicked on one: `failed
printing to stdout`, and the front door stayed down).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import stat
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import IO

import structlog

from sglang_farm.errors import RuntimeFailure
from sglang_farm.host.portowner import tree_pids
from sglang_farm.runtime.children import ChildRecords, die_with_agent, proc_facts

log = structlog.get_logger("sglang_farm.gateway")

RESTART_INITIAL_S = 1.0
RESTART_MAX_S = 600.0  # 10 min: a gateway that cannot start is tried 10 times the first hour
LOG_MODE = 0o640
LOG_MAX_BYTES = 64 << 20  # gateway.log and gateway.log.1 together, at most
LINE_MAX_BYTES = 16 << 10  # a longer line of smg's keeps its first 16 KiB
READ_BYTES = 64 << 10  # read from smg's pipe at a time
LOG_FLAGS = ("--log-json",)  # smg's own flag: no colour codes in the file
# smg logs two info lines per request, and most requests are the farm's own (GET /workers
# at every reconcile and add): a reconcile every 10 s is some 17,000 lines a day at rest,
# and the demo's first 45 s logged 338 requests, 322 of them the farm's GET /workers.
# Warnings and errors only, unless [gateway] extra_args sets --log-level itself.
QUIET_FLAGS = ("--log-level", "warn")
STOP_TIMEOUT_S = 15.0  # smg drains for 5 s after SIGTERM (docs/gateway.md)
STABLE_S = 60.0  # up this long: the back-off starts over


def restart_delay(previous: float | None, ran_s: float) -> float:
    """Pure: the wait before the next start, after a run of `ran_s` seconds that followed a
    wait of `previous` (None: the first start). Doubling from `RESTART_INITIAL_S` up to
    `RESTART_MAX_S`; a run of `STABLE_S` or more starts over."""
    if previous is None or ran_s >= STABLE_S:
        return RESTART_INITIAL_S
    return min(RESTART_MAX_S, previous * 2)


def open_log(path: Path, what: str = "gateway log") -> IO[bytes]:
    """`path` for appending: created 0640, never through a symlink, and only if it is a
    plain file of this process's user. Raises RuntimeFailure naming the file (`what`: the
    gateway's log, or the batch service's, runtime/batch_child) and the fix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(
            path,
            os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
            LOG_MODE,
        )
    except OSError as exc:
        if os.path.islink(path):
            raise RuntimeFailure(
                f"{what} {path} is a symbolic link; the agent never writes through one "
                f"(it could point at any file): remove it (`rm {path}`), and keep [farm] "
                "state_dir in a folder only root may write"
            ) from exc
        raise RuntimeFailure(f"cannot open the {what} {path}: {exc.strerror}") from exc
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
        os.close(fd)
        raise RuntimeFailure(
            f"{what} {path} is not a plain file of the agent's own (owner uid "
            f"{st.st_uid}, {st.st_nlink} links): the agent writes only its own file there: "
            f"remove it (`rm {path}`), and keep [farm] state_dir in a folder only root may write"
        )
    os.fchmod(fd, LOG_MODE)  # an older agent made it 0644
    os.set_blocking(fd, True)
    if st.st_size > LOG_MAX_BYTES:
        _keep_tail(fd, st.st_size)
    return os.fdopen(fd, "ab")


def _keep_tail(fd: int, size: int) -> None:
    """Keep the last half of an oversized log (the file stays the same inode)."""
    keep = LOG_MAX_BYTES // 2
    tail = os.pread(fd, keep, size - keep)
    os.ftruncate(fd, 0)
    os.write(fd, b"[sglang-farm: gateway.log cut to its last part]\n" + tail)


def cap_lines(pending: bytes, chunk: bytes, line_max: int) -> tuple[list[bytes], bytes, int]:
    """Pure: the whole lines of smg's output in `pending` (the unfinished line so far)
    followed by `chunk`, the unfinished line after them (at most `line_max` bytes kept),
    and how many bytes of it were cut off here. The whole lines are cut by `_noted`."""
    lines: list[bytes] = []
    cut = 0
    data = pending + chunk
    start = 0
    while True:
        nl = data.find(b"\n", start)
        if nl < 0:
            break
        lines.append(data[start : nl + 1])
        start = nl + 1
    rest = data[start:]
    if len(rest) > line_max:
        cut = len(rest) - line_max
        rest = rest[:line_max]
    return lines, rest, cut


def _noted(line: bytes, cut: int, line_max: int) -> bytes:
    """`line` at most `line_max` bytes, with a note of what was cut (`cut` more before)."""
    body = line.rstrip(b"\n")
    cut += max(0, len(body) - line_max)
    if not cut:
        return line
    return body[:line_max] + f" [sglang-farm: {cut} more bytes of this line cut]\n".encode()


class GatewayLog:
    """I/O: smg's output, read from its pipe, written to `path` within bounds.

    Lines are cut at `line_max`; at `max_bytes // 2` the file is rotated to `<path>.1`;
    a failed write drops lines (counted in `dropped`, said once per run of failures).
    """

    def __init__(
        self, path: Path, *, max_bytes: int = LOG_MAX_BYTES, line_max: int = LINE_MAX_BYTES
    ) -> None:
        self.path = path
        self._max = max_bytes
        self._line_max = line_max
        self._fd: int | None = None
        self._size = 0
        self.dropped = 0  # lines lost to failed writes since the last that succeeded
        self._error: str | None = None

    def open(self) -> None:
        """Raises RuntimeFailure (`open_log`)."""
        fh = open_log(self.path)
        self._fd = os.dup(fh.fileno())
        fh.close()
        self._size = os.fstat(self._fd).st_size

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _rotate(self) -> None:
        old = self.path.with_name(self.path.name + ".1")
        try:
            os.replace(self.path, old)
            fh = open_log(self.path)
        except (OSError, RuntimeFailure) as exc:
            # Not rotated: the file is cut to nothing rather than grown past its bound.
            log.warning("gateway_log_not_rotated", log=str(self.path), error=str(exc))
            if self._fd is not None:
                os.ftruncate(self._fd, 0)
            self._size = 0
            return
        self.close()
        self._fd = os.dup(fh.fileno())
        fh.close()
        self._size = 0

    def write(self, lines: Sequence[bytes], cut_first: int = 0) -> None:
        """Write whole `lines` (the first with `cut_first` bytes already cut off)."""
        if self._fd is None or not lines:
            return
        out = [_noted(ln, cut_first if i == 0 else 0, self._line_max) for i, ln in enumerate(lines)]
        if self.dropped:
            note = f"[sglang-farm: {self.dropped} lines of smg's log lost: {self._error}]\n"
            out.insert(0, note.encode())
        data = b"".join(out)
        try:
            if self._size + len(data) > self._max // 2:
                self._rotate()
            os.write(self._fd, data)
        except OSError as exc:
            if not self.dropped:
                log.warning(
                    "gateway_log_not_written",
                    log=str(self.path),
                    error=exc.strerror or str(exc),
                    hint="smg's lines are dropped until a write works again (smg goes on "
                    "routing); free space in the state_dir",
                )
            self.dropped += len(lines)
            self._error = exc.strerror or str(exc)
            return
        if self.dropped:
            log.info("gateway_log_written_again", log=str(self.path), dropped=self.dropped)
        self._size += len(data)
        self.dropped = 0

    async def pump(self, stream: asyncio.StreamReader) -> None:
        """Copy `stream` (smg's stdout and stderr) into the log until EOF."""
        pending = b""
        cut = 0
        while True:
            chunk = await stream.read(READ_BYTES)
            if not chunk:
                break
            lines, pending, more = cap_lines(pending, chunk, self._line_max)
            first_cut, cut = (cut, 0) if lines else (0, cut)
            if lines:
                await asyncio.to_thread(self.write, lines, first_cut)
            cut += more
        if pending:
            await asyncio.to_thread(self.write, [pending + b"\n"], cut)


class ChildGateway:
    def __init__(
        self,
        argv: Sequence[str],
        log_path: Path,
        *,
        records: ChildRecords | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        log_max_bytes: int = LOG_MAX_BYTES,
    ) -> None:
        # Appended to smg's `launch` flags (a flag repeated in extra_args is harmless).
        quiet = () if any(a.split("=")[0] == "--log-level" for a in argv) else QUIET_FLAGS
        self._argv = [*argv, *LOG_FLAGS, *quiet]
        self._log_path = log_path
        self._log_max = log_max_bytes
        self._records = records
        self._sleep = sleep  # the back-off's wait (tests count the steps without waiting)
        self._proc: asyncio.subprocess.Process | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._restarting = False

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._supervise(), name="sf-gateway")

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.returncode is None else None

    async def pids(self) -> frozenset[int]:
        """smg's launcher and everything in its session (it is a session leader), or
        descended from it; empty when it does not run."""
        pid = self.pid
        if pid is None:
            return frozenset()
        return await asyncio.to_thread(tree_pids, pid)

    async def restart(self) -> None:
        """Stop the running smg (SIGTERM, as `close`), and start it again at once, without
        the back-off (a rotated admin key: smg reads it only at its start)."""
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return  # not running: its next start reads the new key
        self._restarting = True
        await self._stop(proc)

    async def _supervise(self) -> None:
        delay: float | None = None
        loop = asyncio.get_running_loop()
        while not self._closing:
            started = loop.time()
            code, why = await self._run_once()
            if self._closing:
                return
            if self._restarting:
                self._restarting = False
                log.info("gateway_restarted", status=code, why="its admin key was replaced")
                continue
            delay = restart_delay(delay, loop.time() - started)
            # One line per attempt, and the attempts back off: a gateway that cannot start
            # (smg missing: it exits at once) is said once per step, never a flood.
            log.warning(
                "gateway_exited" if why is None else "gateway_not_started",
                status=code,
                error=why,
                log=str(self._log_path),
                retry_in_s=delay,
                hint="the farm starts it again; its log says why it stopped "
                "(`sglang-farm doctor` checks that smg is installed)",
            )
            await self._sleep(delay)

    async def _run_once(self) -> tuple[int | None, str | None]:
        """Start smg and wait for its exit: (its status, None), or (None, why) when it
        could not be started."""
        sink = GatewayLog(self._log_path, max_bytes=self._log_max)
        try:
            await asyncio.to_thread(sink.open)
        except RuntimeFailure as exc:
            return None, str(exc)
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *self._argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
                # Called from the loop's thread, which lives as long as the agent.
                preexec_fn=die_with_agent(),
                limit=READ_BYTES,
            )
        except OSError as exc:
            self._proc = None
            sink.close()
            return None, f"cannot run {self._argv[0]}: {exc.strerror or exc}"
        assert self._proc.stdout is not None
        pump = asyncio.create_task(sink.pump(self._proc.stdout), name="sf-gateway-log")
        try:
            pid = self._proc.pid
            facts = proc_facts(pid)
            if self._records is not None and facts is not None:
                await asyncio.to_thread(self._records.record, "gateway", pid, facts.start)
            log.info("gateway_started", pid=pid, log=str(self._log_path))
            code = await self._proc.wait()
            if self._records is not None:
                await asyncio.to_thread(self._records.forget, "gateway", pid)
            # Its last lines (smg's children may hold the pipe: not for long).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(pump), 5.0)
        finally:
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pump
            sink.close()
        return code, None

    async def close(self) -> None:
        self._closing = True
        proc = self._proc
        if proc is not None and proc.returncode is None:
            await self._stop(proc)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _stop(self, proc: asyncio.subprocess.Process) -> None:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                async with asyncio.timeout(STOP_TIMEOUT_S):
                    await proc.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
            log.info("gateway_stopped", status=proc.returncode)
