"""I/O: the SQL both store backends share (the schema, every query); `sqlite` and
`postgres` give it a connection and their dialect (placeholders, locking, error kinds).

Exactly once rests on three rules, each one SQL statement's condition:
- a claim takes a request that is pending (and due) or whose lease has passed, and gives it
  a fresh random `token` (PostgreSQL: `FOR UPDATE SKIP LOCKED`, so two hosts never take one
  request in the same instant; SQLite: one writer at a time);
- an outcome is recorded only `WHERE state = 'in_flight' AND token = <the claim's>`: a
  runner whose lease passed and was taken over records nothing;
- the output and error files are the rows (`result_lines`): each request has one row, so
  each custom_id is in one file once.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from sglang_farm.batch.lifecycle import STAMP, BatchStatus
from sglang_farm.batch.objects import new_id, result_line
from sglang_farm.batch.store import (
    Attempt,
    BatchRow,
    Claimed,
    FileRow,
    NotFound,
    Result,
    StoreError,
    StoreFull,
)
from sglang_farm.batch.validate import Problem, Request, duplicate_problem, empty_problem

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS files (
        id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT NULL,
        bytes BIGINT NOT NULL, created_at DOUBLE PRECISION NOT NULL, kind TEXT NOT NULL,
        batch_id TEXT, deleted INTEGER NOT NULL DEFAULT 0)""",
    """CREATE TABLE IF NOT EXISTS batches (
        id TEXT PRIMARY KEY, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL,
        completion_window TEXT NOT NULL, status TEXT NOT NULL,
        created_at DOUBLE PRECISION NOT NULL, expires_at DOUBLE PRECISION NOT NULL,
        metadata TEXT, errors TEXT, output_file_id TEXT, error_file_id TEXT,
        stamps TEXT NOT NULL DEFAULT '{}',
        total BIGINT NOT NULL DEFAULT 0, completed BIGINT NOT NULL DEFAULT 0,
        failed BIGINT NOT NULL DEFAULT 0, in_flight BIGINT NOT NULL DEFAULT 0,
        prompt_tokens BIGINT NOT NULL DEFAULT 0, completion_tokens BIGINT NOT NULL DEFAULT 0)""",
    """CREATE TABLE IF NOT EXISTS requests (
        batch_id TEXT NOT NULL, line BIGINT NOT NULL, custom_id TEXT NOT NULL,
        url TEXT NOT NULL, body TEXT NOT NULL, state TEXT NOT NULL,
        attempts INTEGER NOT NULL DEFAULT 0, next_at DOUBLE PRECISION NOT NULL DEFAULT 0,
        owner TEXT, token TEXT, lease_until DOUBLE PRECISION,
        status_code INTEGER, request_id TEXT, response TEXT,
        error_code TEXT, error_message TEXT, last_reason TEXT,
        prompt_tokens BIGINT NOT NULL DEFAULT 0, completion_tokens BIGINT NOT NULL DEFAULT 0,
        finished_at DOUBLE PRECISION,
        PRIMARY KEY (batch_id, line), UNIQUE (batch_id, custom_id))""",
    "CREATE INDEX IF NOT EXISTS requests_state ON requests (batch_id, state, line)",
    "CREATE INDEX IF NOT EXISTS requests_owner ON requests (owner, state)",
    """CREATE TABLE IF NOT EXISTS attempts (
        batch_id TEXT NOT NULL, line BIGINT NOT NULL, attempt INTEGER NOT NULL,
        at DOUBLE PRECISION NOT NULL, owner TEXT, outcome TEXT NOT NULL, reason TEXT,
        status_code INTEGER)""",
)

_BATCH_COLS = (
    "id, endpoint, input_file_id, completion_window, status, created_at, expires_at, "
    "metadata, errors, output_file_id, error_file_id, stamps, total, completed, failed, "
    "in_flight, prompt_tokens, completion_tokens"
)
_LIVE = (
    BatchStatus.VALIDATING,
    BatchStatus.IN_PROGRESS,
    BatchStatus.FINALIZING,
    BatchStatus.CANCELLING,
)
CHUNK = 1000
MAX_PROBLEMS = 10000


