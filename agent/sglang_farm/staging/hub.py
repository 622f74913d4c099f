"""I/O: a model from the Hugging Face Hub, with the library made for it.

`huggingface_hub.snapshot_download` into a persistent cache (`[model] cache_dir`): it
keeps its own per-file locks, skips files already in the cache, and resumes an
interrupted transfer with an HTTP Range request. The token comes from a root-only file
(`[model] token_file`), never the config or a command line. The endpoint is the
library's (`HF_ENDPOINT` in the agent's environment; tests point it at a local stand-in).

The snapshot's manifest comes from the cache itself: the Hub names an LFS file's blob by
its sha256 (its etag) and a small file's by its git blob id, so every copied file is
verified against what the Hub vouches for. A snapshot's files are links into the repo's
`blobs/`; only such links are read (source.SourceTree), never one leading elsewhere.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sglang_farm.staging.dirs import trusted_dir
from sglang_farm.staging.failure import StageError, StageFailureKind
from sglang_farm.staging.manifest import FileEntry, Manifest, digest_from_blob_name
from sglang_farm.staging.source import SourceTree

HUB_FIX = (
    "check [model] source (the repo id) and revision, the token file for a private or "
    "gated repo, and that this host reaches the Hub (HF_ENDPOINT for a mirror); then "
    "`farmctl start all`"
)


def read_token(path: str) -> str:
    """The token in `path`, refused unless only its owner (the agent's user) can read it."""
    fix = f"write the token alone into {path}, owned by root, mode 0600 (chmod 600 {path})"
    try:
        st = os.stat(path)
        text = Path(path).read_text().strip()
    except OSError as exc:
        raise StageError(
            StageFailureKind.CREDENTIALS,
            f"[model] token_file {path}: cannot read it: {exc.strerror or exc}",
            fix,
        ) from exc
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise StageError(
            StageFailureKind.CREDENTIALS,
            f"[model] token_file {path} is readable by others (mode {stat.S_IMODE(st.st_mode):o})",
            fix,
        )
    if st.st_uid != os.geteuid():
        raise StageError(
            StageFailureKind.CREDENTIALS,
            f"[model] token_file {path} is owned by uid {st.st_uid}, not by the agent's user "
            f"(uid {os.geteuid()})",
            fix,
        )
    if not text or any(c.isspace() for c in text):
        raise StageError(
            StageFailureKind.CREDENTIALS, f"[model] token_file {path} must hold one token", fix
        )
    return text


def _cancelled(where: str) -> StageError:
    return StageError(
        StageFailureKind.CANCELLED,
        f"Hub download of {where} cancelled",
        "the agent is stopping; the next start resumes the download from the cache",
    )


def _progress_class(report: Callable[[int, int], None], cancel: threading.Event, where: str) -> Any:
    """A tqdm class that reports the snapshot's byte bars to `report` and prints nothing;
    raises StageError(CANCELLED) from the download's next chunk once `cancel` is set."""
    import importlib
    import io

    tqdm_module = importlib.import_module("huggingface_hub.utils.tqdm")

    base: Any = tqdm_module.tqdm  # the library's own bar class (it honours its env knobs)

    class Reporter(base):  # type: ignore[misc]  # subclassing an Any: tqdm's __init__ is untyped
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["file"] = io.StringIO()
            kwargs["disable"] = False
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            if cancel.is_set():
                raise _cancelled(where)
            shown: bool | None = super().update(n)
            if self.unit == "B" and self.total:
                report(int(self.n), int(self.total))
            return shown

    return Reporter


def download(
    repo_id: str,
    revision: str | None,
    cache_dir: Path,
    *,
    token_file: str | None = None,
    endpoint: str | None = None,
    report: Callable[[int, int], None] = lambda _done, _total: None,
    cancel: threading.Event | None = None,
) -> Path:
    """The snapshot folder of `repo_id` at `revision` in `cache_dir`. Raises StageError."""
    # The library keeps its other state (the Xet chunk cache, update checks) under HF_HOME,
    # ~/.cache/huggingface by default: read-only for the agent's unit (ProtectHome=).
    # Beside the download cache instead, unless the operator chose; read at first import.
    os.environ.setdefault("HF_HOME", str(cache_dir / ".hf-home"))
    import httpx2
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    token: str | bool = read_token(token_file) if token_file else False
    where = f"{repo_id}@{revision or 'main'}"
    cancel = cancel or threading.Event()
    if cancel.is_set():
        raise _cancelled(where)
    # Another user who can write the cache could plant a snapshot of its own files. A new
    # cache is the agent's alone (0700): it holds gated weights, which only the copy at
    # model_path hands on, to the workers' group (issue 30, item 8; the library writes
    # under the agent's umask, 0022 from a root shell).
    trusted_dir(cache_dir, "[model] cache_dir", mode=0o700)
    try:
        folder = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache_dir,
            token=token,
            endpoint=endpoint,
            tqdm_class=_progress_class(report, cancel, where),
        )
    except (HfHubHTTPError, LocalEntryNotFoundError, httpx2.HTTPError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise StageError(
            StageFailureKind.HUB_ERROR, f"Hub download of {where} failed: {first}", HUB_FIX
        ) from exc
    except ValueError as exc:  # HFValidationError: a repo id or revision the library refuses
        raise StageError(
            StageFailureKind.HUB_ERROR,
            f"Hub download of {where} refused: {type(exc).__name__}: {exc}",
            HUB_FIX,
        ) from exc
    except OSError as exc:
        raise StageError(
            StageFailureKind.IO_ERROR,
            f"Hub download of {where} into {cache_dir} failed: {exc.strerror or exc}",
            f"check {cache_dir} ([model] cache_dir): its space and permissions",
        ) from exc
    return Path(folder)


def snapshot_manifest(folder: Path, origin: str) -> Manifest:
    """Each file of a snapshot with the digest its cache blob's name vouches for.

    The snapshot's links are read only where they lead to a file directly in the repo's
    `blobs/` (source.SourceTree); any other link (the cache changed by hand) raises
    StageError (BAD_SOURCE)."""
    tree = SourceTree(folder, folder.parent.parent / "blobs")
    entries: list[FileEntry] = []
    for f in tree.files():
        sha256, git_sha1 = digest_from_blob_name(f.blob) if f.blob else (None, None)
        entries.append(FileEntry(f.rel, f.stat.st_size, sha256=sha256, git_sha1=git_sha1))
    if not entries:
        raise StageError(
            StageFailureKind.HUB_ERROR, f"the Hub snapshot {origin} holds no files", HUB_FIX
        )
    return Manifest(origin, tuple(sorted(entries, key=lambda e: e.path)))
