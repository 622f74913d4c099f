"""I/O: a unit's processes as /proc and the cgroup tree show them: its members
(`unit_pids`, from its main process's cgroup) and the command line a process runs
(`proc_argv`, for adoption). No D-Bus: the systemd runtime passes the MainPID it read.
"""

from __future__ import annotations

import os


def proc_argv(pid: int, proc: str = "/proc") -> tuple[str, ...] | None:
    """The command line process `pid` runs (`/proc/PID/cmdline`); None if unreadable or empty."""
    try:
        with open(f"{proc}/{pid}/cmdline", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    if not raw:
        return None
    return tuple(a.decode("utf-8", "surrogateescape") for a in raw.rstrip(b"\0").split(b"\0"))


def unit_cgroup(pid: int, unit: str, proc: str = "/proc") -> str | None:
    """The line of `/proc/PID/cgroup` that puts process `pid` in unit `unit`'s own cgroup
    ("0::/system.slice/.../sglang@3.service", or on a hybrid host the
    "N:name=systemd:..." one), else None.

    `pid` is the MainPID systemd reports; a process cannot leave its unit's cgroup (the
    tree under system.slice is root's), so the unit's processes are its members.
    """
    try:
        with open(f"{proc}/{pid}/cgroup") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    ours = [ln for ln in lines if ln.rsplit("/", 1)[-1] == unit]
    ours.sort(key=lambda ln: not ln.startswith("0::"))  # the unified hierarchy first
    return ours[0] if ours else None


def cgroup_pids(path: str, root: str = "/sys/fs/cgroup") -> frozenset[int]:
    """Every process in cgroup `path` and the cgroups below it (`cgroup.procs`)."""
    out: set[int] = set()
    for dirpath, _dirs, _files in os.walk(root + path):
        try:
            with open(os.path.join(dirpath, "cgroup.procs")) as fh:
                out.update(int(x) for x in fh.read().split())
        except (OSError, ValueError):
            continue
    return frozenset(out)


def _cgroup_members(line: str, proc: str) -> frozenset[int]:
    """The processes whose `/proc/PID/cgroup` holds `line` (or a cgroup below it): the way
    when the cgroup file system is not where it is looked for."""
    out: set[int] = set()
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        try:
            with open(f"{proc}/{entry}/cgroup") as fh:
                lines = fh.read().splitlines()
        except OSError:
            continue
        if any(ln == line or ln.startswith(line + "/") for ln in lines):
            out.add(int(entry))
    return frozenset(out)


def unit_pids(
    main_pid: int, unit: str, proc: str = "/proc", root: str = "/sys/fs/cgroup"
) -> frozenset[int]:
    """The processes of `unit`, found from its main process's cgroup; empty if unknown."""
    line = unit_cgroup(main_pid, unit, proc)
    if line is None:
        return frozenset()
    hierarchy, _, path = line.partition(":")[2].partition(":")
    # cgroup v2 at /sys/fs/cgroup; on a hybrid host its unified tree and systemd's own
    # v1 tree are mounted below it.
    roots = [root, f"{root}/unified"] if not hierarchy else [f"{root}/systemd"]
    for r in roots:
        if os.path.isfile(f"{r}{path}/cgroup.procs"):
            return cgroup_pids(path, r) | {main_pid}
    return _cgroup_members(line, proc) | {main_pid}
