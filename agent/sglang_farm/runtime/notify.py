"""I/O: the sd_notify protocol (READY=1, STATUS=, WATCHDOG=1, EXTEND_TIMEOUT_USEC=), spoken
directly.

A datagram to $NOTIFY_SOCKET; a no-op when not run by systemd. Written here rather
than through pystemd so that pystemd stays confined to the systemd runtime's modules.

`keep_start_alive` covers a slow step of the agent's start (the doctor's preflight,
whose environment probe may take up to 240 s on a cold `import torch`) that the unit's
TimeoutStartSec= alone would cut short.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import socket
from collections.abc import AsyncIterator

# How far each extension reaches: long enough that a busy loop never misses one (it is
# re-sent every third of it), short enough that a hung agent fails its start soon.
START_EXTEND_WINDOW_S = 30.0


def notify(*fields: str) -> bool:
    """Send `fields` ("READY=1", "STATUS=...") to systemd; False when there is no socket."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]  # abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall("\n".join(fields).encode())
    except OSError:
        return False
    return True


def watchdog_interval() -> float | None:
    """Half of WatchdogSec= when systemd asked this process for pings, else None."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 1e6 / 2
    except ValueError:
        return None


def extend_timeout(seconds: float) -> bool:
    """`EXTEND_TIMEOUT_USEC=`: systemd waits `seconds` more for the current state's next
    message (here: READY=1) before the unit's timeout applies again.

    Only ever lengthens: systemd still fails the start when the extension lapses after
    TimeoutStartSec= has passed. Returns False when there is no systemd to tell. Raises
    ValueError for a window that is not a positive, finite number of seconds.
    """
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(
            f"EXTEND_TIMEOUT_USEC needs a positive, finite number of seconds, got {seconds!r}"
        )
    return notify(f"EXTEND_TIMEOUT_USEC={round(seconds * 1_000_000)}")


@contextlib.asynccontextmanager
async def keep_start_alive(
    window: float = START_EXTEND_WINDOW_S, *, limit: float | None = None
) -> AsyncIterator[None]:
    """Extend the unit's start deadline by `window` seconds at entry, every `window / 3`
    while the body runs, and once more at exit (the rest of the start gets a whole window).

    The extensions come from a task on the event loop: a loop that hangs stops them, and
    the start fails `window` seconds later. After `limit` seconds (None: no limit) they
    stop, so a step that never ends still fails the start. Without systemd, only the body
    runs.
    """
    loop = asyncio.get_running_loop()
    end = None if limit is None else loop.time() + limit

    async def extend() -> None:
        while end is None or loop.time() < end:
            extend_timeout(window)
            await asyncio.sleep(window / 3)

    task = asyncio.create_task(extend(), name="sf-start-extend")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if end is None or loop.time() < end:
            extend_timeout(window)
