"""I/O shell over a pure judge: whether a folder (or socket) the farm uses could be another user's.

The agent runs as root and keeps its state, logs and control socket in folders; under
the process runtime and the demo those live under `/tmp`, where anyone creates folders.
A state folder pre-created by `nobody` let it plant symlinks that root's logs followed
and swap in its own `control.sock` that root's farmctl then talked to (issue 22, item 11).

The rule (`folder_trust`, pure, shared with the staging's folders), after OpenSSH's
`secure_filename`: every folder on the way, from `/` to the farm's own, belongs to root
or the agent's user, and no other user may write it unless its sticky bit is set (as on
`/tmp`: others can add names, not replace ours). The farm's own folder (the state
folder, the socket's folder) may not be writable by any other user at all, sticky or
not: names the farm has yet to create there could be taken first. A symbolic link on
the way is followed only when one of those owners made it.

`folder_problem` is the agent's check (a refusal at start); `socket_problem` is
farmctl's (never talk to a socket another user could have put there).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import stat
from collections.abc import Iterable

from sglang_farm.host.folder_trust import Distrust, folder_distrust, link_distrust


def owner_name(uid: int) -> str:
    """`name (uid N)`, or `uid N` for a uid with no account."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


# --- pure ------------------------------------------------------------------------------


def judge(
    path: str,
    uid: int,
    mode: int,
    trusted: Iterable[int],
    *,
    own: bool,
    owner: str,
) -> str | None:
    """What is wrong with folder `path` (owner `uid`, `st_mode` `mode`), or None: the
    `folder_trust` rule in words.

    `own`: the farm's own folder (no other writer at all); else a folder on the way
    (others may write only under the sticky bit). `owner` names `uid` for the message.
    """
    distrust = folder_distrust(uid, mode, frozenset(trusted), own=own)
    if distrust is Distrust.OWNER:
        return f"{path} is owned by {owner}, not by root or the agent's user"
    if distrust is Distrust.OTHERS_WRITE:
        sticky = " (sticky bit or not)" if own and mode & stat.S_ISVTX else ""
        return (
            f"{path} (owner {owner}, mode {stat.S_IMODE(mode):04o}) can be written by other "
            f"users{sticky}"
        )
    return None


def _fix(path: str, what: str, key: str) -> str:
    return (
        f"{what} must be a folder only root (or the agent's user) can write: "
        f"chown root:root {path} && chmod 0755 {path}, or set {key} to such a folder"
    )


# --- I/O -------------------------------------------------------------------------------


def _trusted() -> frozenset[int]:
    return frozenset({0, os.geteuid()})


def _chain(path: str) -> list[str]:
    """`path`'s folders from `/` down to itself (absolute, not resolved)."""
    parts = os.path.abspath(path).split("/")[1:]
    return ["/"] + ["/" + "/".join(parts[: i + 1]) for i in range(len(parts)) if parts[i]]


def _links_problem(path: str, trusted: frozenset[int]) -> str | None:
    """A symbolic link on the way to `path` (itself included) that another user made."""
    for p in _chain(path)[1:]:
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode) and link_distrust(st.st_uid, trusted) is not None:
            return (
                f"{p} is a symbolic link made by {owner_name(st.st_uid)}, not by root or "
                "the agent's user"
            )
    return None


def _walk_problem(path: str, trusted: frozenset[int], *, own: bool) -> str | None:
    """The first problem on the way to folder `path`: links' makers, then each folder."""
    problem = _links_problem(path, trusted)
    if problem:
        return problem
    real = os.path.realpath(path)
    for p in _chain(real):
        st = os.stat(p)
        if not stat.S_ISDIR(st.st_mode):
            return f"{p} is not a folder"
        problem = judge(
            p,
            st.st_uid,
            st.st_mode,
            trusted,
            own=own and p == real,
            owner=owner_name(st.st_uid),
        )
        if problem:
            return problem
    return None


def make_folders(path: str) -> None:
    """Create `path` and its missing parents at 0755 (never wider, whatever the umask:
    `os.makedirs` makes the parents 0777 less the umask, group-writable under 002)."""
    for p in _chain(path)[1:]:
        with contextlib.suppress(FileExistsError):
            os.mkdir(p, 0o755)


def folder_problem(path: str, what: str, key: str) -> str | None:
    """Why the agent must not keep `what` (e.g. "the state folder") in `path`, or None.

    `key` is the config key that names it, for the fix. A missing folder has no problem
    here (the caller creates it, then asks again). The message says which folder, its
    owner and mode, and what to do.
    """
    try:
        problem = _walk_problem(path, _trusted(), own=True)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"{what} {path}: cannot look at it: {exc.strerror}; check the path ({key})"
    if problem is None:
        return None
    return f"refusing {what} {path}: {problem}; {_fix(path, what, key)}"


def way_problem(path: str) -> str | None:
    """The first problem on the way to the file at `path` that root is to trust (the
    eval set), itself not judged: a symbolic link on the way (`path` included) that
    another user made, or a folder of its real location that another user may write
    without the sticky bit. None for a sound way, or one that cannot be looked at
    (opening the file says so)."""
    trusted = _trusted()
    try:
        return _links_problem(path, trusted) or _walk_problem(
            os.path.dirname(os.path.realpath(path)), trusted, own=False
        )
    except OSError:
        return None


def config_problem(path: str) -> str | None:
    """Why the agent must not run from the config at `path`, or None.

    The config names the interpreter and module the agent runs as root, and the farm's
    files: it must be a regular file of root (or the agent's user) that no other user can
    write, reached through no other user's link, in folders no other user could swap it
    in (writable by others only under the sticky bit, as /tmp).
    """
    trusted = _trusted()
    try:
        problem = _links_problem(path, trusted)
        real = os.path.realpath(path)
        st = os.stat(real)
        if problem is None:
            problem = _walk_problem(os.path.dirname(real), trusted, own=False)
    except OSError:
        return None  # a missing or unreadable file: loading it says so
    if problem is None and not stat.S_ISREG(st.st_mode):
        problem = f"{path} is not a regular file"
    if problem is None:
        problem = judge(real, st.st_uid, st.st_mode, trusted, own=True, owner=owner_name(st.st_uid))
    if problem is None:
        return None
    return (
        f"refusing the config {path}: {problem}; the config says what the agent runs as "
        f"root: make it root's and private to root (chown root:root {path} && chmod 0644 "
        f"{path}, or 0600 if it holds secrets), in a folder only root can write"
    )


def socket_problem(path: str) -> str | None:
    """Why farmctl must not talk to the socket at `path`, or None (also None when absent).

    The socket and every folder on its way must belong to root or this user, and no other
    user may have been able to put it there (its folder writable by others without the
    sticky bit).
    """
    trusted = _trusted()
    try:
        problem = _links_problem(path, trusted)
        real = os.path.realpath(path)
        st = os.stat(real)
        if problem is None:
            problem = _walk_problem(os.path.dirname(real), trusted, own=False)
    except FileNotFoundError:
        return None  # nothing there: connecting says so
    except OSError:
        return None  # cannot look: connecting says why (permission denied...)
    if problem is None and st.st_uid not in trusted:
        problem = f"the socket is owned by {owner_name(st.st_uid)}, not by root or you"
    if problem is None:
        return None
    return (
        f"not talking to {path}: {problem}, so another user may have put it there; "
        "check what listens there (ss -xlp), and use the agent's socket "
        "(farmctl --socket PATH, [control] socket) in a folder only root can write"
    )
