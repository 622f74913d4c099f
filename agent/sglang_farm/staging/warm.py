"""I/O: read every staged file once, so workers that start together load from the page
cache instead of racing the same cold reads. Skipped on a tmpfs (already in memory)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from sglang_farm.staging.progress import StageProgress
from sglang_farm.staging.source import walk_sizes

CHUNK = 8 << 20


def warm(
    target: Path,
    *,
    cancel: threading.Event,
    report: Callable[[StageProgress], None] = lambda _p: None,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """Read each file under `target` once; returns the bytes read (stops early on cancel)."""
    sizes = walk_sizes(target)
    total = sum(sizes.values())
    done = 0
    t0 = last = clock()
    for rel in sorted(sizes):
        fd = os.open(target / rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while chunk := os.read(fd, CHUNK):
                done += len(chunk)
                if cancel.is_set():
                    return done
                if clock() - last >= 0.25:
                    last = clock()
                    report(StageProgress("warming", done, total, last - t0))
        finally:
            os.close(fd)
    report(StageProgress("warming", done, total, clock() - t0))
    return done
