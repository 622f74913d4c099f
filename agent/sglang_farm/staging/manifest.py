"""Pure: what a model copy holds: each file's relative path, size, and the digest its
source vouches for (sha256 from a SHA256SUMS file or the Hub's LFS etag; a git blob sha1
for the Hub's small files).

The staged copy records the manifest it was verified against in `MANIFEST_NAME` inside
the copy, so an unchanged source is recognised without reading the model again.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace

MANIFEST_NAME = ".sglang-farm-manifest.json"  # inside the staged copy
SUMS_NAME = "SHA256SUMS"  # a source directory's checksums, as `sha256sum` writes them

_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX40 = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True, slots=True)
class FileEntry:
    path: str  # relative, '/'-separated
    size: int
    # The source's own change stamp (local: st_mtime_ns); None where the digest says it all.
    mtime_ns: int | None = None
    sha256: str | None = None  # lower-case hex, what the copy must hash to
    git_sha1: str | None = None  # the Hub's blob id of a small (non-LFS) file

    @property
    def digest_text(self) -> str:
        if self.sha256:
            return f"sha256 {self.sha256}"
        if self.git_sha1:
            return f"git blob {self.git_sha1}"
        return "size only"


@dataclass(frozen=True, slots=True)
class Manifest:
    origin: str  # the source as configured (a directory, or "hub:org/name@commit")
    files: tuple[FileEntry, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def by_path(self) -> dict[str, FileEntry]:
        return {f.path: f for f in self.files}

    def to_json(self) -> str:
        return json.dumps(
            {"origin": self.origin, "files": [asdict(f) for f in self.files]}, indent=1
        )


def manifest_from_json(text: str) -> Manifest | None:
    """A recorded manifest; None for anything that is not one (a copy is then redone)."""
    try:
        raw = json.loads(text)
        files = tuple(_entry(f) for f in raw["files"])
        return Manifest(str(raw["origin"]), files)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _entry(f: object) -> FileEntry:
    """One recorded file; ValueError for anything else (a hand-edited or corrupt manifest)."""
    if not isinstance(f, dict):
        raise ValueError(f"a manifest entry is not an object: {f!r:.40}")
    sha256, git_sha1 = f.get("sha256"), f.get("git_sha1")
    if not all(d is None or isinstance(d, str) for d in (sha256, git_sha1)):
        raise ValueError("a manifest digest is not a string")
    return FileEntry(
        path=str(f["path"]),
        size=int(f["size"]),
        mtime_ns=None if f.get("mtime_ns") is None else int(f["mtime_ns"]),
        sha256=sha256,
        git_sha1=git_sha1,
    )


def parse_sha256sums(text: str) -> dict[str, str]:
    """`sha256sum`'s output (`<hex>  <path>` or `<hex> *<path>`): path -> lower-case hex.

    Raises ValueError naming the first line that is not such a line.
    """
    out: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        digest, sep, rest = line.partition(" ")
        digest = digest.lower()
        if not sep or not _HEX64.fullmatch(digest) or len(rest) < 2:
            raise ValueError(f"line {n} is not '<sha256>  <file>': {line[:80]!r}")
        path = rest[1:] if rest[0] in " *" else rest
        out[path.removeprefix("./")] = digest
    return out


def digest_from_blob_name(name: str) -> tuple[str | None, str | None]:
    """(sha256, git_sha1) from a Hub cache blob's file name: the Hub names an LFS file's
    blob by its sha256 and a small file's by its git blob id."""
    if _HEX64.fullmatch(name):
        return name, None
    if _HEX40.fullmatch(name):
        return None, name
    return None, None


def with_digests(
    entries: Mapping[str, FileEntry], sums: Mapping[str, str]
) -> tuple[FileEntry, ...]:
    """The entries in path order, each with its sha256 from `sums` where listed."""
    return tuple(replace(e, sha256=sums.get(p, e.sha256)) for p, e in sorted(entries.items()))
