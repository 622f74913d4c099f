"""I/O: the embedded store, SQLite in `<state_dir>/batch.db` (WAL, synchronous=FULL: a
commit is on disk before the call returns, so a result recorded is a result kept through
a power cut). One writer at a time, which is SQLite's own lock: the service holds the
database alone (`main` takes a lock file beside it).
"""

from __future__ import annotations

import os
import sqlite3
from typing import Any

from sglang_farm.batch.sqlstore import SqlStore


class SqliteStore(SqlStore):
    # One service holds the database (its lock file): whatever is in flight when it
    # starts was claimed by a process that is gone, whatever owner name it had.
    sole_claimant = True

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)  # 0600 from its first byte
        os.close(fd)
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("PRAGMA foreign_keys=ON")
        self.path = path
        super().__init__(conn, path)

    def _begin(self, cur: Any) -> None:
        cur.execute("BEGIN IMMEDIATE")

    def _is_full(self, exc: BaseException) -> bool:
        return isinstance(exc, sqlite3.OperationalError) and (
            getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL
            or "full" in str(exc).lower()
        )

    def _is_db_error(self, exc: BaseException) -> bool:
        return isinstance(exc, sqlite3.Error)

    def set_max_pages(self, pages: int) -> None:
        """Cap the database's size (`PRAGMA max_page_count`): what a full disk does, on
        demand (the tests' full disk)."""
        with self._lock:
            self._conn.execute(f"PRAGMA max_page_count = {int(pages)}")

    def page_count(self) -> int:
        with self._lock:
            return int(self._conn.execute("PRAGMA page_count").fetchone()[0])
