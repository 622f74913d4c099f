"""A full disk for the fail-closed tests (issue 30, item 5): a small tmpfs of its own,
filled to the last byte, never the machine's disk.

Mounting needs root (and a kernel that lets this process mount); elsewhere the test is
skipped with the reason.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

FILLER = "filler"


@contextlib.contextmanager
def small_tmpfs(where: Path, size_kib: int = 1024) -> Iterator[Path]:
    """`where` (made if missing) as a tmpfs of `size_kib` KiB, 0700 root's, until the
    block ends."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    where.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k,mode=0700", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False, capture_output=True)


def fill(folder: Path) -> Path:
    """Write `folder/filler` until the file system is full (ENOSPC); returns its path."""
    path = folder / FILLER
    for size in (4096, 1):  # then the last bytes a smaller write still takes
        with open(path, "ab", buffering=0) as fh, contextlib.suppress(OSError):
            while True:
                fh.write(b"\0" * size)
    return path
