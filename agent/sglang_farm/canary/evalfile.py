"""I/O: the `[rollout] eval` file read the way the agent reads what root trusts.

The eval set decides whether a change reaches every GPU: a set another user could write
is a set they could fill with questions any model passes (the gate then passes a broken
model) or that no model passes (every change is rejected). So it is read under the
config's rule (`securepath.config_problem`, `folder_trust`): a regular file of root or
the agent's user that no other user can write, in folders no other user could swap it
in, opened with no link followed (`O_NOFOLLOW`; a link on the way is followed only when
root or the agent's user made it, as for the config) and without waiting (`O_NONBLOCK`:
a FIFO put in its place cannot hang the agent), its owner and mode judged on the opened
file itself (no window between the check and the read), and at most `MAX_BYTES` read.
"""

from __future__ import annotations

import errno
import os
import stat

from sglang_farm.host.securepath import judge, owner_name, way_problem

# 40 questions are 3 KB; a set of thousands stays far below this.
MAX_BYTES = 4 << 20


class EvalFileRefused(ValueError):
    """The eval file must not be used: the message says which file, why and what to do."""


def _refusal(path: str, problem: str) -> EvalFileRefused:
    return EvalFileRefused(
        f"refusing the eval set {path}: {problem}; the eval set decides whether a change "
        f"rolls out: make it a regular file of root's that no other user can write "
        f"(chown root:root {path} && chmod 0644 {path}), in a folder only root can write, "
        "or remove [rollout] eval"
    )


def read(path: str) -> str:
    """The text of the eval file at `path` (UTF-8).

    Raises `EvalFileRefused` for a file root must not trust (owner, mode, a link, not a
    regular file, a folder on the way, larger than `MAX_BYTES`), `OSError` for one that
    cannot be read (missing, no access), `UnicodeDecodeError` for one that is not UTF-8.
    """
    problem = way_problem(path)
    if problem is not None:
        raise _refusal(path, problem)
    # Links on the way were made by root or the agent's user (`way_problem`): follow them
    # to the real file, then open that with no link followed.
    real = os.path.realpath(path)
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a link put there since
            raise _refusal(path, f"{real} is a symbolic link") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refusal(path, f"{path} is not a regular file")
        trusted = frozenset({0, os.geteuid()})
        problem = judge(path, st.st_uid, st.st_mode, trusted, own=True, owner=owner_name(st.st_uid))
        if problem is not None:
            raise _refusal(path, problem)
        chunks: list[bytes] = []
        size = 0
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_BYTES:
                raise _refusal(path, f"{path} is larger than {MAX_BYTES >> 20} MiB")
    finally:
        os.close(fd)
    return b"".join(chunks).decode("utf-8")
