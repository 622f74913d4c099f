"""I/O: make a target directory hold exactly a source's files, never half-copied, on a
host where other local users write too (model_path's folder is usually /dev/shm).

Under the target's stage lock (lock.py: in the farm's own folder, never beside the
target): the folder above the target must be one no other user can change
(`dirs.trusted_dir`); what another user put at model_path itself (a folder, a file, a
link) is moved aside (`.<name>.foreign-…`), never entered nor removed; temporaries and
old copies a killed stage left that are the agent's own are removed (a failed removal
fails the stage, naming it), anyone else's left alone; the plan (`plan.plan_stage`) says
what to copy; the free space is checked first (`plan.space_problem`); the files are copied
into a temporary sibling the agent makes itself (`mkdtemp`: an unpredictable name, made
exclusively, checked to be its own; same filesystem), every file and the manifest created
through that folder's descriptor with O_EXCL|O_NOFOLLOW and chmod-ed through their own
descriptors, so nothing planted there is written through; each source file is opened
without following a link (source.SourceTree); unchanged files are hard-linked from the
current copy; each copied file's size is checked and its bytes hashed as they stream
(sha256, or the git blob id of a Hub small file) against the digest the source vouches
for; then the sibling is renamed into place, the previous copy swapped out in the same
step, renamed aside (`.<name>.old-…`) and removed now, or by the caller once no worker uses
it (a reload's rolling restart).

A worker only ever sees the old copy or the new one: a kill at any point leaves the
target as it was, and the next stage removes the temporary and starts over.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import secrets
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import structlog

from sglang_farm.host.atomicfile import fsync_dir
from sglang_farm.staging.dirs import give_group, own_dir_fd, subdir_fd, trusted_dir
from sglang_farm.staging.failure import StageError, StageFailureKind
from sglang_farm.staging.lock import stage_lock
from sglang_farm.staging.manifest import MANIFEST_NAME, FileEntry, Manifest, manifest_from_json
from sglang_farm.staging.plan import MountFacts, gib, plan_stage, space_problem
from sglang_farm.staging.progress import StageProgress
from sglang_farm.staging.source import SourceTree, walk_sizes
from sglang_farm.staging.space import mount_facts
from sglang_farm.staging.state import StageResult

log = structlog.get_logger("sglang_farm.staging")

CHUNK = 8 << 20  # bytes per read: large enough for the page cache's read-ahead
# The workers run as [farm] user, the agent as root under UMask=0077: the copy's modes are
# set explicitly, whatever the umask. Issue 30, item 8: the copy was 0644/0755, so a private
# model (a 0600 source, gated weights) was anyone's to read in /dev/shm. It is the agent's
# and [farm] group's (`group`): the workers read it, other users cannot even enter it.
FILE_MODE = 0o640
COPY_DIR_MODE = 0o750  # model_path and every folder of the copy
REPORT_EVERY_S = 0.25  # progress reports at most this often (they rebuild the farm view)
# Files copied at once: hashing is the bottleneck of one stream (0.72 GiB/s against 1.1-1.4
# for `cp -r`, 16 GiB into a tmpfs on the H200 host: docs/staging.md); hashlib, read and
# write release the GIL, so a few streams use a few cores.
COPY_STREAMS = 4

Report = Callable[[StageProgress], None]


def _token() -> str:
    """An unpredictable name part: another user cannot plant what the stage will use."""
    return secrets.token_hex(8)


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _leftovers(target: Path) -> list[Path]:
    """Temporaries of stages that were killed, and old copies a reload left behind
    (whoever made them: the caller checks the owner)."""
    prefixes = (f".{target.name}.staging-", f".{target.name}.old-")
    return [p for p in target.parent.iterdir() if p.name.startswith(prefixes)]


def _remove_leftovers(target: Path) -> None:
    """Remove the agent's own leftovers; another user's (planted under such a name) are
    not the agent's to enter or remove. Raises StageError naming one that cannot go."""
    for left in _leftovers(target):
        st = _lstat(left)
        if st is None:
            continue
        if st.st_uid != os.geteuid():
            log.warning("model_stage_leftover_not_ours", path=str(left), uid=st.st_uid)
            continue
        try:
            remove_old(left)
        except OSError as exc:
            raise StageError(
                StageFailureKind.IO_ERROR,
                f"cannot remove {left}, left beside {target} by an earlier stage: "
                f"{exc.strerror or exc} ({exc.filename})",
                f"check it and remove it by hand (rm -rf {left}), then `farmctl start all`",
            ) from exc


