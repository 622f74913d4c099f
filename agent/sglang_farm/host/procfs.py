"""I/O: what the farm reads of a process's `/proc/PID/stat`, parsed in one place.

Six places asked it (who is alive, a worker's process group and tree, a child's start
time, when a worker started against when its model copy was swapped in, GPU memory by
worker). The command name (field 2) sits in parentheses and may itself hold spaces and
')': the fields after the LAST ')' are "state ppid pgrp session ..." (proc(5)).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ProcStat:
    """The fields of `/proc/PID/stat` the farm uses."""

    pid: int
    state: str  # field 3: R, S, D, Z (zombie), X (dead) ...
    ppid: int  # field 4
    pgrp: int  # field 5
    session: int  # field 6
    start: int  # field 22: clock ticks since boot

    @property
    def alive(self) -> bool:
        """Not a zombie: a zombie holds no memory, GPU context or port."""
        return self.state not in ("Z", "X")


def parse_stat(pid: int, text: str) -> ProcStat | None:
    """Pure: `/proc/PID/stat`'s text -> its fields; None when it is not one."""
    fields = text[text.rfind(")") + 2 :].split()
    try:
        return ProcStat(
            pid, fields[0], int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19])
        )
    except (IndexError, ValueError):
        return None


_STAT_MAX = 4096  # the line is a few hundred bytes; the command name at most 64


def read_stat(pid: int, proc: str = "/proc") -> ProcStat | None:
    """Process `pid`'s fields; None when there is no such process (or it just exited).

    One `open`, `read` and `close` of the raw bytes: half the CPU of a text file object,
    which counts where every process of the host is read for each walk (issue 32, 4.8).
    A command name that is not UTF-8 is replaced, never raised on.
    """
    try:
        fd = os.open(f"{proc}/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        raw = os.read(fd, _STAT_MAX)
    except OSError:
        return None
    finally:
        os.close(fd)
    return parse_stat(pid, raw.decode("utf-8", "replace"))


def pids(proc: str = "/proc") -> list[int]:
    """Every process id in `proc` now."""
    try:
        return [int(e) for e in os.listdir(proc) if e.isdigit()]
    except OSError:
        return []


def all_stats(proc: str = "/proc") -> Iterator[ProcStat]:
    """Every process's fields; those that exit while being read are skipped."""
    for pid in pids(proc):
        st = read_stat(pid, proc)
        if st is not None:
            yield st
