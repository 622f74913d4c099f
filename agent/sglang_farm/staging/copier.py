"""I/O: make a target directory hold exactly a source's files, never half-copied.

Under the target's stage lock: stale temporaries of a killed stage are removed; the plan
(`plan.plan_stage`) says what to copy; the free space is checked first (`plan.space_problem`);
the files are copied into a temporary sibling (`.<name>.staging-<pid>`, same filesystem),
unchanged ones hard-linked from the current copy; each copied file's size is checked and
its bytes hashed as they stream (sha256, or the git blob id of a Hub small file) against
the digest the source vouches for; the manifest is recorded inside; then the sibling is
renamed into place, the previous copy swapped out in the same step, renamed aside
(`.<name>.old-…`) and removed now, or by the caller once no worker uses it (a reload's
rolling restart).

A worker only ever sees the old copy or the new one: a kill at any point leaves the
target as it was, and the next stage removes the temporary and starts over.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import shutil
import stat
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

import structlog

from sglang_farm.atomicfile import fsync_dir
from sglang_farm.staging.dirs import make_dirs
from sglang_farm.staging.failure import StageError, StageFailureKind
from sglang_farm.staging.lock import stage_lock
from sglang_farm.staging.manifest import MANIFEST_NAME, FileEntry, Manifest, manifest_from_json
from sglang_farm.staging.plan import MountFacts, gib, plan_stage, space_problem
from sglang_farm.staging.progress import StageProgress
from sglang_farm.staging.source import walk_sizes
from sglang_farm.staging.space import mount_facts

log = structlog.get_logger("sglang_farm.staging")

CHUNK = 8 << 20  # bytes per read: large enough for the page cache's read-ahead
# The workers run as [farm] user, the agent as root under UMask=0077: the copy's modes are
# set explicitly, whatever the umask, so that the workers can read it.
FILE_MODE = 0o644
REPORT_EVERY_S = 0.25  # progress reports at most this often (they rebuild the farm view)
# Files copied at once: hashing is the bottleneck of one stream (0.72 GiB/s against 1.1-1.4
# for `cp -r`, 16 GiB into a tmpfs on the H200 host: docs/staging.md); hashlib, read and
# write release the GIL, so a few streams use a few cores.
COPY_STREAMS = 4

Report = Callable[[StageProgress], None]


@dataclass(frozen=True, slots=True)
class StageResult:
    target: Path
    copied_files: int
    copied_bytes: int
    total_bytes: int
    current: bool  # the staged copy was already exactly the source: nothing was done
    old_copy: Path | None  # the previous copy, renamed aside, still to be removed
    seconds: float
    origin: str = ""


def temp_sibling(target: Path) -> Path:
    return target.parent / f".{target.name}.staging-{os.getpid()}"


def _leftovers(target: Path) -> list[Path]:
    """Temporaries of stages that were killed, and old copies a reload left behind."""
    parent = target.parent
    if not parent.is_dir():
        return []
    prefixes = (f".{target.name}.staging-", f".{target.name}.old-")
    return [p for p in parent.iterdir() if p.name.startswith(prefixes)]


def _recorded(target: Path) -> Manifest | None:
    """The manifest the copy at `target` recorded; trusted only when the copy and the
    manifest are the agent's own (not links): /dev/shm is writable by every local user, who
    could plant a folder with a matching manifest over files of their choosing."""
    me = os.geteuid()
    try:
        for p in (target, target / MANIFEST_NAME):
            st = os.lstat(p)
            if st.st_uid != me or stat.S_ISLNK(st.st_mode):
                return None
        return manifest_from_json((target / MANIFEST_NAME).read_text())
    except (OSError, UnicodeDecodeError):
        return None


def _foreign_owner(target: Path) -> int | None:
    """The uid owning `target` when it is not the agent's (None: ours, or absent)."""
    try:
        uid = os.lstat(target).st_uid
    except OSError:
        return None
    return None if uid == os.geteuid() else uid


class _Copy:
    """One stage's byte copying: progress, cancellation, verification."""

    def __init__(
        self, total: int, report: Report, cancel: threading.Event, clock: Callable[[], float]
    ) -> None:
        self.total = total
        self.done = 0
        self.report = report
        self.cancel = cancel
        self.clock = clock
        self.started = clock()
        self.last = 0.0
        self.lock = threading.Lock()  # `done` and `last`: several files stream at once
        self.abort = threading.Event()  # another file's copy failed: stop the rest

    def copy_all(self, files: list[tuple[Path, Path, FileEntry]], origin: str) -> None:
        """Every file, COPY_STREAMS at a time; the first failure stops the others and is
        the one raised."""
        with ThreadPoolExecutor(max_workers=max(1, min(COPY_STREAMS, len(files)))) as pool:
            futures = [pool.submit(self.file, s, d, e, origin) for s, d, e in files]
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

    def file(self, src: Path, dst: Path, entry: FileEntry, origin: str) -> None:
        sha = hashlib.sha256() if entry.sha256 else None
        # git's blob id of a Hub small file is a sha1 over "blob <size>\0" + content.
        git = hashlib.sha1(b"blob %d\0" % entry.size) if entry.git_sha1 else None
        make_dirs(dst.parent)
        n = 0
        try:
            with open(src, "rb") as fin, open(dst, "xb") as fout:
                os.fchmod(fout.fileno(), FILE_MODE)
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
        except FileNotFoundError as exc:
            if exc.filename == str(src):
                raise StageError(
                    StageFailureKind.SOURCE_MISSING,
                    f"{entry.path} vanished from the model source {origin} while staging",
                    "restore the source (or wait for whatever changes it), then "
                    "`farmctl start all` stages again",
                ) from exc
            raise
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
                blob = os.path.realpath(src)
                fix = (
                    f"the Hub cache's copy is corrupt: delete the blob (rm {blob}); the next "
                    "`farmctl start all` downloads it again"
                )
            else:
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


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (renameat2 RENAME_EXCHANGE: Linux 3.15, tmpfs and the
    common disk filesystems); False where the kernel or filesystem cannot, so the caller
    falls back to two renames."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):  # a libc without renameat2 (glibc < 2.28)
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                          ctypes.c_uint]
    rc = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a))


