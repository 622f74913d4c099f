"""I/O: the one check of whether a TCP port can be bound now (the launch gate and the doctor),
and which ports need a privilege to bind (`unprivileged_port_start`, issue 30)."""

from __future__ import annotations

import socket
from enum import StrEnum

AGENT_TROUBLE = "the agent cannot create a socket to test the port"


class PortState(StrEnum):
    FREE = "free"
    IN_USE = "in_use"
    UNKNOWN = "unknown"  # the agent could not test it (its own trouble: out of fds, ...)


def sysctl_int(name: str, proc_sys: str = "/proc/sys") -> int | None:
    """The first integer of a sysctl (`net/ipv4/ip_unprivileged_port_start`) read from
    `proc_sys`; None when absent (a kernel before 4.11, not Linux) or unreadable."""
    try:
        with open(f"{proc_sys}/{name}") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def unprivileged_port_start(proc_sys: str = "/proc/sys") -> int | None:
    """`net.ipv4.ip_unprivileged_port_start` (IPv4 and IPv6 alike, per network namespace):
    binding a port below it needs root or CAP_NET_BIND_SERVICE (ip(7))."""
    return sysctl_int("net/ipv4/ip_unprivileged_port_start", proc_sys)


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
