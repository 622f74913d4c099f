"""I/O: the one check of whether a TCP port can be bound now (the launch gate and the doctor)."""

from __future__ import annotations

import socket
from enum import StrEnum

AGENT_TROUBLE = "the agent cannot create a socket to test the port"


class PortState(StrEnum):
    FREE = "free"
    IN_USE = "in_use"
    UNKNOWN = "unknown"  # the agent could not test it (its own trouble: out of fds, ...)


def port_problem(host: str, port: int) -> str | None:
    """None if `port` can be bound on `host` now, else why not (a bind test). Never raises."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        s = socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:  # out of fds, ...: the agent's trouble, not the port's
        return f"{AGENT_TROUBLE}: {exc.strerror or exc}"
    try:
        with s:
            # As uvicorn and NCCL do: a port in TIME_WAIT from the last run is still usable.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as exc:
        return f"cannot bind: {exc.strerror or exc}"
    return None


def port_state(host: str, port: int) -> PortState:
    """Whether host:port can be bound now, or UNKNOWN when the agent could not test it."""
    problem = port_problem(host, port)
    if problem is None:
        return PortState.FREE
    return PortState.UNKNOWN if problem.startswith(AGENT_TROUBLE) else PortState.IN_USE