def _batch(row: Sequence[Any]) -> BatchRow:
    return BatchRow(
        id=row[0],
        endpoint=row[1],
        input_file_id=row[2],
        completion_window=row[3],
        status=BatchStatus(row[4]),
        created_at=float(row[5]),
        expires_at=float(row[6]),
        metadata=json.loads(row[7]) if row[7] else None,
        errors=tuple(json.loads(row[8])) if row[8] else (),
        output_file_id=row[9],
        error_file_id=row[10],
        stamps=json.loads(row[11]),
        total=int(row[12]),
        completed=int(row[13]),
        failed=int(row[14]),
        in_flight=int(row[15]),
        prompt_tokens=int(row[16]),
        completion_tokens=int(row[17]),
    )


def _file(row: Sequence[Any]) -> FileRow:
    return FileRow(
        id=row[0],
        purpose=row[1],
        filename=row[2],
        bytes=int(row[3]),
        created_at=float(row[4]),
        kind=row[5],
        batch_id=row[6],
    )


class SqlStore:
    """The store on one DB-API connection, used by one thread at a time (a lock)."""

    placeholder = "?"
    skip_locked = ""  # PostgreSQL: " FOR UPDATE SKIP LOCKED"

    def __init__(self, conn: Any, where: str) -> None:
        self._conn = conn
        self._where = where
        self._lock = threading.RLock()
        with self._tx() as cur:
            for stmt in SCHEMA:
                cur.execute(stmt)

    # --- the dialect's parts ------------------------------------------------------------

    def _begin(self, cur: Any) -> None:
        raise NotImplementedError

    def _is_full(self, exc: BaseException) -> bool:
        raise NotImplementedError

    def _is_db_error(self, exc: BaseException) -> bool:
        raise NotImplementedError

    # --- plumbing ------------------------------------------------------------------------

    def _q(self, sql: str) -> str:
        return sql if self.placeholder == "?" else sql.replace("?", self.placeholder)

    @contextmanager
    def _tx(self) -> Iterator[Any]:
        with self._lock:
            cur = self._conn.cursor()
            try:
                self._begin(cur)
                yield cur
                self._conn.commit()
            except BaseException as exc:
                with contextlib.suppress(Exception):  # the first error is the one to report
                    self._conn.rollback()
                if self._is_full(exc):
                    raise StoreFull(
                        f"{self._where}: the store's disk is full ({exc}); nothing was written. "
                        "Free space there: the batch resumes by itself"
                    ) from exc
                if self._is_db_error(exc):
                    raise StoreError(f"{self._where}: {exc}") from exc
                raise
            finally:
                cur.close()

    def _x(self, cur: Any, sql: str, args: Sequence[object] = ()) -> Any:
        cur.execute(self._q(sql), tuple(args))
        return cur

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    # --- files ---------------------------------------------------------------------------

    def add_file(self, row: FileRow) -> None:
        with self._tx() as cur:
            self._x(
                cur,
                "INSERT INTO files (id, purpose, filename, bytes, created_at, kind, batch_id) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    row.id,
                    row.purpose,
                    row.filename,
                    row.bytes,
                    row.created_at,
                    row.kind,
                    row.batch_id,
                ),
            )

    def file(self, file_id: str) -> FileRow:
        with self._tx() as cur:
            r = self._x(
                cur,
                "SELECT id, purpose, filename, bytes, created_at, kind, batch_id FROM files "
                "WHERE id = ? AND deleted = 0",
                (file_id,),
            ).fetchone()
        if r is None:
            raise NotFound(f"no file {file_id!r}")
        return _file(r)

    def files(self, *, purpose: str | None = None, limit: int = 10000) -> list[FileRow]:
        sql = (
            "SELECT id, purpose, filename, bytes, created_at, kind, batch_id FROM files "
            "WHERE deleted = 0"
        )
        args: list[object] = []
        if purpose is not None:
            sql += " AND purpose = ?"
            args.append(purpose)
        sql += " ORDER BY created_at DESC, id DESC LIMIT ?"
        args.append(limit)
        with self._tx() as cur:
            return [_file(r) for r in self._x(cur, sql, args).fetchall()]

    def delete_file(self, file_id: str) -> None:
        with self._tx() as cur:
            if (
                self._x(
                    cur, "UPDATE files SET deleted = 1 WHERE id = ? AND deleted = 0", (file_id,)
                ).rowcount
                != 1
            ):
                raise NotFound(f"no file {file_id!r}")

    # --- batches -------------------------------------------------------------------------

    def add_batch(self, row: BatchRow) -> None:
        with self._tx() as cur:
            self._x(
                cur,
                "INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, "
                "created_at, expires_at, metadata) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    row.id,
                    row.endpoint,
                    row.input_file_id,
                    row.completion_window,
                    str(row.status),
                    row.created_at,
                    row.expires_at,
                    json.dumps(dict(row.metadata)) if row.metadata else None,
                ),
            )

    def batch(self, batch_id: str) -> BatchRow:
        with self._tx() as cur:
            r = self._x(
                cur, f"SELECT {_BATCH_COLS} FROM batches WHERE id = ?", (batch_id,)
            ).fetchone()
        if r is None:
            raise NotFound(f"no batch {batch_id!r}")
        return _batch(r)

    def batches(self, *, after: str | None = None, limit: int = 20) -> list[BatchRow]:
        with self._tx() as cur:
            if after is None:
                rows = self._x(
                    cur,
                    f"SELECT {_BATCH_COLS} FROM batches ORDER BY created_at DESC, id DESC LIMIT ?",
                    (limit,),
                ).fetchall()
            else:
                a = self._x(cur, "SELECT created_at FROM batches WHERE id = ?", (after,)).fetchone()
                if a is None:
                    raise NotFound(f"no batch {after!r} (after)")
                rows = self._x(
                    cur,
                    f"SELECT {_BATCH_COLS} FROM batches WHERE created_at < ? OR "
                    "(created_at = ? AND id < ?) ORDER BY created_at DESC, id DESC LIMIT ?",
                    (a[0], a[0], after, limit),
                ).fetchall()
        return [_batch(r) for r in rows]

    def live_batches(self) -> list[BatchRow]:
        marks = ", ".join("?" for _ in _LIVE)
        with self._tx() as cur:
            rows = self._x(
                cur,
                f"SELECT {_BATCH_COLS} FROM batches WHERE status IN ({marks}) "
                "ORDER BY created_at, id",
                [str(s) for s in _LIVE],
            ).fetchall()
        return [_batch(r) for r in rows]

    def _stamp(self, cur: Any, batch_id: str, field: str, now: float) -> None:
        r = self._x(cur, "SELECT stamps FROM batches WHERE id = ?", (batch_id,)).fetchone()
        stamps = json.loads(r[0]) if r else {}
        stamps[field] = now
        self._x(cur, "UPDATE batches SET stamps = ? WHERE id = ?", (json.dumps(stamps), batch_id))

    def load(
        self, batch_id: str, requests: Iterable[Request | list[Problem]], *, now: float
    ) -> Sequence[Problem]:
        """In chunks of `CHUNK` lines, each its own transaction (a long file does not hold
        the store's write lock for its whole length): the rows of a validating batch are
        claimed by no one, so they count only once the last transaction moves the batch to
        in_progress. A load cut short (a crash) leaves rows that the next load removes
        first; a refused one removes its rows with the move to failed."""
        problems: list[Problem] = []
        more = 0
        total = 0
        with self._tx() as cur:
            row = self._x(cur, "SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None or row[0] != BatchStatus.VALIDATING:
                return []
            self._x(cur, "DELETE FROM requests WHERE batch_id = ?", (batch_id,))

        def note(p: Problem) -> None:
            nonlocal more
            if len(problems) < MAX_PROBLEMS:
                problems.append(p)
            else:
                more += 1

        def flush(chunk: list[Request]) -> None:
            with self._tx() as cur:
                cur.executemany(
                    self._q(
                        "INSERT INTO requests (batch_id, line, custom_id, url, body, state) "
                        "VALUES (?, ?, ?, ?, ?, 'pending') ON CONFLICT DO NOTHING"
                    ),
                    [(batch_id, r.line, r.custom_id, r.url, r.body) for r in chunk],
                )
                if cur.rowcount == len(chunk):
                    return
                marks = ", ".join("?" for _ in chunk)
                firsts = dict(
                    self._x(
                        cur,
                        f"SELECT custom_id, line FROM requests WHERE batch_id = ? "
                        f"AND custom_id IN ({marks})",
                        [batch_id, *(r.custom_id for r in chunk)],
                    ).fetchall()
                )
            for r in chunk:
                first = int(firsts[r.custom_id])
                if first != r.line:
                    note(duplicate_problem(r.line, r.custom_id, first))

        chunk: list[Request] = []
        for item in requests:
            if isinstance(item, list):
                for p in item:
                    note(p)
                continue
            total += 1
            chunk.append(item)
            if len(chunk) >= CHUNK:
                flush(chunk)
                chunk = []
        if chunk:
            flush(chunk)
        if not problems and total == 0:
            problems.append(empty_problem())
        if more:
            problems.append(Problem(None, None, f"and {more} more problems not listed"))
        with self._tx() as cur:
            new = BatchStatus.FAILED if problems else BatchStatus.IN_PROGRESS
            field, value = (
                ("errors", json.dumps([p.to_dict() for p in problems]))
                if problems
                else ("total", total)
            )
            moved = self._x(
                cur,
                f"UPDATE batches SET status = ?, {field} = ? WHERE id = ? AND status = ?",
                (str(new), value, batch_id, str(BatchStatus.VALIDATING)),
            ).rowcount
            if moved == 1:
                self._stamp(cur, batch_id, STAMP[new], now)
            if problems or moved != 1:  # refused, or cancelled meanwhile: no request kept
                self._x(cur, "DELETE FROM requests WHERE batch_id = ?", (batch_id,))
        return problems

    def set_status(self, batch_id: str, old: BatchStatus, new: BatchStatus, *, now: float) -> bool:
        with self._tx() as cur:
            n = self._x(
                cur,
                "UPDATE batches SET status = ? WHERE id = ? AND status = ?",
                (str(new), batch_id, str(old)),
            ).rowcount
            if n != 1:
                return False
            self._stamp(cur, batch_id, STAMP[new], now)
            if new in (BatchStatus.EXPIRED, BatchStatus.CANCELLED):
                code = "batch_expired" if new is BatchStatus.EXPIRED else "batch_cancelled"
                message = (
                    "the batch's completion window passed before this request was answered"
                    if new is BatchStatus.EXPIRED
                    else "the batch was cancelled before this request was answered"
                )
                left = self._x(
                    cur,
                    "UPDATE requests SET state = 'failed', error_code = ?, error_message = ?, "
                    "finished_at = ?, token = NULL WHERE batch_id = ? AND state IN "
                    "('pending', 'in_flight')",
                    (code, message, now, batch_id),
                ).rowcount
                self._x(
                    cur,
                    "UPDATE batches SET failed = failed + ?, in_flight = 0 WHERE id = ?",
                    (left, batch_id),
                )
            if new in (BatchStatus.COMPLETED, BatchStatus.EXPIRED, BatchStatus.CANCELLED):
                ids: dict[str, str | None] = {}
                for kind in ("output", "error"):
                    size = sum(len(line) for line in self._lines(cur, batch_id, kind))
                    fid = new_id("file-")
                    ids[kind] = fid
                    self._x(
                        cur,
                        "INSERT INTO files (id, purpose, filename, bytes, created_at, kind, "
                        "batch_id) VALUES (?, ?, ?, ?, ?, ?, ?)",
                        (
                            fid,
                            f"batch_{kind}",
                            f"{batch_id}_{kind}.jsonl",
                            size,
                            now,
                            kind,
                            batch_id,
                        ),
                    )
                self._x(
                    cur,
                    "UPDATE batches SET output_file_id = ?, error_file_id = ? WHERE id = ?",
                    (ids["output"], ids["error"], batch_id),
                )
            return True

    # --- requests ------------------------------------------------------------------------

    def claim(self, owner: str, n: int, *, now: float, lease_s: float) -> list[Claimed]:
        if n <= 0:
            return []
        deltas: dict[str, list[int]] = {}
        with self._tx() as cur:
            out = self._claim(cur, owner, n, now, lease_s, deltas)
            self._count(cur, deltas)
        return out

    def exchange(
        self, outcomes: Sequence[Attempt], owner: str, n: int, *, now: float, lease_s: float
    ) -> tuple[list[bool], list[Claimed]]:
        deltas: dict[str, list[int]] = {}
        with self._tx() as cur:
            done = self._record(cur, outcomes, now, deltas)
            claimed = self._claim(cur, owner, n, now, lease_s, deltas) if n > 0 else []
            self._count(cur, deltas)
        return done, claimed

    def _claim(
        self,
        cur: Any,
        owner: str,
        n: int,
        now: float,
        lease_s: float,
        deltas: dict[str, list[int]],
    ) -> list[Claimed]:
        out: list[Claimed] = []
        live = self._x(
            cur,
            "SELECT id FROM batches WHERE status = ? ORDER BY created_at, id",
            (str(BatchStatus.IN_PROGRESS),),
        ).fetchall()
        for (batch_id,) in live:
            want = n - len(out)
            if want <= 0:
                break
            token = secrets.token_hex(8)
            # One state at a time, each read along the (batch_id, state, line) index: a
            # condition over both states walked the batch from its first line, past every
            # finished request (O(done) a claim, O(n^2) a batch).
            rows = self._x(
                cur,
                "SELECT line, custom_id, url, body, attempts, state FROM requests "
                "WHERE batch_id = ? AND state = 'in_flight' AND lease_until < ? "
                "ORDER BY line LIMIT ?" + self.skip_locked,
                (batch_id, now, want),
            ).fetchall()
            if len(rows) < want:
                rows += self._x(
                    cur,
                    "SELECT line, custom_id, url, body, attempts, state FROM requests "
                    "WHERE batch_id = ? AND state = 'pending' AND next_at <= ? "
                    "ORDER BY line LIMIT ?" + self.skip_locked,
                    (batch_id, now, want - len(rows)),
                ).fetchall()
            if not rows:
                continue
            cur.executemany(
                self._q(
                    "UPDATE requests SET state = 'in_flight', owner = ?, token = ?, "
                    "lease_until = ? WHERE batch_id = ? AND line = ?"
                ),
                [(owner, token, now + lease_s, batch_id, r[0]) for r in rows],
            )
            acc = deltas.setdefault(batch_id, [0, 0, 0, 0, 0])
            acc[0] += sum(1 for r in rows if r[5] == "pending")
            out.extend(
                Claimed(batch_id, int(r[0]), r[1], r[2], r[3], int(r[4]), token) for r in rows
            )
        return out

    def _count(self, cur: Any, deltas: dict[str, list[int]]) -> None:
        """The batches' counters, last and in id order: a batch row locked while waiting
        for another host's request rows (or its other batch rows) would deadlock two
        hosts."""
        for batch_id, (f, c, x, p, k) in sorted(deltas.items()):
            if f or c or x or p or k:
                self._x(
                    cur,
                    "UPDATE batches SET in_flight = in_flight + ?, completed = completed + ?, "
                    "failed = failed + ?, prompt_tokens = prompt_tokens + ?, "
                    "completion_tokens = completion_tokens + ? WHERE id = ?",
                    (f, c, x, p, k, batch_id),
                )

    # A store several services share (PostgreSQL): another claimant may be alive.
    sole_claimant = False

    def release_owner(self, owner: str) -> int:
        return self._release("owner = ? AND ", (owner,))

    def release_at_start(self, owner: str) -> int:
        if self.sole_claimant:
            return self._release("", ())
        return self.release_owner(owner)

    def _release(self, where: str, params: tuple[object, ...]) -> int:
        """Requests in flight (`where` narrows them) back to pending; how many."""
        with self._tx() as cur:
            rows = self._x(
                cur,
                f"SELECT batch_id, count(*) FROM requests WHERE {where}state = 'in_flight' "
                "GROUP BY batch_id",
                params,
            ).fetchall()
            self._x(
                cur,
                "UPDATE requests SET state = 'pending', token = NULL, lease_until = NULL "
                f"WHERE {where}state = 'in_flight'",
                params,
            )
            for batch_id, k in rows:
                self._x(
                    cur, "UPDATE batches SET in_flight = in_flight - ? WHERE id = ?", (k, batch_id)
                )
        return sum(int(k) for _, k in rows)

    def record(self, outcomes: Sequence[Attempt], *, now: float) -> list[bool]:
        deltas: dict[str, list[int]] = {}
        with self._tx() as cur:
            done = self._record(cur, outcomes, now, deltas)
            self._count(cur, deltas)
        return done

    def _record(
        self, cur: Any, outcomes: Sequence[Attempt], now: float, deltas: dict[str, list[int]]
    ) -> list[bool]:
        """Each outcome where its claim still holds the request; `deltas` gains the
        batches' counts (in_flight, completed, failed, prompt, completion tokens)."""
        done: list[bool] = []
        tried: list[tuple[object, ...]] = []
        for a in outcomes:
            c = a.claim
            r = a.result
            if a.state == "pending":
                n = self._x(
                    cur,
                    "UPDATE requests SET state = 'pending', token = NULL, lease_until = NULL, "
                    "attempts = ?, next_at = ?, last_reason = ? WHERE batch_id = ? AND "
                    "line = ? AND state = 'in_flight' AND token = ?",
                    (a.attempts, a.retry_at, a.reason, c.batch_id, c.line, c.token),
                ).rowcount
                delta = (-1, 0, 0, 0, 0)
            else:
                assert r is not None
                n = self._x(
                    cur,
                    "UPDATE requests SET state = ?, token = NULL, lease_until = NULL, "
                    "attempts = ?, status_code = ?, request_id = ?, response = ?, "
                    "error_code = ?, error_message = ?, last_reason = ?, prompt_tokens = ?, "
                    "completion_tokens = ?, finished_at = ? WHERE batch_id = ? AND line = ? "
                    "AND state = 'in_flight' AND token = ?",
                    (
                        a.state,
                        a.attempts,
                        r.status_code,
                        r.request_id,
                        r.body,
                        r.error_code,
                        r.error_message,
                        a.reason,
                        r.prompt_tokens,
                        r.completion_tokens,
                        now,
                        c.batch_id,
                        c.line,
                        c.token,
                    ),
                ).rowcount
                ok_ = a.state == "completed"
                delta = (-1, int(ok_), int(not ok_), r.prompt_tokens, r.completion_tokens)
            ok = n == 1
            done.append(ok)
            if ok:
                acc = deltas.setdefault(c.batch_id, [0, 0, 0, 0, 0])
                for i, d in enumerate(delta):
                    acc[i] += d
                tried.append(
                    (
                        c.batch_id,
                        c.line,
                        a.attempts,
                        now,
                        a.state,
                        a.reason,
                        r.status_code if r is not None else None,
                    )
                )
        if tried:
            cur.executemany(
                self._q(
                    "INSERT INTO attempts (batch_id, line, attempt, at, owner, outcome, "
                    "reason, status_code) VALUES (?, ?, ?, ?, NULL, ?, ?, ?)"
                ),
                tried,
            )
        return done

    def attempts_of(self, batch_id: str, custom_id: str) -> list[tuple[int, str, str | None]]:
        """(attempt, outcome, reason) of one request, in order: what each attempt came to."""
        with self._tx() as cur:
            rows = self._x(
                cur,
                "SELECT a.attempt, a.outcome, a.reason FROM attempts a JOIN requests r ON "
                "r.batch_id = a.batch_id AND r.line = a.line WHERE a.batch_id = ? AND "
                "r.custom_id = ? ORDER BY a.attempt",
                (batch_id, custom_id),
            ).fetchall()
        return [(int(r[0]), r[1], r[2]) for r in rows]

    def _chunk(self, cur: Any, batch_id: str, kind: str, after: int) -> list[tuple[int, bytes]]:
        rows = self._x(
            cur,
            "SELECT line, custom_id, status_code, request_id, response, error_code, "
            "error_message FROM requests WHERE batch_id = ? AND state = ? AND line > ? "
            "ORDER BY line LIMIT ?",
            (batch_id, "completed" if kind == "output" else "failed", after, CHUNK),
        ).fetchall()
        short = batch_id.removeprefix("batch_")
        return [
            (
                int(r[0]),
                result_line(
                    f"batch_req_{short}_{r[0]}", r[1], Result(r[2], r[3], r[4], r[5], r[6])
                ),
            )
            for r in rows
        ]

    def _lines(self, cur: Any, batch_id: str, kind: str) -> Iterator[bytes]:
        """Within one transaction (the file's size as it is made)."""
        last = 0
        while rows := self._chunk(cur, batch_id, kind, last):
            last = rows[-1][0]
            yield from (line for _, line in rows)

    def result_lines(self, batch_id: str, kind: str) -> Iterator[bytes]:
        """A chunk per transaction: a long download holds no lock between chunks."""
        last = 0
        while True:
            with self._tx() as cur:
                rows = self._chunk(cur, batch_id, kind, last)
            if not rows:
                return
            last = rows[-1][0]
            yield from (line for _, line in rows)


class _Refused(Exception):
    """The load found problems: its transaction is rolled back."""
