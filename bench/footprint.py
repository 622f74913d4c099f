"""I/O: a process's RSS and CPU (% of one core) over a window, read from /proc."""

from __future__ import annotations

import os
import time
from pathlib import Path

from bench.stats import summary

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of pid (all its threads), in seconds."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # fields 14 and 15 of proc(5)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def watch(pid: int, seconds: float, *, every: float = 1.0) -> dict[str, object]:
    """CPU % of one core over the window (and per-interval), RSS in MiB sampled every `every`."""
    c0, t0 = cpu_seconds(pid), time.monotonic()
    per: list[float] = []
    rss: list[float] = []
    last_c, last_t = c0, t0
    while time.monotonic() - t0 < seconds:
        time.sleep(every)
        c, t = cpu_seconds(pid), time.monotonic()
        per.append((c - last_c) / (t - last_t) * 100)
        last_c, last_t = c, t
        rss.append(rss_bytes(pid) / 2**20)
    c1, t1 = cpu_seconds(pid), time.monotonic()
    return {
        "window_s": t1 - t0,
        "cpu_pct_of_one_core": (c1 - c0) / (t1 - t0) * 100,
        "cpu_pct_per_interval": summary(per),
        "rss_mib": summary(rss),
        "threads": threads(pid),
    }
