"""I/O: the unit files and the workers' secret files on disk.

`write_units` and `write_secrets` make a folder hold what `units.render` and
`unit_secrets.render_secrets` rendered: atomic writes, identical files left alone, our
stale files (they carry `HEADER_PREFIX`, or a secret file's name) removed. Nothing else
in the farm writes a unit file.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from sglang_farm.host.atomicfile import fsync_dir, write_atomic
from sglang_farm.host.paths import DEFAULT_AGENT_BIN, DEFAULT_CONFIG_PATH
from sglang_farm.runtime.unit_syntax import HEADER_PREFIX
from sglang_farm.runtime.units import GENERATED_UNITS, render
from sglang_farm.sglang.argv import Command
from sglang_farm.spec import FarmSpec


@dataclass(frozen=True, slots=True)
class UnitChanges:
    """What `write_units` did, as paths relative to the root, each sorted."""

    written: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    unchanged: tuple[str, ...] = ()

    @property
    def changed(self) -> bool:
        """True when systemd must re-read its units (`daemon-reload`)."""
        return bool(self.written or self.removed)


def _check_relative(path: PurePosixPath) -> None:
    if path.is_absolute() or ".." in path.parts or not path.parts:
        raise ValueError(
            f"unit path {str(path)!r} must be relative and stay inside the unit directory"
        )


def _make_dirs(root: Path, rel: PurePosixPath) -> None:
    """Create `root/rel` folder by folder, each 0755 whatever the umask (systemctl cat)."""
    current = root
    for part in rel.parts:
        current = current / part
        if not current.is_dir():
            current.mkdir()
            os.chmod(current, 0o755)


def _is_ours(path: Path) -> bool:
    """True when the file's first line is our generated-file header."""
    try:
        with path.open("rb") as fh:
            head = fh.read(len(HEADER_PREFIX))
    except OSError:
        return False
    return head == HEADER_PREFIX.encode()


def write_units(
    root: Path, files: Mapping[PurePosixPath, str], *, manage_prefix: str = "sglang"
) -> UnitChanges:
    """Make `root` hold `files`, touching only what differs.

    Each file that differs is written atomically (temp file in the same
    directory, fsync, `os.replace`, mode 0644); identical files are left alone.
    Drop-ins under `<manage_prefix>*.d/` that carry our header but are not in
    `files` (workers no longer configured) are removed, and so are the `.d`
    folders this leaves empty; so is a whole generated unit (`GENERATED_UNITS`,
    e.g. the gateway's once [gateway] is off). Files without our header are never
    removed.
    Raises ValueError for a path outside `root`, OSError when writing fails
    (files already written stay written: each is whole, old or new).
    """
    written: list[str] = []
    unchanged: list[str] = []
    removed: list[str] = []
    wanted = {str(p) for p in files}
    root.mkdir(parents=True, exist_ok=True)
    for rel, text in sorted(files.items()):
        _check_relative(rel)
        target = root.joinpath(*rel.parts)
        data = text.encode("utf-8")
        _make_dirs(root, rel.parent)
        if target.is_file() and not target.is_symlink() and target.read_bytes() == data:
            unchanged.append(str(rel))
            continue
        write_atomic(target, data)  # 0644: `systemctl cat` as any user
        written.append(str(rel))
    stale_units = [
        root / name
        for name in GENERATED_UNITS
        if name.startswith(manage_prefix) and name not in wanted
    ]
    for entry in stale_units:
        if entry.is_file() and not entry.is_symlink() and _is_ours(entry):
            entry.unlink()
            removed.append(entry.name)
            fsync_dir(root)
    if root.is_dir():
        for folder in sorted(root.glob(f"{manage_prefix}*.d")):
            if folder.is_symlink() or not folder.is_dir():
                continue
            removed_here = False
            for entry in sorted(folder.iterdir()):
                rel_name = f"{folder.name}/{entry.name}"
                if rel_name in wanted or entry.suffix != ".conf" or entry.is_symlink():
                    continue
                if entry.is_file() and _is_ours(entry):
                    entry.unlink()
                    removed.append(rel_name)
                    removed_here = True
            if removed_here:
                if any(folder.iterdir()):
                    fsync_dir(folder)
                else:
                    folder.rmdir()
                    fsync_dir(root)
    return UnitChanges(
        written=tuple(sorted(written)),
        removed=tuple(sorted(removed)),
        unchanged=tuple(sorted(unchanged)),
    )


def _secret_name(name: str) -> bool:
    return name.startswith("sglang@") and name.endswith((".env", ".api-key"))


def secrets_changed_workers(changes: UnitChanges, existed: Collection[str]) -> frozenset[int]:
    """Pure: the workers whose secret files were replaced or removed (a file that did not
    exist before is no change: an upgrade from units that held no secret files must not
    restart every worker)."""
    names = [n for n in changes.written if n in existed] + list(changes.removed)
    found = (re.fullmatch(r"[^@]*@(\d+)\.(?:env|api-key)", n) for n in names)
    return frozenset(int(m.group(1)) for m in found if m is not None)


def write_secrets(folder: Path, files: Mapping[str, bytes]) -> UnitChanges:
    """Make `folder` (mode 0700) hold exactly `files` (each 0600): write what differs
    atomically, remove our stale ones (`sglang@N.env`, `sglang@N.api-key`).

    Written before the drop-ins that name them. Raises ValueError for a name with a
    slash, OSError when the folder cannot be written.
    """
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)  # whatever made it before
    written: list[str] = []
    unchanged: list[str] = []
    removed: list[str] = []
    for name, data in sorted(files.items()):
        if "/" in name or not _secret_name(name):
            raise ValueError(f"secret file name {name!r} is not one of ours")
        target = folder / name
        if target.is_file() and not target.is_symlink() and target.read_bytes() == data:
            os.chmod(target, 0o600)
            unchanged.append(name)
            continue
        write_atomic(target, data, mode=0o600)
        written.append(name)
    for entry in sorted(folder.iterdir()):
        if _secret_name(entry.name) and entry.name not in files and not entry.is_dir():
            entry.unlink()
            removed.append(entry.name)
    if removed:
        fsync_dir(folder)
    return UnitChanges(written=tuple(written), removed=tuple(removed), unchanged=tuple(unchanged))


def render_to_dir(
    spec: FarmSpec,
    out: Path,
    *,
    agent_bin: str = DEFAULT_AGENT_BIN,
    config_path: str = DEFAULT_CONFIG_PATH,
    commands: Mapping[int, Command] | None = None,
    static: bool = True,
    python: str | None = None,
) -> UnitChanges:
    """`sglang-farm render --out DIR`: render the farm's units and write them under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    files = render(
        spec,
        agent_bin=agent_bin,
        config_path=config_path,
        commands=commands,
        static=static,
        python=python,
    )
    return write_units(out, files)
