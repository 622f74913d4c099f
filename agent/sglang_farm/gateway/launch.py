"""I/O: run smg in this process with its keys read from files, so no command line shows them.

    python -m sglang_farm.gateway.launch [--api-key-file F] [--admin-key-file F]
        [--scheduler-user-share S --scheduler-user-slots N] launch FLAGS...

smg reads no key from the environment, and a key in `smg launch --api-key K` is in the
process's command line until smg's launcher renames the process, and in a unit file's
ExecStart for good (readable by every local user). This entry point reads each key from
its file (e.g. one systemd's `LoadCredential=` provides), appends the flags that carry
them (as `gateway.managed.smg_argv` would) and calls smg's own CLI in the same process:
the process's command line only names the files. `managed.smg_argv(spec_without_keys,
smg=[python, "-m", "sglang_farm.gateway.launch", "--admin-key-file", F])` builds it.

With `--scheduler-user-share`, it also writes smg's priority-scheduler YAML
(`gateway.scheduler`) into a directory of its own (mode 0700, in the gateway's private
/tmp under systemd) and passes it as `--priority-scheduler-config`: only this process's
user (and root) can write it, and the command line says what is in it.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from sglang_farm.gateway.managed import ADMIN_KEY_ID
from sglang_farm.gateway.scheduler import MAX_FLOOR, scheduler_yaml

SCHEDULER_FILE = "priority-scheduler.yaml"


def read_key(path: str, what: str) -> str:
    """The key in `path` (surrounding blanks dropped). Exits with a one-line message
    naming the file when it cannot be read or holds no usable key."""
    try:
        key = Path(path).read_text().strip()
    except OSError as exc:
        raise SystemExit(
            f"sglang-farm gateway: cannot read the {what} file {path}: {exc}"
        ) from None
    if not key or any(c.isspace() for c in key):
        raise SystemExit(
            f"sglang-farm gateway: the {what} file {path} must hold one key without blanks"
        )
    return key


def smg_args(argv: Sequence[str]) -> list[str]:
    """The arguments for smg's CLI (`launch ...`) from this entry point's own."""
    # allow_abbrev off: smg's own --api-key must not be taken for --api-key-file.
    parser = argparse.ArgumentParser(
        prog="python -m sglang_farm.gateway.launch", allow_abbrev=False
    )
    parser.add_argument("--api-key-file", help="file holding smg's --api-key")
    parser.add_argument("--admin-key-file", help="file holding the farm's control-plane key")
    parser.add_argument(
        "--scheduler-user-share",
        type=float,
        help="share of smg's capacity its priority scheduler holds for the default class",
    )
    parser.add_argument(
        "--scheduler-user-slots", type=int, default=1, help="at least this many slots"
    )
    opts, rest = parser.parse_known_args(argv)
    if rest[:1] == ["launch"]:
        rest = rest[1:]
    for flag in ("--api-key", "--control-plane-api-keys"):
        if any(a.split("=", 1)[0] == flag for a in rest):
            parser.error(f"{flag} is read from a file here; pass --api-key-file/--admin-key-file")
    args = ["launch", *rest]
    if opts.scheduler_user_share is not None:
        if any(a.split("=", 1)[0] == "--priority-scheduler-config" for a in rest):
            parser.error(
                "--priority-scheduler-config is written here from --scheduler-user-share; "
                "pass one or the other"
            )
        share, floor = opts.scheduler_user_share, opts.scheduler_user_slots
        if not (math.isfinite(share) and 0 <= share < 1) or not 0 <= floor <= MAX_FLOOR:
            parser.error(
                "--scheduler-user-share expects a fraction in [0, 1) and "
                f"--scheduler-user-slots 0..{MAX_FLOOR}, got {share!r} and {floor!r}"
            )
        args += ["--priority-scheduler-config", write_scheduler_config(share, floor)]
    if opts.api_key_file:
        args += ["--api-key", read_key(opts.api_key_file, "API key")]
    if opts.admin_key_file:
        key = read_key(opts.admin_key_file, "admin key")
        args += ["--control-plane-api-keys", f"{ADMIN_KEY_ID}:{ADMIN_KEY_ID}:admin:{key}"]
    return args


def write_scheduler_config(share: float, floor: int) -> str:
    """smg's scheduler YAML in a new 0700 directory of this process (removed at exit);
    its path."""
    folder = tempfile.mkdtemp(prefix="sglang-farm-gateway-")
    atexit.register(shutil.rmtree, folder, True)
    path = os.path.join(folder, SCHEDULER_FILE)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(scheduler_yaml(share, floor))
    return path


def main(argv: Sequence[str] | None = None) -> None:
    args = smg_args(sys.argv[1:] if argv is None else argv)
    try:
        # Imported by name: smg is an optional dependency and ships no type information.
        cli = importlib.import_module("smg.cli")
    except ImportError:
        raise SystemExit(
            "sglang-farm gateway: smg is not installed in this Python environment "
            f"({sys.executable}); install it with: {sys.executable} -m pip install smg"
        ) from None
    cli.main(args)


if __name__ == "__main__":
    main()
