"""I/O: the shared store, PostgreSQL through psycopg 3: several hosts' batch services
work one queue. Claims take rows `FOR UPDATE SKIP LOCKED`: two services claiming at the
same instant take different requests, neither waits on the other's. Every transaction is
committed before the call returns (PostgreSQL's own durability, synchronous_commit on).
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import errors

from sglang_farm.batch.sqlstore import SqlStore
from sglang_farm.batch.store import StoreError


def _shown(url: str) -> str:
    """The URL without its password, for messages."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        creds, host = rest.rsplit("@", 1)
        return f"{scheme}://{creds.split(':', 1)[0]}@{host}"
    return url


class PostgresStore(SqlStore):
    placeholder = "%s"
    skip_locked = " FOR UPDATE SKIP LOCKED"

    def __init__(self, url: str) -> None:
        try:
            conn = psycopg.connect(url, autocommit=True)
        except psycopg.Error as exc:
            raise StoreError(
                f"cannot connect to the batch store {_shown(url)}: {exc}; check [batch] store "
                "and that PostgreSQL is up"
            ) from exc
        super().__init__(conn, _shown(url))

    def _begin(self, cur: Any) -> None:
        cur.execute("BEGIN")

    def _is_full(self, exc: BaseException) -> bool:
        return isinstance(exc, errors.DiskFull | errors.OutOfMemory)

    def _is_db_error(self, exc: BaseException) -> bool:
        return isinstance(exc, psycopg.Error)
