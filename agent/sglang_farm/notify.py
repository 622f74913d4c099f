"""I/O: the sd_notify protocol (READY=1, STATUS=, WATCHDOG=1), spoken directly.

A datagram to $NOTIFY_SOCKET; a no-op when not run by systemd. Written here rather
than through pystemd so that pystemd stays confined to `runtime/systemd.py`.
"""

from __future__ import annotations

import os
import socket


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
