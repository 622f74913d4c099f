"""I/O: the filesystem a path lives on: its mount (/proc/self/mountinfo: mount point,
type, superblock options such as a tmpfs's `size=`) and its free space (statvfs).

`mount_facts` is the one seam the stage's space check reads through: tests pass their
own figure instead (a small tmpfs cannot be mounted without root).
"""

from __future__ import annotations

import os
from pathlib import Path

from sglang_farm.staging.plan import MountFacts

MOUNTINFO = "/proc/self/mountinfo"


def _unescape(field: str) -> str:
    # The kernel escapes space, tab, newline and backslash in mountinfo as \ooo.
    out, i = [], 0
    while i < len(field):
        code = field[i + 1 : i + 4]
        if field[i] == "\\" and len(code) == 3 and code.isdigit():
            out.append(chr(int(code, 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> list[tuple[str, str, str]]:
    """(mount point, fstype, mount options + superblock options) per line of mountinfo."""
    rows: list[tuple[str, str, str]] = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        f = left.split()
        r = right.split()
        if len(f) < 6 or len(r) < 3:
            continue
        rows.append((_unescape(f[4]), r[0], f"{f[5]},{r[2]}"))
    return rows


def existing_ancestor(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists (a target not created yet)."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def mount_facts(path: Path, *, mountinfo: str | None = None) -> MountFacts:
    """The mount holding `path` (or its nearest existing ancestor), and its free space."""
    where = existing_ancestor(path).resolve()
    text = mountinfo if mountinfo is not None else Path(MOUNTINFO).read_text()
    best = ("/", "unknown", "")
    for point, fstype, options in parse_mountinfo(text):
        inside = str(where) == point or str(where).startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best[0]):
            best = (point, fstype, options)  # later lines over-mount earlier ones
    st = os.statvfs(where)
    return MountFacts(
        mount_point=best[0],
        fstype=best[1],
        options=best[2],
        free_bytes=st.f_bavail * st.f_frsize,
        total_bytes=st.f_blocks * st.f_frsize,
    )
