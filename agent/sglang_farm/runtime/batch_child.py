"""I/O: the batch service (`sglang-farm-batch`, [batch]) as a child of the agent, in the
process runtime and the demo (issue 33).

Like the managed gateway's child (runtime/gateway_child): started once the agent runs,
restarted with the same back-off if it exits by itself (`restart_delay`: 1 s doubling to
10 min, starting over after a minute up), but at once, the back-off started over, after
a `kill -9` (an operator's, the OOM killer's: `next_start`): that says nothing about the
next start, and a batch waits for every second of it (the fault bench's resume after a
kill was 1, 2, 4, 8 ... s of back-off for kills less than a minute apart, the median
7.3 s; docs/benchmarks.md). Stopped with the agent (SIGTERM, SIGKILL after
`STOP_TIMEOUT_S`), dying with it (`PR_SET_PDEATHSIG`) and on record in
`<state_dir>/children` as "batch", so a next agent stops one that outlived a `kill -9`.
Nothing is lost by any of these: the service keeps every request's state in its store
and sends a request that was in flight again at its next start. Under systemd the batch
service is a unit of its own instead (`sglang-farm-batch.service`).

Its output goes to `batch.log` beside the farm's state (opened as the gateway's log is:
`gateway_child.open_log`, never through a symlink). Its API key file ([batch]
api_key_file) is made here when it does not exist yet (`ensure_key`), so the demo needs
no setup step; an existing one is left as it is, for the service to judge.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import structlog

from sglang_farm.errors import RuntimeFailure
from sglang_farm.runtime.children import ChildRecords, die_with_agent, proc_facts
from sglang_farm.runtime.gateway_child import open_log, restart_delay

log = structlog.get_logger("sglang_farm.batch_child")

RECORD = "batch"  # its name in <state_dir>/children
LOG_NAME = "batch.log"
# After a kill -9: its listening socket and the store's lock went with the process, so
# nothing is to wait for.
KILLED_RESTART_S = 0.1
STOP_TIMEOUT_S = 15.0  # it stops sending at SIGTERM; what is in flight is sent again later
_KEY_BYTES = 32


def batch_argv(config_path: str, python: str = sys.executable) -> list[str]:
    """Pure: the batch service's command line: this interpreter, isolated (`-I`: no PYTHON*
    variable or working folder changes what it imports), on the agent's own config."""
    return [python, "-I", "-m", "sglang_farm.batch", "--config", os.path.abspath(config_path)]


def ensure_key(path: Path) -> bool:
    """Make `path` (0600, one random key) when it does not exist; True when made.

    Created with O_EXCL|O_NOFOLLOW: never through a planted link, never into a planted
    file. A file already there is not read or changed here (the service checks it).
    Raises OSError (with the path) when it cannot be made.
    """
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return False
    try:
        os.fchmod(fd, 0o600)  # whatever the umask made of it
        os.write(fd, (secrets.token_urlsafe(_KEY_BYTES) + "\n").encode())
        os.fsync(fd)
    except OSError:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return True


def next_start(
    backoff: float | None, ran_s: float, status: int | None
) -> tuple[float, float | None]:
    """Pure: (the wait before the next start, the back-off to carry) after a run of `ran_s`
    seconds that ended with `status` (the exit status, negative for a signal; None: it
    could not be run) and followed the back-off `backoff` (None: none yet). Killed by
    SIGKILL: at once, the back-off forgotten. Otherwise `restart_delay`'s back-off."""
    if status == -signal.SIGKILL:
        return KILLED_RESTART_S, None
    delay = restart_delay(backoff, ran_s)
    return delay, delay


class ChildBatch:
    """The batch service run by the agent: started, restarted with back-off, stopped."""

    def __init__(
        self,
        argv: Sequence[str],
        log_path: Path,
        *,
        records: ChildRecords | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._argv = list(argv)
        self._log_path = log_path
        self._records = records
        self._sleep = sleep
        self._proc: asyncio.subprocess.Process | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.returncode is None else None

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._supervise(), name="sf-batch")

    async def _supervise(self) -> None:
        delay: float | None = None
        loop = asyncio.get_running_loop()
        while not self._closing:
            started = loop.time()
            code, why = await self._run_once()
            if self._closing:
                return
            wait, delay = next_start(delay, loop.time() - started, code)
            log.warning(
                "batch_service_exited" if why is None else "batch_service_not_started",
                status=code,
                error=why,
                log=str(self._log_path),
                retry_in_s=wait,
                hint="the farm starts it again and it resumes every batch from its store; "
                "its log says why it stopped",
            )
            await self._sleep(wait)

    async def _run_once(self) -> tuple[int | None, str | None]:
        try:
            out = await asyncio.to_thread(open_log, self._log_path, "batch service log")
        except RuntimeFailure as exc:  # its message names the file and the fix
            return None, str(exc)
        with out:
            try:
                self._proc = await asyncio.create_subprocess_exec(
                    *self._argv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=out,
                    stderr=asyncio.subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=die_with_agent(),
                )
            except OSError as exc:
                self._proc = None
                return None, f"cannot run {self._argv[0]}: {exc.strerror or exc}"
        pid = self._proc.pid
        facts = proc_facts(pid)
        if self._records is not None and facts is not None:
            await asyncio.to_thread(self._records.record, RECORD, pid, facts.start)
        log.info("batch_service_started", pid=pid, log=str(self._log_path))
        code = await self._proc.wait()
        if self._records is not None:
            await asyncio.to_thread(self._records.forget, RECORD, pid)
        return code, None

    async def close(self) -> None:
        self._closing = True
        proc = self._proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                async with asyncio.timeout(STOP_TIMEOUT_S):
                    await proc.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
            log.info("batch_service_stopped", status=proc.returncode)
            if self._records is not None:  # the runner's own forget may not run: cancelled below
                await asyncio.to_thread(self._records.forget, RECORD, proc.pid)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
