"""I/O: one stage at a time per target, with a lock a crashed agent cannot leave stuck.

`flock(2)` on a lock file beside the target: the kernel drops the lock when its holder's
file descriptor closes, a killed process included, so a stale lock file never blocks a
later start (the file itself stays; it is never the lock). The holder's pid is written
into it for the waiting side's message.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from sglang_farm.staging.dirs import make_dirs
from sglang_farm.staging.failure import StageError, StageFailureKind

LOCK_POLL_S = 0.2  # flock has no timeout: a non-blocking try, then a wait on `cancel`


def lock_path(target: Path) -> Path:
    return target.parent / f".{target.name}.lock"


def _open_own(path: Path) -> int:
    """The lock file, created if missing; refused when it is a symbolic link or another
    user's (its folder may be /dev/shm, writable by every local user)."""
    fix = f"check what it is, then remove it (rm {path}) and `farmctl start all`"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StageError(
                StageFailureKind.IO_ERROR,
                f"the stage lock {path} is a symbolic link (to {os.readlink(path)}); "
                "a stage does not follow it",
                fix,
            ) from exc
        raise
    owner = os.fstat(fd).st_uid
    if owner != os.geteuid():
        os.close(fd)
        raise StageError(
            StageFailureKind.IO_ERROR,
            f"the stage lock {path} is owned by uid {owner}, not by the agent "
            f"(uid {os.geteuid()}): another user created it",
            fix,
        )
    return fd


@contextlib.contextmanager
def stage_lock(
    target: Path,
    *,
    cancel: threading.Event,
    on_wait: Callable[[str], None] = lambda _holder: None,
) -> Iterator[None]:
    """Hold the target's stage lock; waits (calling `on_wait` once) while another holds it.

    Raises StageError(CANCELLED) when `cancel` is set while waiting.
    """
    path = lock_path(target)
    make_dirs(path.parent)  # 0755 each: the workers must enter them (UMask=0077)
    fd = _open_own(path)
    try:
        told = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not told:
                    holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                    on_wait(holder)
                    told = True
                if cancel.wait(LOCK_POLL_S):
                    raise StageError(
                        StageFailureKind.CANCELLED,
                        f"gave up waiting for the stage lock {path}",
                        "the agent is stopping",
                    ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock
