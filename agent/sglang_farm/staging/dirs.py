"""I/O: folders the workers can enter, whatever the agent's umask.

The workers run as [farm] user, the agent as root under UMask=0077: every folder the
staging creates (the parents of model_path after a reboot emptied /dev/shm, the copy's own
folders) gets DIR_MODE explicitly.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

DIR_MODE = 0o755


def make_dirs(d: Path) -> None:
    """`d` and its missing parents, each DIR_MODE whatever the umask."""
    if d.is_dir():
        return
    make_dirs(d.parent)
    with contextlib.suppress(FileExistsError):
        d.mkdir()
        os.chmod(d, DIR_MODE)
