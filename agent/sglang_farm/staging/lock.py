"""I/O: one stage at a time per target, with a lock a crashed agent cannot leave stuck,
and no other user can take.

`flock(2)` on a lock file in the farm's own folder (`<state_dir>/staging/`, root's,
0700): the kernel drops the lock when its holder's file descriptor closes, a killed
process included, so a stale lock file never blocks a later start (the file itself stays;
it is never the lock). The holder's pid is written into it for the waiting side's
message. The lock once lived beside the target, in `/dev/shm`, where any local user
could plant a file or link by its name and stop every stage (issue 22); the folder is
now one only root can write, checked before use (`dirs.trusted_dir`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from sglang_farm.staging.dirs import trusted_dir
from sglang_farm.staging.failure import StageError, StageFailureKind

LOCK_POLL_S = 0.2  # flock has no timeout: a non-blocking try, then a wait on `cancel`
LOCK_SUBDIR = "staging"  # below [farm] state_dir


def lock_dir_of(state_dir: str | Path) -> Path:
    return Path(state_dir) / LOCK_SUBDIR


def lock_path(lock_dir: Path, target: Path) -> Path:
    """The target's lock file: its name, for people, and a digest of its whole path (two
    targets of one name in different folders are two locks)."""
    digest = hashlib.sha256(os.fsencode(os.path.abspath(target))).hexdigest()[:16]
    return lock_dir / f"{target.name}-{digest}.lock"


def _open_own(path: Path) -> int:
    """The lock file, created if missing; refused when it is a symbolic link or another
    user's (only root can write its folder: neither should ever be)."""
    fix = f"check what it is, then remove it (rm {path}) and `farmctl start all`"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StageError(
                StageFailureKind.IO_ERROR,
                f"the stage lock {path} is a symbolic link (to {os.readlink(path)}); "
                "a stage does not follow it",
                fix,
            ) from exc
        raise StageError(
            StageFailureKind.IO_ERROR,
            f"cannot open the stage lock {path}: {exc.strerror or exc}",
            f"check {path.parent} ([farm] state_dir) and its permissions, then `farmctl start all`",
        ) from exc
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
    lock_dir: Path,
    cancel: threading.Event,
    on_wait: Callable[[str], None] = lambda _holder: None,
) -> Iterator[None]:
    """Hold the target's stage lock (in `lock_dir`, see `lock_dir_of`); waits (calling
    `on_wait` once) while another holds it.

    Raises StageError: CANCELLED when `cancel` is set while waiting; IO_ERROR when
    `lock_dir` or a folder above it is another user's, or writable by others.
    """
    trusted_dir(lock_dir.parent, "[farm] state_dir (the stage lock's folder)")
    trusted_dir(lock_dir, "[farm] state_dir (the stage lock's folder)", 0o700)
    path = lock_path(lock_dir, target)
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
