"""I/O: the one check of whether a TCP port can be bound now (the launch gate and the doctor)."""

from __future__ import annotations

import socket


def port_problem(host: str, port: int) -> str | None:
    """None if `port` can be bound on `host` now, else why not (a bind test)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            # As uvicorn and NCCL do: a port in TIME_WAIT from the last run is still usable.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as exc:
        return f"cannot bind: {exc.strerror or exc}"
    return None


def port_is_free(host: str, port: int) -> bool:
    """True if nothing listens on host:port (we can bind it ourselves)."""
    return port_problem(host, port) is None
