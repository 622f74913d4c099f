"""I/O: when the copy at model_path was put in place, and when a worker's process started.

A worker that started before its model copy was installed loads the previous copy (an
agent restarted mid-reload, or a `farmctl start` after a failed stage, adopts such
workers with an unchanged command line). The copier touches the recorded manifest right
after the swap, so its mtime is no earlier than the swap; a process's start comes from
/proc/PID/stat (field 22, clock ticks since boot), as wall time.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from sglang_farm.host import procfs
from sglang_farm.staging.manifest import MANIFEST_NAME


def installed_at(target: Path) -> float | None:
    """Wall time the copy at `target` was swapped in (None: no recorded manifest)."""
    try:
        return os.lstat(target / MANIFEST_NAME).st_mtime  # the agent's file, not a link
    except OSError:
        return None


def process_started(pid: int) -> float | None:
    """Wall time process `pid` started (None: gone, or /proc unreadable)."""
    st = procfs.read_stat(pid)
    if st is None:
        return None
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - st.start / os.sysconf("SC_CLK_TCK")
    return time.time() - age
