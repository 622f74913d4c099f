"""I/O: a local source directory's manifest: every file's size and change stamp, with the
sha256 its `SHA256SUMS` (if any) vouches for."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from sglang_farm.staging.failure import StageError, StageFailureKind
from sglang_farm.staging.manifest import (
    MANIFEST_NAME,
    SUMS_NAME,
    FileEntry,
    Manifest,
    parse_sha256sums,
    with_digests,
)


def _walk(root: Path) -> Iterator[tuple[str, os.stat_result]]:
    """Every regular file under `root` (symlinks followed) but a recorded manifest:
    its relative path and stat."""
    for dirpath, _dirs, files in os.walk(root, followlinks=True):
        for name in files:
            full = Path(dirpath) / name
            rel = full.relative_to(root).as_posix()
            if rel != MANIFEST_NAME:
                yield rel, full.stat()


def walk_sizes(root: Path) -> dict[str, int]:
    """Every regular file under `root` (symlinks followed): relative path -> size."""
    return {rel: st.st_size for rel, st in _walk(root)}


def local_manifest(root: Path) -> Manifest:
    """The manifest of a source directory. Raises StageError (SOURCE_MISSING, BAD_SOURCE)."""
    fix_missing = (
        "mount or restore the source, or correct [model] source in the config"
    )
    if not root.is_dir():
        what = "does not exist" if not root.exists() else "is not a directory"
        raise StageError(
            StageFailureKind.SOURCE_MISSING,
            f"the model source {root} {what}",
            fix_missing,
        )
    try:
        entries = {
            rel: FileEntry(rel, st.st_size, mtime_ns=st.st_mtime_ns) for rel, st in _walk(root)
        }
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
            sums = parse_sha256sums((root / SUMS_NAME).read_text())
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
