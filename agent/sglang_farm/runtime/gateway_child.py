"""I/O: the managed gateway as a child of the agent (the process runtime and the demo).

Started once the agent runs, restarted with back-off if it exits, stopped with the
agent (SIGTERM; smg finishes what it routes within its shutdown grace, then SIGKILL).
Its output goes to a log file beside the farm's state (`gateway.log`): smg logs every
request, which would drown the agent's own console. Under systemd the gateway is a
unit of its own instead (`sglang-farm-gateway.service`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import structlog

log = structlog.get_logger("sglang_farm.gateway")

RESTART_INITIAL_S = 1.0
RESTART_MAX_S = 30.0
STOP_TIMEOUT_S = 15.0  # smg drains for 5 s after SIGTERM (docs/gateway.md)
STABLE_S = 60.0  # up this long: the back-off starts over


class ChildGateway:
    def __init__(self, argv: Sequence[str], log_path: Path) -> None:
        self._argv = list(argv)
        self._log_path = log_path
        self._proc: asyncio.subprocess.Process | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._supervise(), name="sf-gateway")

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.returncode is None else None

    async def _supervise(self) -> None:
        delay = RESTART_INITIAL_S
        loop = asyncio.get_running_loop()
        while not self._closing:
            out = await asyncio.to_thread(self._open_log)
            with out:
                try:
                    self._proc = await asyncio.create_subprocess_exec(
                        *self._argv,
                        stdin=asyncio.subprocess.DEVNULL,
                        stdout=out,
                        stderr=asyncio.subprocess.STDOUT,
                        start_new_session=True,
                    )
                except OSError as exc:
                    log.error("gateway_start_failed", error=str(exc), argv0=self._argv[0])
                    self._proc = None
            started = loop.time()
            if self._proc is not None:
                log.info("gateway_started", pid=self._proc.pid, log=str(self._log_path))
                code = await self._proc.wait()
                if self._closing:
                    return
                log.warning(
                    "gateway_exited",
                    status=code,
                    log=str(self._log_path),
                    hint="the farm starts it again; its log says why it stopped",
                )
            if loop.time() - started >= STABLE_S:
                delay = RESTART_INITIAL_S
            await asyncio.sleep(delay)
            delay = min(RESTART_MAX_S, delay * 2)

    def _open_log(self) -> IO[bytes]:
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        return open(self._log_path, "ab")

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
            log.info("gateway_stopped", status=proc.returncode)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
