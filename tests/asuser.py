"""Another local user, for the trust tests: what `nobody` (65534) can do against a root farm.

The farm runs as root and must trust nothing another user can write (docs/security.md).
Each such test plays the other user for real: a process run through
`setpriv --reuid=65534 --regid=65534 --clear-groups`, never a chown that pretends.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

NOBODY_UID = 65534
NOBODY_GID = 65534
SETPRIV = ["setpriv", f"--reuid={NOBODY_UID}", f"--regid={NOBODY_GID}", "--clear-groups"]


def skip_reason() -> str | None:
    """Why this machine cannot play another user, or None when it can."""
    if os.geteuid() != 0:
        return "playing another user needs root"
    if shutil.which("setpriv") is None:
        return "setpriv (util-linux) is not installed"
    return None


def require() -> None:
    """Skip the calling test where another user cannot be played."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)


def as_nobody(
    argv: list[str], *, check: bool = True, timeout: float = 30, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `argv` as nobody; with `check`, fail the test on a non-zero exit, showing stderr."""
    r = subprocess.run(
        [*SETPRIV, *argv], capture_output=True, text=True, timeout=timeout, input=input
    )
    if check and r.returncode != 0:
        raise AssertionError(f"as nobody: exit {r.returncode}: {argv}\n{r.stdout}\n{r.stderr}")
    return r


def nobody_python(
    code: str, *args: str, check: bool = True, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    """Run a Python snippet as nobody (the standard library only, isolated mode)."""
    return as_nobody([sys.executable, "-I", "-c", code, *args], check=check, timeout=timeout)


def popen_as_nobody(argv: list[str]) -> subprocess.Popen[str]:
    """Start `argv` as nobody in the background (a squatter, a slow client); the caller stops it."""
    return subprocess.Popen(
        [*SETPRIV, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@contextlib.contextmanager
def shared_folder() -> Iterator[Path]:
    """A root-owned folder like /tmp or /dev/shm (01777: anyone creates, the sticky bit).

    pytest's tmp_path lies under a 0700 folder; another user's files must live where that
    user can get to them, as they would on a host. A test that needs a parent no other
    user may write makes one inside (root's, 0755).
    """
    require()
    d = Path(tempfile.mkdtemp(prefix="sf-trust-", dir="/var/tmp"))
    os.chmod(d, 0o1777)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def nobody_owned(parent: Path, name: str, mode: int = 0o755) -> Path:
    """A folder under `parent` made by nobody itself (so its owner and mode are nobody's doing)."""
    path = parent / name
    as_nobody(["mkdir", "-m", oct(mode)[2:], str(path)])
    return path
