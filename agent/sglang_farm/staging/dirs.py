"""I/O: folders the staging may use on a host where other local users write too, each
one the workers can enter whatever the agent's umask.

A folder is trusted when no other user can change what it holds: it is owned by root or
the agent's user, and nobody else may write to it (a group of root's counts as root),
unless it is sticky (`/dev/shm`, `/tmp`: another user can then neither rename nor remove
an entry it does not own; the entry below is checked in turn). A path is trusted when
every folder from `/` down to it is, and every symbolic link on the way is root's (or
the agent's): where another user can change a folder, it can swap the model after the
stage, or plant what the stage writes through (docs/staging.md, "Other users"). The
rule is `folder_trust`'s, the one the agent's own folders follow (`securepath`).

The workers run as [farm] user, the agent as root under UMask=0077: every folder the
staging creates gets its mode explicitly (DIR_MODE where the workers must enter it).
"""

from __future__ import annotations

import contextlib
import grp
import os
import stat
from pathlib import Path

from sglang_farm.host.folder_trust import Distrust, folder_distrust, link_distrust
from sglang_farm.staging.failure import StageError, StageFailureKind

DIR_MODE = 0o755


def _trusted() -> tuple[int, int]:
    """Root and the agent's own user: the only owners whose files the staging trusts."""
    return (0, os.geteuid())


def _refusal(folder: Path, st: os.stat_result, what: str) -> StageError | None:
    """Why `folder` (lstat `st`) cannot be trusted, as the error to raise; None: trusted."""
    if stat.S_ISLNK(st.st_mode):
        return StageError(
            StageFailureKind.IO_ERROR,
            f"{what}: {folder} is a symbolic link owned by uid {st.st_uid}, not by root: "
            "its owner could point it anywhere",
            f"replace it with a folder of root's (rm {folder}; mkdir -m 755 {folder}), "
            "then `farmctl start all`",
        )
    if not stat.S_ISDIR(st.st_mode):
        return StageError(
            StageFailureKind.IO_ERROR,
            f"{what}: {folder} is not a folder",
            f"remove it (rm {folder}) or correct the config, then `farmctl start all`",
        )
    distrust = folder_distrust(st.st_uid, st.st_mode, _trusted(), own=False, group=st.st_gid)
    if distrust is Distrust.OWNER:
        return StageError(
            StageFailureKind.IO_ERROR,
            f"{what}: {folder} is owned by uid {st.st_uid}, not by root or the agent "
            f"(uid {os.geteuid()}): its owner could replace what the stage puts there",
            f"check what it holds, then make it root's (chown root: {folder}; "
            f"chmod go-w {folder}) or remove it (rm -rf {folder}), and `farmctl start all`",
        )
    if distrust is Distrust.OTHERS_WRITE:
        return StageError(
            StageFailureKind.IO_ERROR,
            f"{what}: {folder} is writable by other users (mode "
            f"{stat.S_IMODE(st.st_mode):04o}) and not sticky: they could replace what the "
            "stage puts there",
            f"chmod go-w {folder} (or chmod +t {folder} where users share it, as /dev/shm), "
            "then `farmctl start all`",
        )
    return None


def trusted_dir(path: Path, what: str, mode: int = DIR_MODE) -> None:
    """Make sure folder `path` exists and no other user can change it or a folder above it;
    missing folders are created with `mode` (whatever the umask), each checked once made
    (another user may have made it first). `what` names the folder in errors
    ("[farm] state_dir"). Raises StageError (IO_ERROR) naming the folder and the fix."""
    path = Path(os.path.abspath(path))
    missing: list[str] = []
    existing = path
    while not os.path.lexists(existing):
        missing.append(existing.name)
        existing = existing.parent
    try:
        for p in (existing, *existing.parents):  # links on the way: root's only
            st = os.lstat(p)
            refused = _refusal(p, st, what) if stat.S_ISLNK(st.st_mode) else None
            if refused is not None and link_distrust(st.st_uid, _trusted()) is not None:
                raise refused
        real = Path(os.path.realpath(existing))
        for p in (*reversed(real.parents), real):  # from / down
            refused = _refusal(p, os.lstat(p), what)
            if refused is not None:
                raise refused
        for name in reversed(missing):
            real = real / name
            made = False
            with contextlib.suppress(FileExistsError):
                os.mkdir(real, 0o700)
                made = True
            fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                refused = _refusal(real, os.fstat(fd), what)
                if refused is not None:
                    raise refused
                if made:
                    os.fchmod(fd, mode)
            finally:
                os.close(fd)
    except OSError as exc:
        # ELOOP: another user's link appeared where a folder was just made.
        raise StageError(
            StageFailureKind.IO_ERROR,
            f"{what}: cannot make or check {path}: {exc.strerror or exc} ({exc.filename})",
            "fix the cause (permissions, the disk), then `farmctl start all`",
        ) from exc


def own_dir_fd(path: Path) -> int:
    """A descriptor of folder `path`, opened without following a link and refused unless
    the agent's user owns it. Raises StageError (IO_ERROR)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise StageError(
            StageFailureKind.IO_ERROR,
            f"cannot open the folder {path}: {exc.strerror or exc}",
            "fix the cause (permissions, the disk), then `farmctl start all`",
        ) from exc
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        os.close(fd)
        raise StageError(
            StageFailureKind.IO_ERROR,
            f"{path} is owned by uid {st.st_uid}, not by the agent (uid {os.geteuid()})",
            f"check what it is, then remove it (rm -rf {path}) and `farmctl start all`",
        )
    return fd


def give_group(fd: int, gid: int | None, path: Path) -> None:
    """Give the agent's file `fd` (at `path`, for the message) group `gid`; None: leave it
    the agent's. The owner may hand a file to a group it is in, no capability needed (the
    agent's unit lists [farm] group in SupplementaryGroups=). Raises StageError."""
    if gid is None:
        return
    try:
        os.fchown(fd, -1, gid)
    except PermissionError as exc:
        try:
            name = grp.getgrgid(gid).gr_name
        except KeyError:
            name = str(gid)
        raise StageError(
            StageFailureKind.IO_ERROR,
            f"cannot give {path} to [farm] group {name!r} (the workers read the copy "
            "through it): the agent is not a member of that group",
            f"add {name} to the agent's groups (sglang-farm.service's SupplementaryGroups=) "
            "or set [farm] group to one the agent is in, then `farmctl start all`",
        ) from exc


def subdir_fd(
    root_fd: int, parts: tuple[str, ...], mode: int = DIR_MODE, gid: int | None = None
) -> int:
    """The folder `parts` below `root_fd` (one of the agent's own), made `mode` (of group
    `gid`: `give_group`) where missing; no component is followed through a link. The
    caller closes the result."""
    fd = os.dup(root_fd)
    try:
        for name in parts:
            made = False
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o700, dir_fd=fd)
                made = True
            nfd = os.open(
                name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd
            )
            os.close(fd)
            fd = nfd
            if made:
                give_group(fd, gid, Path(name))
                os.fchmod(fd, mode)
        return fd
    except BaseException:
        os.close(fd)
        raise
