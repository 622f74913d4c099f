"""Pure: the one rule for whether a folder (or a link on the way to it) could be another user's.

The agent runs as root and trusts nothing another local user can change. A folder is
trusted when it belongs to a trusted owner (root or the agent's own user) and no other
user may write to it, unless its sticky bit is set (as on `/tmp` and `/dev/shm`: others
can add names there, not rename or remove ours). The farm's own folder (`own`: the state
folder, the socket's folder) may not be writable by anyone else at all, sticky or not:
names the farm has yet to create there could be taken first. A symbolic link on the way
is followed only when a trusted owner made it (after OpenSSH's `secure_filename`).

Two shells ask it and word their own refusals: `securepath` (the agent's state and socket
folders, its config, farmctl's socket) and `staging.dirs.trusted_dir` (the staging's
folders), which counts a folder group-writable by group root as root's (`group`).
"""

from __future__ import annotations

import stat
from collections.abc import Collection
from enum import StrEnum

# Permission bits that let a user other than the owner create, rename or remove names.
OTHERS_WRITE_BITS = stat.S_IWGRP | stat.S_IWOTH


class Distrust(StrEnum):
    """Why a folder or link is not trusted."""

    OWNER = "owner"  # made or owned by neither root nor the agent's user
    OTHERS_WRITE = "others_write"  # another user may replace the names it holds


def link_distrust(uid: int, trusted: Collection[int]) -> Distrust | None:
    """A symbolic link made by `uid`: OWNER unless a trusted owner made it (its owner
    could point it anywhere)."""
    return None if uid in trusted else Distrust.OWNER


def folder_distrust(
    uid: int,
    mode: int,
    trusted: Collection[int],
    *,
    own: bool,
    group: int | None = None,
) -> Distrust | None:
    """Why a folder (owner `uid`, `st_mode` `mode`) is not trusted, or None.

    `own`: the farm's own folder (no other writer at all, sticky or not); else a folder on
    the way (others may write only under the sticky bit). `group`: the folder's group,
    given where a group of root's (gid 0) counts as root (its members could be root
    anyway); None: any group write counts as another user's.
    """
    if uid not in trusted:
        return Distrust.OWNER
    writers = stat.S_IWOTH if group == 0 else OTHERS_WRITE_BITS
    if mode & writers and (own or not mode & stat.S_ISVTX):
        return Distrust.OTHERS_WRITE
    return None