def _move_aside(target: Path, st: os.stat_result) -> None:
    """Rename another user's entry at model_path out of the way (the entry itself, never
    what a link points at); it is left for the operator to look at, not removed.

    Moved, not refused: otherwise any local user could stop every stage (and so every
    worker) by creating model_path first, after a reboot emptied /dev/shm. The agent can
    always do it: it owns the folder (checked by trusted_dir), and the owner of a sticky
    folder may rename any entry in it."""
    aside = target.parent / f".{target.name}.foreign-{_token()}"
    try:
        os.rename(target, aside)
    except OSError as exc:
        raise StageError(
            StageFailureKind.IO_ERROR,
            f"cannot move {target} ([sglang] model_path) aside: {target} is owned by uid "
            f"{st.st_uid}, not by the agent (uid {os.geteuid()}), and renaming it failed "
            f"({exc.strerror or exc})",
            f"check what it is, then remove it as root (rm -rf {target}) and `farmctl start all`",
        ) from exc
    log.warning(
        "model_path_foreign_moved_aside",
        path=str(target),
        moved_to=str(aside),
        uid=st.st_uid,
        what="link"
        if stat.S_ISLNK(st.st_mode)
        else "folder"
        if stat.S_ISDIR(st.st_mode)
        else "file",
    )


