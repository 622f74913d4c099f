"""I/O: a gateway key ([gateway] admin_key_file, api_key_file) read as root reads what it
trusts (issue 26: an external gateway's admin key, like a managed one's).

The admin key opens smg's worker API: whoever holds it can take a farm's workers out of
its gateways, or route users' requests to a host of their own. So the agent refuses a
key file another user could read or replace, as it refuses the Hub token file
(`staging.hub.read_token`): owned by root or the agent's user, no group or other
permission bit, a regular file, reached through no other user's link or folder
(`host.securepath.way_problem`, checked before the open; a FIFO never blocks the read),
and still the file at the path once opened (device and inode compared). `sglang-farm
check-config` fails on the same files (`gateway_key_problem`) and the doctor warns of
them (`doctor.host_rules.key_file_checks`) before the agent starts.
"""

from __future__ import annotations

import os
import stat

from sglang_farm.errors import ConfigError
from sglang_farm.host.securepath import owner_name, way_problem


def key_file_problem(path: str, uid: int, mode: int, trusted: frozenset[int]) -> str | None:
    """Pure: why a key file (owner `uid`, `st_mode` `mode`) must not be trusted, or None."""
    if not stat.S_ISREG(mode):
        return f"{path} is not a regular file"
    if uid not in trusted:
        return f"{path} is owned by {owner_name(uid)}, not by root or the agent's user"
    if mode & 0o077:
        return f"{path} is open to other users (mode {stat.S_IMODE(mode):04o})"
    return None


def read_gateway_key(path: str, what: str) -> str:
    """The one key in `path` ([gateway] `what`), or a `ConfigError` that says what is wrong
    with the file and how to fix it (the key itself never appears in it)."""
    fix = f"chown root: {path} && chmod 0600 {path}"
    # The way first (another user's link or folder could swap the file at any moment),
    # then the open, then: is the file opened the one at the path now? A path that
    # vanished or changed meanwhile is refused, not passed (`way_problem` cannot judge
    # a path that is gone).
    way = way_problem(path)
    if way is not None:
        raise ConfigError(
            path, [f"[gateway] {what}: refusing {path}: {way}; a key must be private: {fix}"]
        )
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(
            path,
            [
                f"[gateway] {what}: cannot read {path}: {exc.strerror or exc}; create it "
                f"(one key, mode 0600, owned by root) or remove {what} from the config"
            ],
        ) from exc
    try:
        st = os.fstat(fd)
        problem = key_file_problem(path, st.st_uid, st.st_mode, frozenset({0, os.geteuid()}))
        if problem is None and not _same_file(path, st):
            problem = (
                "it was removed or replaced while the agent read it (another process "
                "changes it: find out which)"
            )
        if problem is not None:
            raise ConfigError(
                path,
                [f"[gateway] {what}: refusing {path}: {problem}; a key must be private: {fix}"],
            )
        data = os.read(fd, 4097)
    finally:
        os.close(fd)
    key = data.decode("utf-8", "replace").strip()
    if not key or len(data) > 4096 or any(c.isspace() for c in key):
        raise ConfigError(path, [f"[gateway] {what}: {path} must hold one key without blanks"])
    return key


def _same_file(path: str, opened: os.stat_result) -> bool:
    """Whether `path` still leads to the file `opened` (its device and inode). Followed
    through links: a link on the way is root's or the agent's (`way_problem`), and a
    root-made link to the key is a sound setup."""
    try:
        now = os.stat(path)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (opened.st_dev, opened.st_ino)


def gateway_key_problem(path: str, what: str) -> str | None:
    """What the agent would say refusing the key file at `path` ([gateway] `what`) at
    start, with the fix, or None: for `sglang-farm check-config`, which fails on it (so
    Ansible's `validate:` keeps the old config). The same rules as `read_gateway_key`,
    without reading the key."""
    fix = f"chown root: {path} && chmod 0600 {path}"
    try:
        st = os.stat(path)
    except OSError as exc:
        return (
            f"[gateway] {what}: cannot read {path}: {exc.strerror or exc}; create it (one "
            f"key, mode 0600, owned by root) or remove {what} from the config"
        )
    problem = way_problem(path) or key_file_problem(
        path, st.st_uid, st.st_mode, frozenset({0, os.geteuid()})
    )
    if problem is None:
        return None
    return (
        f"[gateway] {what}: refusing {path}: {problem}; the agent refuses it at start; fix: {fix}"
    )
