"""Test helper: a real PostgreSQL (Debian's `postgresql` package), started for a test run as
`nobody` (initdb refuses root) in a throwaway folder, on a free loopback port, trust auth.

`SF_REQUIRE_POSTGRES=1` (as .ci/run sets it) turns a missing PostgreSQL into a failure; without
it the tests that need one are skipped where it is not installed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from asuser import NOBODY_GID, NOBODY_UID, SETPRIV
from batchsvc import free_port

PG_BIN = Path(os.environ.get("SF_PG_BIN", "/usr/lib/postgresql/15/bin"))


def missing() -> str | None:
    """Why no PostgreSQL can be started here, or None."""
    if not (PG_BIN / "initdb").exists():
        return f"PostgreSQL is not installed ({PG_BIN}/initdb; Debian's postgresql package)"
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return "starting PostgreSQL as nobody needs root and setpriv"
    return None


def require() -> None:
    reason = missing()
    if reason is None:
        return
    if os.environ.get("SF_REQUIRE_POSTGRES"):
        pytest.fail(f"SF_REQUIRE_POSTGRES is set but {reason}")
    pytest.skip(reason)


class PgServer:
    def __init__(self, root: Path, port: int) -> None:
        self.root = root
        self.port = port
        self.data = root / "data"

    def url(self, db: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{db}"

    def new_database(self) -> str:
        """A fresh, empty database's URL."""
        import psycopg

        name = "t" + uuid.uuid4().hex[:12]
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)


def _as_nobody(argv: list[str], timeout: float = 120) -> None:
    r = subprocess.run([*SETPRIV, *argv], capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise AssertionError(f"{argv[0]} exited {r.returncode}: {r.stdout}\n{r.stderr}")


@contextlib.contextmanager
def postgres() -> Iterator[PgServer]:
    require()
    root = Path(tempfile.mkdtemp(prefix="sf-pg-"))
    os.chmod(root, 0o755)
    os.chown(root, NOBODY_UID, NOBODY_GID)
    server = PgServer(root, free_port())
    _as_nobody(
        [
            str(PG_BIN / "initdb"),
            "-D",
            str(server.data),
            "-U",
            "postgres",
            "--auth=trust",
            "--no-sync",
            "-E",
            "UTF8",
        ]
    )
    opts = f"-p {server.port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=on"
    _as_nobody(
        [
            str(PG_BIN / "pg_ctl"),
            "-D",
            str(server.data),
            "-l",
            str(root / "log"),
            "-o",
            opts,
            "-w",
            "-t",
            "120",
            "start",
        ]
    )
    try:
        yield server
    finally:
        subprocess.run(
            [*SETPRIV, str(PG_BIN / "pg_ctl"), "-D", str(server.data), "-m", "immediate", "stop"],
            capture_output=True,
            timeout=120,
        )
        shutil.rmtree(root, ignore_errors=True)