def _recorded(target: Path) -> Manifest | None:
    """The manifest the copy at `target` (the agent's own folder) recorded; trusted only
    when the manifest is the agent's own file (not a link): /dev/shm is writable by every
    local user, who could plant a folder with a matching manifest over files of their
    choosing."""
    try:
        fd = os.open(target / MANIFEST_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.geteuid() or not stat.S_ISREG(st.st_mode):
            return None
        try:
            return manifest_from_json(f.read().decode())
        except (OSError, UnicodeDecodeError):
            return None


def _make_temp(target: Path, gid: int | None) -> tuple[Path, int]:
    """A new temporary sibling of `target` (same filesystem, for the rename), made by the
    agent itself under an unpredictable name (mkdtemp: mkdir fails on anything already
    there), checked to be its own folder; with a descriptor for every write into it."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.staging-", dir=target.parent))
    st = os.lstat(tmp)
    fd = own_dir_fd(tmp)
    fst = os.fstat(fd)
    if (st.st_dev, st.st_ino) != (fst.st_dev, fst.st_ino) or not stat.S_ISDIR(st.st_mode):
        os.close(fd)
        raise StageError(
            StageFailureKind.IO_ERROR,
            f"the temporary folder {tmp} was replaced as soon as it was made",
            f"find who writes in {target.parent}, then `farmctl start all`",
        )
    try:
        give_group(fd, gid, tmp)
        os.fchmod(fd, COPY_DIR_MODE)  # the copy's own mode, once it is model_path
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.rmdir(tmp)  # empty: nothing was written yet
        raise
    return tmp, fd


def _create(dir_fd: int, name: str, gid: int | None) -> int:
    """A new file `name` in the agent's folder `dir_fd`: never an existing one, never
    through a link; FILE_MODE whatever the umask, of group `gid` (None: the agent's)."""
    fd = os.open(
        name,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
        FILE_MODE,
        dir_fd=dir_fd,
    )
    try:
        give_group(fd, gid, Path(name))
        os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _split(rel: str) -> tuple[tuple[str, ...], str]:
    *dirs, name = rel.split("/")
    return tuple(dirs), name


class _Copy:
    """One stage's byte copying: progress, cancellation, verification."""

    def __init__(
        self,
        tree: SourceTree,
        tmp_fd: int,
        total: int,
        report: Report,
        cancel: threading.Event,
        clock: Callable[[], float],
        gid: int | None = None,
    ) -> None:
        self.tree = tree
        self.tmp_fd = tmp_fd
        self.gid = gid
        self.total = total
        self.done = 0
        self.report = report
        self.cancel = cancel
        self.clock = clock
        self.started = clock()
        self.last = 0.0
        self.lock = threading.Lock()  # `done` and `last`: several files stream at once
        self.abort = threading.Event()  # another file's copy failed: stop the rest

    def copy_all(self, files: list[FileEntry], origin: str) -> None:
        """Every file, COPY_STREAMS at a time; the first failure stops the others and is
        the one raised."""
        with ThreadPoolExecutor(max_workers=max(1, min(COPY_STREAMS, len(files)))) as pool:
            futures = [pool.submit(self.file, e, origin) for e in files]
            first: BaseException | None = None
            for fut in as_completed(futures):
                exc = fut.exception()
                if exc is not None and first is None:
                    first = exc
                    self.abort.set()
        if first is not None:
            raise first

    def tell(self, force: bool = False) -> None:
        with self.lock:
            now = self.clock()
            if not (force or now - self.last >= REPORT_EVERY_S):
                return
            self.last = now
            done = self.done
        self.report(StageProgress("copying", done, self.total, now - self.started))

    def file(self, entry: FileEntry, origin: str) -> None:
        sha = hashlib.sha256() if entry.sha256 else None
        # git's blob id of a Hub small file is a sha1 over "blob <size>\0" + content.
        git = hashlib.sha1(b"blob %d\0" % entry.size) if entry.git_sha1 else None
        dirs, name = _split(entry.path)
        n = 0
        dir_fd = subdir_fd(self.tmp_fd, dirs, COPY_DIR_MODE, self.gid)
        try:
            with (
                os.fdopen(self.tree.open(entry.path), "rb") as fin,
                os.fdopen(_create(dir_fd, name, self.gid), "wb") as fout,
            ):
                while chunk := fin.read(CHUNK):
                    if self.abort.is_set():
                        raise StageError(
                            StageFailureKind.CANCELLED,
                            f"stage of {origin}: {entry.path} stopped, another file failed",
                            "see the other file's error",
                        )
                    if self.cancel.is_set():
                        raise StageError(
                            StageFailureKind.CANCELLED,
                            f"stage of {origin} cancelled at {entry.path}",
                            "the agent is stopping; the next start stages again",
                        )
                    fout.write(chunk)
                    n += len(chunk)
                    with self.lock:
                        self.done += len(chunk)
                    if sha is not None:
                        sha.update(chunk)
                    if git is not None:
                        git.update(chunk)
                    self.tell()
                fout.flush()
                os.fsync(fout.fileno())
                written = os.fstat(fout.fileno()).st_size
        finally:
            os.close(dir_fd)
        if n != entry.size or written != entry.size:
            raise StageError(
                StageFailureKind.SIZE_MISMATCH,
                f"{entry.path}: copied {n} bytes, the source listed {entry.size} "
                f"(from {origin}); it changed while being copied",
                "stage again once the source is quiet (`farmctl start all`)",
            )
        got = sha.hexdigest() if sha is not None else git.hexdigest() if git is not None else None
        want = entry.sha256 or entry.git_sha1
        if got is not None and got != want:
            if origin.startswith("hub:"):
                # The Hub vouches for the digest: the cache's blob is what went bad.
                blob = self.tree.real_path(entry.path)
                fix = (
                    f"the Hub cache's copy is corrupt: delete the blob (rm {blob}); the next "
                    "`farmctl start all` downloads it again"
                )
            else:
                src = self.tree.real_path(entry.path)
                fix = (
                    f"the source file is corrupt or the checksum is stale: check it with "
                    f"`sha256sum {src}`, restore the file (or regenerate SHA256SUMS), then "
                    "`farmctl start all`"
                )
            raise StageError(
                StageFailureKind.CHECKSUM_MISMATCH,
                f"checksum mismatch: {entry.path} from {origin} hashes to {got}, the source "
                f"vouches for {want} ({entry.digest_text.split()[0]})",
                fix,
            )


def _keep(target_fd: int, tmp_fd: int, rel: str, gid: int | None) -> None:
    """Hard-link an unchanged file of the current copy (the agent's own) into the new one;
    copied where the filesystem has no hard links. A link made before issue 30 (0644)
    gets the copy's mode and group too."""
    dirs, name = _split(rel)
    dir_fd = subdir_fd(tmp_fd, dirs, COPY_DIR_MODE, gid)
    try:
        try:
            os.link(rel, name, src_dir_fd=target_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            src = os.open(rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=target_fd)
            with (
                os.fdopen(src, "rb") as fin,
                os.fdopen(_create(dir_fd, name, gid), "wb") as fout,
            ):
                shutil.copyfileobj(fin, fout, CHUNK)
        else:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            try:
                give_group(fd, gid, Path(rel))
                os.fchmod(fd, FILE_MODE)
            finally:
                os.close(fd)
    finally:
        os.close(dir_fd)


def _write_manifest(tmp_fd: int, manifest: Manifest, gid: int | None) -> None:
    """The manifest, a new file of the agent's (never through whatever is planted)."""
    with os.fdopen(_create(tmp_fd, MANIFEST_NAME, gid), "wb") as f:
        f.write(manifest.to_json().encode())
        f.flush()
        os.fsync(f.fileno())


_RENAME_NOREPLACE = 1  # linux/fs.h
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _renameat2(a: Path, b: Path, flags: int) -> bool:
    """renameat2(2) (Linux 3.15, tmpfs and the common disk filesystems); False where the
    kernel or filesystem cannot, so the caller falls back."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):  # a libc without renameat2 (glibc < 2.28)
        return False
    renameat2.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    rc = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), flags)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a))


def exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (RENAME_EXCHANGE); False where the kernel or filesystem
    cannot, so the caller falls back to two renames."""
    return _renameat2(a, b, _RENAME_EXCHANGE)


def swap_back(target: Path, old: Path) -> None:
    """Put the previous copy `old` back at `target` and the copy that was there at `old`
    (a rolled-back canary's model, issue 23): one step where the kernel can; else three
    renames through a temporary sibling, the copy put back on a failure. Raises OSError."""
    if exchange(target, old):
        fsync_dir(target.parent)
        return
    aside = target.parent / f".{target.name}.old-{_token()}"
    os.rename(target, aside)
    try:
        os.rename(old, target)
    except OSError:
        os.rename(aside, target)
        raise
    os.rename(aside, old)
    fsync_dir(target.parent)


def _rename_new(a: Path, b: Path) -> bool:
    """Rename `a` to `b` where nothing is at `b`; False where something is (another user
    may create model_path while the stage copies)."""
    try:
        if _renameat2(a, b, _RENAME_NOREPLACE):
            return True
    except FileExistsError:
        return False
    if os.path.lexists(b):  # no RENAME_NOREPLACE here: checked, then renamed
        return False
    os.rename(a, b)
    return True


INSTALL_TRIES = 3  # another user re-creating model_path each time: give up, saying so


def _close_up(target: Path, gid: int | None) -> None:
    """A current copy at model_path (the agent's own folder) gets the copy's folder mode
    and group: nobody but the agent and the workers enters it, whatever is inside."""
    fd = own_dir_fd(target)
    try:
        give_group(fd, gid, target)
        os.fchmod(fd, COPY_DIR_MODE)
    except OSError as exc:
        raise StageError(
            StageFailureKind.IO_ERROR,
            f"cannot make {target} private to the workers: {exc.strerror or exc}",
            "fix the cause (permissions, the disk), then `farmctl start all`",
        ) from exc
    finally:
        os.close(fd)


def stage_copy(
    source: Path | SourceTree,
    manifest: Manifest,
    target: Path,
    *,
    lock_dir: Path,
    headroom: int,
    cancel: threading.Event,
    report: Report = lambda _p: None,
    measure: Callable[[Path], MountFacts] = mount_facts,
    keep_old: bool = False,
    on_wait: Callable[[str], None] = lambda _holder: None,
    clock: Callable[[], float] = time.monotonic,
    group: int | None = None,
) -> StageResult:
    """Make `target` hold exactly `manifest`'s files from `source` (a folder, or its
    SourceTree). `lock_dir`: the stage locks' folder (lock.lock_dir_of). `group`: the gid
    the copy is given (the workers' [farm] group; None: the agent's own, when the
    workers run as the agent). Raises StageError."""
    tree = source if isinstance(source, SourceTree) else SourceTree.at(source)
    t0 = clock()
    trusted_dir(target.parent, "the folder of [sglang] model_path")
    with stage_lock(target, lock_dir=lock_dir, cancel=cancel, on_wait=on_wait):
        _remove_leftovers(target)
        st = _lstat(target)
        if st is not None and st.st_uid != os.geteuid():
            _move_aside(target, st)
            st = None
        if st is not None and not (stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode)):
            raise StageError(
                StageFailureKind.IO_ERROR,
                f"{target} ([sglang] model_path) exists and is not a directory",
                f"remove it (rm {target}) or point model_path elsewhere",
            )
        # A link of root's at model_path is replaced like a copy, never followed.
        is_copy = st is not None and stat.S_ISDIR(st.st_mode)
        present = walk_sizes(target) if is_copy else {}
        recorded = _recorded(target) if is_copy else None
        plan = plan_stage(manifest, recorded, present)
        if plan.current:
            _close_up(target, group)  # a copy staged before issue 30 was 0755
            return StageResult(
                target, 0, 0, manifest.total_bytes, True, None, clock() - t0, manifest.origin
            )
        facts = measure(target.parent)
        problem = space_problem(plan.copy_bytes, headroom, facts, str(target), manifest.origin)
        if problem is not None:
            msg, fix = problem
            unmanaged = sum(present.values()) if recorded is None else 0
            if unmanaged:
                # A copy made by hand before [model]: it fills the room the new copy needs.
                msg += f"; {target} already holds {gib(unmanaged)} not staged by the farm"
                fix = (
                    f"{fix}; or remove that copy (rm -rf {target}): it frees "
                    f"{gib(unmanaged)}, and the stage copies the model anew"
                )
            raise StageError(StageFailureKind.NO_SPACE, msg, fix)
        tmp: Path | None = None
        tmp_fd = -1
        copy = _Copy(tree, tmp_fd, plan.copy_bytes, report, cancel, clock, group)
        old: Path | None = None
        exchanged = False
        try:
            tmp, tmp_fd = _make_temp(target, group)
            copy.tmp_fd = tmp_fd
            if plan.keep:
                target_fd = own_dir_fd(target)
                try:
                    for f in plan.keep:
                        _keep(target_fd, tmp_fd, f.path, group)
                finally:
                    os.close(target_fd)
            copy.tell(force=True)
            copy.copy_all(list(plan.copy), manifest.origin)
            copy.tell(force=True)
            _write_manifest(tmp_fd, manifest, group)
            os.fsync(tmp_fd)
            for _ in range(INSTALL_TRIES):
                now = _lstat(target)
                if now is not None and now.st_uid != os.geteuid():
                    _move_aside(target, now)  # created by another user while we copied
                    continue
                if now is None:
                    if _rename_new(tmp, target):
                        break
                    continue
                old = target.parent / f".{target.name}.old-{_token()}"
                # One step: model_path is never missing; `tmp` then holds the old copy.
                exchanged = exchange(tmp, target)
                if not exchanged:
                    os.rename(target, old)
                    _second_rename(tmp, target, old)
                break
            else:
                raise StageError(
                    StageFailureKind.IO_ERROR,
                    f"{target} ([sglang] model_path) was re-created by another user "
                    f"{INSTALL_TRIES} times while the stage put its copy there",
                    f"find who writes {target} (ls -la {target.parent}), stop them, then "
                    "`farmctl start all`",
                )
        except OSError as exc:
            _drop_temp(tmp, tmp_fd)
            if exc.errno == errno.ENOSPC:
                facts = measure(target.parent)
                raise StageError(
                    StageFailureKind.NO_SPACE,
                    f"{facts.mount_point} ({facts.fstype}) ran out of space while staging "
                    f"{manifest.origin} into {target} after {gib(copy.done)}",
                    "free space there or grow it (a tmpfs: mount -o remount,size=...), "
                    "then `farmctl start all`",
                ) from exc
            raise StageError(
                StageFailureKind.IO_ERROR,
                f"staging {manifest.origin} into {target} failed: {exc.strerror or exc} "
                f"({exc.filename})",
                "fix the cause (permissions, the disk), then `farmctl start all`",
            ) from exc
        except BaseException:
            _drop_temp(tmp, tmp_fd)
            raise
        assert tmp is not None
        try:
            # The new copy is at model_path: the stage is done, whatever fails from here on.
            if exchanged and old is not None:
                try:
                    os.rename(tmp, old)
                except OSError as exc:
                    log.warning("model_old_copy_not_renamed", path=str(tmp), error=str(exc))
                    old = tmp  # removed from there (or by the next stage, as a leftover)
            # Its mtime now says when the copy took over (staging/installed.py): a worker
            # whose process started before that loads the previous copy. `tmp_fd` is the
            # new copy's folder, wherever it now is.
            with contextlib.suppress(OSError):
                os.utime(MANIFEST_NAME, dir_fd=tmp_fd, follow_symlinks=False)
        finally:
            os.close(tmp_fd)
        try:
            fsync_dir(target.parent)
        except OSError as exc:
            log.warning("model_stage_fsync_failed", path=str(target.parent), error=str(exc))
        if old is not None and not keep_old:
            try:
                remove_old(old)
            except OSError as exc:
                # The next stage removes it as a leftover, or fails saying why it cannot.
                log.warning("model_old_copy_not_removed", path=str(old), error=str(exc))
            old = None
        return StageResult(
            target,
            len(plan.copy),
            copy.done,
            manifest.total_bytes,
            False,
            old,
            clock() - t0,
            manifest.origin,
        )


def _drop_temp(tmp: Path | None, tmp_fd: int) -> None:
    """A failed stage's temporary goes (a failure to remove it is logged: the next stage
    removes it as a leftover, or fails saying why it cannot)."""
    if tmp_fd >= 0:
        os.close(tmp_fd)
    if tmp is None:
        return
    try:
        remove_old(tmp)
    except OSError as exc:
        log.warning("model_stage_temp_not_removed", path=str(tmp), error=str(exc))


def _second_rename(tmp: Path, target: Path, old: Path) -> None:
    """The fallback's second rename; on failure the old copy goes back to model_path."""
    try:
        os.rename(tmp, target)
    except OSError as exc:
        try:
            os.rename(old, target)
        except OSError as back:
            raise StageError(
                StageFailureKind.IO_ERROR,
                f"{target} ([sglang] model_path) is missing: the new copy could not be put "
                f"there ({exc.strerror or exc}) nor the previous one back "
                f"({back.strerror or back}); the previous copy is {old}",
                f"move it back (mv {old} {target}) before any worker starts, then fix the "
                "cause and `farmctl start all`",
            ) from exc
        raise


def remove_old(old: Path) -> None:
    """Remove a previous copy (or a leftover) of the agent's, never following a link in
    it: shutil.rmtree works through folder descriptors where the platform allows
    (`avoids_symlink_attacks`, Linux), which the agent needs. Raises OSError."""
    if not shutil.rmtree.avoids_symlink_attacks:
        raise OSError(errno.ENOTSUP, "this platform's rmtree would follow links", str(old))
    st = _lstat(old)
    if st is None:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(old)
    else:
        os.unlink(old)
