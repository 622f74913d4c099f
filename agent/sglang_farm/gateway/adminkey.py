"""I/O: the managed gateway's admin key, generated at first start when the config names none.

A managed gateway always has an admin key (smg's `--control-plane-api-keys`): without
one, smg leaves its worker API open (`POST /workers`, `DELETE /workers/{id}`) to every
local user, who could route the farm's users to a backend of their own or take the
farm's workers out (docs/gateway.md, "Who may change the members"). When `[gateway]
admin_key_file` is not set, the agent makes one: `gateway-admin.key` in the state
directory, root-only. Both runtimes read that same file: the process runtime's
launcher (`gateway.launch --admin-key-file`) and, under systemd, the gateway unit's
`LoadCredential=` (`runtime.units`).

The file is trusted only if this agent's user made it: created with O_EXCL|O_NOFOLLOW
(never through a planted link, never into a planted file), and when reused it must be
a regular file (not a link) owned by the agent's user, not readable or writable by
anyone else, holding one key. Anything else is refused with what to do, never
"repaired": a file someone else could have read or written is a key they may know.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path

from sglang_farm.errors import ConfigError

_KEY_BYTES = 32  # token_urlsafe(32): 43 characters, 256 bits
_MAX_READ = 4096


def ensure_admin_key(path: Path) -> str:
    """The key in `path`, made there first (0600, O_EXCL|O_NOFOLLOW) if there is none.

    Raises ConfigError (naming the file and what to do) when `path` exists but is not
    a regular file of this process's user that no one else may read or write, or does
    not hold one key; or when it cannot be made.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return _reuse(path)
    except OSError as exc:
        raise _refused(path, f"cannot create it: {exc.strerror or exc}") from exc
    key = secrets.token_urlsafe(_KEY_BYTES)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask made of it
        os.write(fd, (key + "\n").encode())
        os.fsync(fd)
    except OSError as exc:
        os.close(fd)
        os.unlink(path)
        raise _refused(path, f"cannot write it: {exc.strerror or exc}") from exc
    os.close(fd)
    return key


def rotate_admin_key(path: Path) -> str:
    """Replace the generated key in `path` by a new one, and return it (issue 30: a key
    that may have reached another process). Written to a new file beside it (0600,
    O_EXCL|O_NOFOLLOW) and renamed over it, so a reader sees the old key or the new one,
    never half of one. The old file must be one `ensure_admin_key` would reuse.

    Raises ConfigError as `ensure_admin_key` does.
    """
    _reuse(path)  # the same trust rules: never replace a file the agent did not make
    tmp = path.with_name(f".{path.name}.{os.getpid()}.new")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise _refused(path, f"cannot create {tmp}: {exc.strerror or exc}") from exc
    key = secrets.token_urlsafe(_KEY_BYTES)
    try:
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, (key + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise _refused(path, f"cannot write the new key: {exc.strerror or exc}") from exc
    return key


def _reuse(path: Path) -> str:
    """The key of an existing file, once it is shown to be this user's and private."""
    try:
        # O_NOFOLLOW: a symlink fails here (ELOOP) instead of being read through.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise _refused(
            path, f"cannot open it without following links: {exc.strerror or exc}", remove=True
        ) from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refused(path, "it is not a regular file", remove=True)
        if st.st_uid != os.geteuid():
            raise _refused(
                path,
                f"it is owned by uid {st.st_uid}, not by the agent's user (uid {os.geteuid()})",
                remove=True,
            )
        if st.st_mode & 0o077:
            raise _refused(
                path,
                f"its mode is {stat.S_IMODE(st.st_mode):04o}: others may "
                "read or write it (expected 0600)",
                remove=True,
            )
        text = os.read(fd, _MAX_READ).decode("utf-8", "replace").strip()
    finally:
        os.close(fd)
    if not text or any(c.isspace() for c in text):
        raise _refused(path, "it does not hold one key without blanks", remove=True)
    return text


def _refused(path: Path, why: str, *, remove: bool = False) -> ConfigError:
    fix = (
        f"remove it (the agent makes a new one at its next start) and check who could write "
        f"to {path.parent}"
        if remove
        else f"check {path.parent} (the [farm] state_dir) is the agent's and writable by it"
    )
    return ConfigError(
        str(path),
        [
            f"{path}: the managed gateway's admin key (generated because [gateway] "
            f"admin_key_file is not set): {why}; {fix}, or set [gateway] admin_key_file to a "
            "root-only key file"
        ],
    )