def stage_copy(
    root: Path,
    manifest: Manifest,
    target: Path,
    *,
    headroom: int,
    cancel: threading.Event,
    report: Report = lambda _p: None,
    measure: Callable[[Path], MountFacts] = mount_facts,
    keep_old: bool = False,
    on_wait: Callable[[str], None] = lambda _holder: None,
    clock: Callable[[], float] = time.monotonic,
) -> StageResult:
    """Make `target` hold exactly `manifest`'s files from `root`. Raises StageError."""
    t0 = clock()
    with stage_lock(target, cancel=cancel, on_wait=on_wait):
        for left in _leftovers(target):
            shutil.rmtree(left, ignore_errors=True)  # ours, under the lock: nobody writes there
        if target.exists() and not target.is_dir():
            raise StageError(
                StageFailureKind.IO_ERROR,
                f"{target} ([sglang] model_path) exists and is not a directory",
                f"remove it (rm {target}) or point model_path elsewhere",
            )
        present = walk_sizes(target) if target.is_dir() else {}
        recorded = _recorded(target)
        plan = plan_stage(manifest, recorded, present)
        if plan.current:
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
        tmp = temp_sibling(target)
        copy = _Copy(plan.copy_bytes, report, cancel, clock)
        try:
            make_dirs(tmp)
            for f in plan.keep:
                dst = tmp / f.path
                make_dirs(dst.parent)
                try:
                    os.link(target / f.path, dst)
                except OSError:
                    shutil.copy2(target / f.path, dst)  # a filesystem without hard links
            copy.tell(force=True)
            copy.copy_all([(root / f.path, tmp / f.path, f) for f in plan.copy], manifest.origin)
            copy.tell(force=True)
            (tmp / MANIFEST_NAME).write_text(manifest.to_json())
            os.chmod(tmp / MANIFEST_NAME, FILE_MODE)
            fsync_dir(tmp)
            old: Path | None = None
            exchanged = False
            if target.exists():
                old = target.parent / f".{target.name}.old-{os.getpid()}-{time.time_ns()}"
                # One step: model_path is never missing; `tmp` then holds the old copy.
                exchanged = exchange(tmp, target)
                if not exchanged:
                    os.rename(target, old)
                    _second_rename(tmp, target, old)
            else:
                os.rename(tmp, target)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if exc.errno == errno.ENOSPC:
                facts = measure(target.parent)
                raise StageError(
                    StageFailureKind.NO_SPACE,
                    f"{facts.mount_point} ({facts.fstype}) ran out of space while staging "
                    f"{manifest.origin} into {target} after {gib(copy.done)}",
                    "free space there or grow it (a tmpfs: mount -o remount,size=...), "
                    "then `farmctl start all`",
                ) from exc
            owner = _foreign_owner(target)
            if exc.errno in (errno.EPERM, errno.EACCES) and owner is not None:
                # A sticky folder (/dev/shm): another user's folder cannot be replaced.
                raise StageError(
                    StageFailureKind.IO_ERROR,
                    f"cannot replace {target} ([sglang] model_path): {target} is owned by "
                    f"uid {owner}, not by the agent (uid {os.geteuid()}), and its folder "
                    f"does not let the agent rename it ({exc.strerror or exc})",
                    f"check what it is, then remove it as root (rm -rf {target}) and "
                    "`farmctl start all`",
                ) from exc
            raise StageError(
                StageFailureKind.IO_ERROR,
                f"staging {manifest.origin} into {target} failed: {exc.strerror or exc} "
                f"({exc.filename})",
                "fix the cause (permissions, the disk), then `farmctl start all`",
            ) from exc
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        # The new copy is at model_path: the stage is done, whatever fails from here on.
        if exchanged and old is not None:
            try:
                os.rename(tmp, old)
            except OSError as exc:
                log.warning("model_old_copy_not_renamed", path=str(tmp), error=str(exc))
                old = tmp  # removed from there (or by the next stage, as a leftover)
        # Its mtime now says when the copy took over (staging/installed.py): a worker whose
        # process started before that loads the previous copy.
        with contextlib.suppress(OSError):
            os.utime(target / MANIFEST_NAME)
        try:
            fsync_dir(target.parent)
        except OSError as exc:
            log.warning("model_stage_fsync_failed", path=str(target.parent), error=str(exc))
        if old is not None and not keep_old:
            shutil.rmtree(old, ignore_errors=True)
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
    """Remove a previous copy once no worker is meant to load from it."""
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(old)
