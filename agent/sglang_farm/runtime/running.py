"""I/O: the processes of the farm's workers that run now, found without asking an agent.

The doctor (`sglang-farm doctor`, and the agent's own preflight at a start or reload)
tests each worker's ports with a bind; a port its own running worker holds is not a
conflict. Which processes are worker N's is read from what only the farm can have made:

- systemd: the processes in the unit `sglang@N.service`'s cgroup under `system.slice`
  (`/proc/PID/cgroup`, readable by every user; only root places processes there, so a
  user's own `systemd --user` unit of that name, under `user.slice`, does not count);
- the process runtime: the children on record (`runtime/children`) that still run under
  the agent that started them, each with its session, group and descendants
  (`host/portowner.tree_pids`). The records are read only in a folder of the reader's
  own (the agent's user's): a doctor run by another user finds none.
"""

from __future__ import annotations

import os
from pathlib import Path

from sglang_farm.host.portowner import tree_pids
from sglang_farm.runtime.children import RECORDS_SUBDIR, ChildRecords
from sglang_farm.runtime.unit_state import worker_of
from sglang_farm.spec import FarmSpec

SYSTEM_SLICE = "/system.slice/"


def unit_worker(cgroup_line: str, prefix: str = "sglang") -> int | None:
    """Pure: the worker whose unit a `/proc/PID/cgroup` line names, if it is a system
    unit (`0::/system.slice/sglang@3.service`, or below it: 3), else None."""
    path = cgroup_line.split(":", 2)[-1]
    if not path.startswith(SYSTEM_SLICE):
        return None
    unit = path[len(SYSTEM_SLICE) :].split("/", 1)[0]
    return worker_of(unit, prefix)


def systemd_worker_pids(proc: str = "/proc", prefix: str = "sglang") -> dict[int, set[int]]:
    """Every process in a worker unit's cgroup, by worker."""
    out: dict[int, set[int]] = {}
    try:
        entries = os.listdir(proc)
    except OSError:
        return out
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"{proc}/{entry}/cgroup") as fh:
                lines = fh.read().splitlines()
        except OSError:
            continue
        for line in lines:
            wid = unit_worker(line, prefix)
            if wid is not None:
                out.setdefault(wid, set()).add(int(entry))
                break
    return out


def running_worker_pids(spec: FarmSpec, proc: str = "/proc") -> dict[int, frozenset[int]]:
    """The live processes of each of the config's workers that runs now (either runtime)."""
    found = systemd_worker_pids(proc)
    records = ChildRecords(Path(spec.farm.state_dir) / RECORDS_SUBDIR)
    for rec in records.running():
        wid = rec.what.removeprefix("worker ")
        if wid.isdecimal():
            found.setdefault(int(wid), set()).update(tree_pids(rec.pid, proc))
    return {w: frozenset(p) for w, p in found.items() if w in spec.worker_ids and p}
