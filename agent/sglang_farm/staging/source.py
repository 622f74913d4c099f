"""I/O: a model source as the stage reads it (`SourceTree`), and a local source
directory's manifest: every file's size and change stamp, with the sha256 its
`SHA256SUMS` (if any) vouches for.

No symbolic link inside a source is followed: the agent reads as root, and a link in a
folder another user writes (`tokenizer.json -> /etc/shadow`) would copy a root-only file
into model_path for every worker to read (issue 22). A link is refused, naming it, with
one exception made explicit: a Hugging Face cache snapshot (`<repo>/snapshots/<rev>/`)
is made of links into its repo's `blobs/`; such a link is read through the blob it
resolves to, checked to be a regular file directly in that `blobs/` folder. Files are
opened one folder at a time with O_NOFOLLOW, so a link swapped in after the walk is
refused too, never followed.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from sglang_farm.staging.failure import StageError, StageFailureKind
from sglang_farm.staging.manifest import (
    MANIFEST_NAME,
    SUMS_NAME,
    FileEntry,
    Manifest,
    digest_from_blob_name,
    parse_sha256sums,
    with_digests,
)

_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO planted in a source must not hang the open (no effect on a file).
_OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


@dataclass(frozen=True, slots=True)
class SourceFile:
    rel: str  # relative, '/'-separated
    stat: os.stat_result  # of the file itself (a snapshot link: of its blob)
    blob: str | None = None  # a Hub cache snapshot's link: the blob's name (its digest)


def _scan(root: Path) -> Iterator[tuple[str, os.DirEntry[str]]]:
    """Every entry under `root` that is not a real folder (links, files, anything else),
    with its relative path; real folders are descended, links never."""
    stack = [""]
    while stack:
        rel_dir = stack.pop()
        with os.scandir(root / rel_dir if rel_dir else root) as it:
            for e in it:
                rel = f"{rel_dir}/{e.name}" if rel_dir else e.name
                if e.is_dir(follow_symlinks=False):
                    stack.append(rel)
                else:
                    yield rel, e


def walk_sizes(root: Path) -> dict[str, int]:
    """Every regular file under `root` (a staged copy: the agent's own) but the recorded
    manifest: relative path -> size. Links and anything else are not counted (and so not
    trusted as staged): the plan copies such a path anew."""
    return {
        rel: e.stat(follow_symlinks=False).st_size
        for rel, e in _scan(root)
        if rel != MANIFEST_NAME and e.is_file(follow_symlinks=False)
    }


def open_nofollow(base: Path, rel: str) -> int:
    """`base/rel` opened read-only, no component below `base` followed through a link;
    OSError (ELOOP, ENOTDIR) where one is a link."""
    *dirs, name = rel.split("/")
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for d in dirs:
            nfd = os.open(d, _OPEN_DIR, dir_fd=fd)
            os.close(fd)
            fd = nfd
        return os.open(name, _OPEN_FILE, dir_fd=fd)
    finally:
        os.close(fd)


@dataclass(frozen=True, slots=True)
class SourceTree:
    """A source folder as the stage reads it. `blobs`: where the folder is a Hugging Face
    cache snapshot, its repo's blob folder (the only place its links may lead)."""

    root: Path
    blobs: Path | None = None

    @classmethod
    def at(cls, root: Path) -> SourceTree:
        """The tree at `root`; a Hub cache snapshot (`<repo>/snapshots/<rev>` beside
        `<repo>/blobs`) is recognised by that layout."""
        blobs = root.parent.parent / "blobs"
        is_snapshot = root.parent.name == "snapshots" and blobs.is_dir()
        return cls(root, blobs if is_snapshot else None)

    def _refused_link(self, rel: str, text: str) -> StageError:
        link = self.root / rel
        if self.blobs is None:
            return StageError(
                StageFailureKind.BAD_SOURCE,
                f"{link} is a symbolic link (to {text}): a stage copies no link from a "
                "model source (it would copy whatever the link points at, as root)",
                f"replace the link with the file itself (cp --remove-destination "
                f"{os.path.realpath(link)} {link}) or remove it, then `farmctl start all`",
            )
        return StageError(
            StageFailureKind.BAD_SOURCE,
            f"{link} is a symbolic link to {text}, which is not a file in its Hub cache "
            f"repo's blobs ({self.blobs}): the cache was changed by hand",
            f"remove the repo from the cache (rm -rf {self.blobs.parent}); the next "
            "`farmctl start all` downloads it again",
        )

    def _blob(self, rel: str) -> Path:
        """The blob a snapshot link leads to. Raises StageError (BAD_SOURCE) unless it is
        a regular file directly in this repo's blobs."""
        link = self.root / rel
        text = os.readlink(link)
        if self.blobs is None:
            raise self._refused_link(rel, text)
        real = Path(os.path.realpath(link))
        if real.parent != Path(os.path.realpath(self.blobs)):
            raise self._refused_link(rel, text)
        try:
            st = os.lstat(real)
        except FileNotFoundError:
            raise self._refused_link(rel, text) from None
        if not stat.S_ISREG(st.st_mode):
            raise self._refused_link(rel, text)
        return real

    def files(self) -> Iterator[SourceFile]:
        """Every file of the source but a recorded manifest. Raises StageError
        (BAD_SOURCE) at the first link that is not a snapshot's link to its blob, or the
        first entry that is not a regular file."""
        for rel, e in _scan(self.root):
            if rel == MANIFEST_NAME:
                continue
            if e.is_symlink():
                blob = self._blob(rel)
                yield SourceFile(rel, os.lstat(blob), blob.name)
            elif e.is_file(follow_symlinks=False):
                yield SourceFile(rel, e.stat(follow_symlinks=False))
            else:
                raise StageError(
                    StageFailureKind.BAD_SOURCE,
                    f"{self.root / rel} in the model source is not a regular file "
                    f"(mode {e.stat(follow_symlinks=False).st_mode:o})",
                    "remove it from the source, then `farmctl start all`",
                )

    def open(self, rel: str) -> int:
        """`rel` opened read-only, never through a link but a snapshot's into its blobs.
        Raises StageError: SOURCE_MISSING when it vanished, BAD_SOURCE when a link or
        something other than a regular file took its place."""
        path = self.root / rel
        try:
            try:
                fd = open_nofollow(self.root, rel)
            except OSError as exc:
                if exc.errno != errno.ELOOP or self.blobs is None:
                    raise
                blob = self._blob(rel)
                fd = open_nofollow(blob.parent, blob.name)
        except FileNotFoundError as exc:
            raise StageError(
                StageFailureKind.SOURCE_MISSING,
                f"{rel} vanished from the model source {self.root} while staging",
                "restore the source (or wait for whatever changes it), then "
                "`farmctl start all` stages again",
            ) from exc
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise StageError(
                    StageFailureKind.BAD_SOURCE,
                    f"{path}: it, or a folder on its way, became a symbolic link while "
                    "staging; a stage follows no link in a model source",
                    "replace the link with the file itself, then `farmctl start all`",
                ) from exc
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise StageError(
                StageFailureKind.BAD_SOURCE,
                f"{path} in the model source is not a regular file",
                "remove it from the source, then `farmctl start all`",
            )
        return fd

    def real_path(self, rel: str) -> Path:
        """Where `rel`'s bytes are (a snapshot link's blob), for messages."""
        path = self.root / rel
        return Path(os.path.realpath(path)) if self.blobs is not None else path


def local_manifest(root: Path) -> Manifest:
    """The manifest of a source directory. Raises StageError (SOURCE_MISSING, BAD_SOURCE)."""
    fix_missing = "mount or restore the source, or correct [model] source in the config"
    if not root.is_dir():
        what = "does not exist" if not root.exists() else "is not a directory"
        raise StageError(
            StageFailureKind.SOURCE_MISSING,
            f"the model source {root} {what}",
            fix_missing,
        )
    tree = SourceTree.at(root)
    try:
        entries = {}
        for f in tree.files():
            sha256, git_sha1 = digest_from_blob_name(f.blob) if f.blob else (None, None)
            entries[f.rel] = FileEntry(
                f.rel,
                f.stat.st_size,
                mtime_ns=f.stat.st_mtime_ns,
                sha256=sha256,
                git_sha1=git_sha1,
            )
    except OSError as exc:
        raise StageError(
            StageFailureKind.SOURCE_MISSING,
            f"cannot read the model source {root}: {exc.strerror or exc} ({exc.filename})",
            fix_missing,
        ) from exc
    if not entries:
        raise StageError(
            StageFailureKind.BAD_SOURCE,
            f"the model source {root} is empty",
            "copy the model there, or correct [model] source in the config",
        )
    sums: dict[str, str] = {}
    if SUMS_NAME in entries:
        try:
            fd = tree.open(SUMS_NAME)
            with os.fdopen(fd, "rb") as sums_file:
                sums = parse_sha256sums(sums_file.read().decode())
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            raise StageError(
                StageFailureKind.BAD_SOURCE,
                f"{root / SUMS_NAME}: {exc}",
                f"regenerate it (cd {root} && sha256sum <files> > {SUMS_NAME}) or remove it",
            ) from exc
        listed_missing = sorted(set(sums) - set(entries))
        if listed_missing:
            raise StageError(
                StageFailureKind.SOURCE_MISSING,
                f"{root / SUMS_NAME} lists {len(listed_missing)} file(s) the source lacks: "
                + ", ".join(listed_missing[:5]),
                "restore them, or regenerate SHA256SUMS",
            )
    return Manifest(str(root), with_digests(entries, sums))
