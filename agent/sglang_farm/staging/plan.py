"""Pure: what a stage must do, decided by comparing the source's manifest with the one
the staged copy recorded (and with the files actually there), and whether it fits.

A file is kept (hard-linked into the new copy, never rewritten) when the recorded entry
equals the source's and the staged file still has its size; everything else is copied.
Nothing to copy and nothing to drop: the copy is current and is not touched.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sglang_farm.staging.manifest import FileEntry, Manifest


@dataclass(frozen=True, slots=True)
class StagePlan:
    copy: tuple[FileEntry, ...]  # copied from the source and verified
    keep: tuple[FileEntry, ...]  # already staged and verified: linked into the new copy
    drop: tuple[str, ...]  # staged files the source no longer has
    # The staged copy is exactly the source: nothing to do (also no manifest to rewrite).
    current: bool

    @property
    def copy_bytes(self) -> int:
        return sum(f.size for f in self.copy)


def plan_stage(
    source: Manifest, recorded: Manifest | None, present: Mapping[str, int]
) -> StagePlan:
    """`present`: each file in the staged copy now (relative path -> size)."""
    old = recorded.by_path() if recorded is not None else {}
    copy: list[FileEntry] = []
    keep: list[FileEntry] = []
    for f in source.files:
        was = old.get(f.path)
        if was is not None and was == f and present.get(f.path) == f.size:
            keep.append(f)
        else:
            copy.append(f)
    wanted = {f.path for f in source.files}
    drop = tuple(sorted(p for p in present if p not in wanted))
    current = not copy and not drop and recorded is not None and recorded.origin == source.origin
    return StagePlan(tuple(copy), tuple(keep), drop, current)


@dataclass(frozen=True, slots=True)
class MountFacts:
    """The filesystem a path lives on, as /proc/self/mountinfo and statvfs tell it."""

    mount_point: str
    fstype: str
    options: str  # the superblock options ("rw,nosuid,nodev,size=65536k,...")
    free_bytes: int  # available to an unprivileged writer (f_bavail)
    total_bytes: int

    @property
    def is_tmpfs(self) -> bool:
        return self.fstype in ("tmpfs", "ramfs")

    @property
    def size_option(self) -> str | None:
        """A tmpfs's `size=` option as written in the mount table (None: none, or not tmpfs)."""
        for opt in self.options.split(","):
            if opt.startswith("size="):
                return opt
        return None


def gib(n: int) -> str:
    """Bytes for people: '3.2 GiB', '512.0 MiB', '17 bytes'."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def space_problem(
    need: int, headroom: int, mount: MountFacts, target: str, what: str
) -> tuple[str, str] | None:
    """(what is wrong, what to do) when `need` bytes plus `headroom` do not fit; else None.

    On a tmpfs the size is a mount option: the message names it and by how much the
    filesystem falls short, and the fix is a remount with a larger size.
    """
    want = need + headroom
    if want <= mount.free_bytes:
        return None
    short = want - mount.free_bytes
    msg = (
        f"not enough space for {what} at {target}: it needs {gib(need)} plus "
        f"{gib(headroom)} headroom ([model] headroom), {mount.mount_point} "
        f"({mount.fstype}) has {gib(mount.free_bytes)} free of {gib(mount.total_bytes)}: "
        f"{gib(short)} short"
    )
    if mount.is_tmpfs:
        size = mount.size_option or "size= (the default: half of RAM)"
        grown = mount.total_bytes + short
        msg += f"; the tmpfs's size is its mount option {size}"
        fix = (
            f"grow it by at least {gib(short)}: `mount -o remount,size={grown // (1 << 20) + 1}M "
            f"{mount.mount_point}` (and in /etc/fstab to keep it), or free space there, or "
            "lower [model] headroom"
        )
    else:
        fix = (
            f"free at least {gib(short)} on {mount.mount_point}, or point [sglang] model_path "
            "at a filesystem with room, or lower [model] headroom"
        )
    return msg, fix
