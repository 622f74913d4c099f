"""I/O: the one way the farm replaces a file: whole old or whole new, even across a crash;
and, for its own state files, a second copy to read when the first is found damaged."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make a rename or unlink in `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(target: Path, data: bytes, mode: int = 0o644) -> None:
    """Write through a temp file in the same directory, fsync, rename over `target`, fsync
    the directory. A reader sees the old file or the new one, never a mix."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fchmod(fh.fileno(), mode)  # mkstemp makes 0600
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(target.parent)


def copy_path(target: Path) -> Path:
    """Where `write_with_copy` keeps `target`'s second copy: `<name>.copy` beside it."""
    return target.with_name(target.name + ".copy")


def write_with_copy(target: Path, data: bytes, mode: int = 0o644) -> None:
    """`write_atomic` of `target`, then of its second copy (`copy_path`), with the same
    data: a file found damaged (cut short, overwritten by hand) has a whole twin to read
    instead (issue 30, items 6 and 9). A crash between the two leaves the copy one save
    behind, which is read only when `target` is damaged or missing. Raises the first
    OSError (a full disk): the caller says that its state is not saved."""
    write_atomic(target, data, mode)
    write_atomic(copy_path(target), data, mode)
