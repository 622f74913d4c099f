"""Pure: the store's contract (one Protocol) and the rows it hands out.

Both backends (`sqlite`, `postgres`, sharing `sqlstore`) keep every request's state in
the database; a runner claims requests (`claim`), and a result is recorded only by the
claim that holds the request (`finish`, `retry_later` return False otherwise), so each
request has at most one result, and a batch finalizes only when every request has one:
each `custom_id` exactly once in the output and error files, which are read from the
rows (`result_lines`), never written beside them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from sglang_farm.batch.lifecycle import BatchStatus, Progress
from sglang_farm.batch.validate import Problem, Request


class StoreError(Exception):
    """The store could not do what was asked (its message says what and where)."""


class StoreFull(StoreError):
    """The store's disk (or its database) is full: nothing was written."""


class NotFound(StoreError):
    pass


@dataclass(frozen=True, slots=True)
class FileRow:
    id: str
    purpose: str
    filename: str
    bytes: int
    created_at: float
    # "input" (uploaded, its bytes in the service's state dir), "output" or "error"
    # (read from the batch's rows).
    kind: str = "input"
    batch_id: str | None = None


@dataclass(frozen=True, slots=True)
class BatchRow:
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: BatchStatus
    created_at: float
    expires_at: float
    metadata: Mapping[str, str] | None = None
    errors: tuple[Mapping[str, object], ...] = ()
    output_file_id: str | None = None
    error_file_id: str | None = None
    stamps: Mapping[str, float] | None = None  # in_progress_at, ... (lifecycle.STAMP)
    total: int = 0
    completed: int = 0
    failed: int = 0
    in_flight: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def progress(self) -> Progress:
        return Progress(self.total, self.completed, self.failed, self.in_flight)


@dataclass(frozen=True, slots=True)
class Claimed:
    """A request this runner holds (its `token`) until it records the attempt's outcome."""

    batch_id: str
    line: int
    custom_id: str
    url: str
    body: str
    attempts: int
    token: str


@dataclass(frozen=True, slots=True)
class Result:
    """An attempt's recorded outcome: the answer (status, request id, body as JSON text),
    or an error (code, message), with the tokens used."""

    status_code: int | None
    request_id: str | None
    body: str | None
    error_code: str | None = None
    error_message: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Attempt:
    """One attempt's outcome for a claimed request: `state` "completed" or "failed" with
    its `result`, or "pending" (a retry at `retry_at`, for `reason`)."""

    claim: Claimed
    state: str
    attempts: int
    result: Result | None = None
    reason: str | None = None
    retry_at: float = 0.0


class Store(Protocol):
    """One contract, two backends; tests/test_batch_store.py runs it on both."""

    def close(self) -> None: ...

    # Files
    def add_file(self, row: FileRow) -> None: ...
    def file(self, file_id: str) -> FileRow: ...
    def files(self, *, purpose: str | None = None, limit: int = 10000) -> list[FileRow]: ...
    def delete_file(self, file_id: str) -> None: ...

    # Batches
    def add_batch(self, row: BatchRow) -> None: ...
    def batch(self, batch_id: str) -> BatchRow: ...
    def batches(self, *, after: str | None = None, limit: int = 20) -> list[BatchRow]: ...
    def live_batches(self) -> list[BatchRow]: ...
    def load(
        self, batch_id: str, requests: Iterable[Request | list[Problem]], *, now: float
    ) -> Sequence[Problem]:
        """Validating -> in_progress with every request, in one transaction; or, with any
        problem (a bad line, a duplicate custom_id), -> failed, no request kept."""
        ...

    def set_status(self, batch_id: str, old: BatchStatus, new: BatchStatus, *, now: float) -> bool:
        """Move a batch from `old` to `new` (False: it was not in `old`). Expired and
        cancelled fail every unfinished request (`batch_expired`, `batch_cancelled`);
        completed and those two give the batch its output and error file ids."""
        ...

    # Requests
    def claim(self, owner: str, n: int, *, now: float, lease_s: float) -> list[Claimed]: ...

    sole_claimant: bool
    """True where one service alone claims from the store (the embedded SQLite, held by
    its lock file); False where services on several hosts share it (PostgreSQL)."""

    def release_owner(self, owner: str) -> int:
        """What this owner held in flight when it died goes back to pending."""
        ...

    def release_at_start(self, owner: str) -> int:
        """At the service's start: what a dead process held in flight goes back to pending
        at once, not after its lease: every claim where the store is `sole_claimant`
        (an owner file lost or rewritten changes nothing), else this owner's own."""
        ...

    def record(self, outcomes: Sequence[Attempt], *, now: float) -> list[bool]:
        """Every attempt's outcome in one transaction (a group commit); each True where it
        was recorded, False where the claim no longer held the request (another runner
        took it over after the lease, the batch was cancelled or expired)."""
        ...

    def exchange(
        self, outcomes: Sequence[Attempt], owner: str, n: int, *, now: float, lease_s: float
    ) -> tuple[list[bool], list[Claimed]]:
        """`record(outcomes)` and `claim(owner, n)` in one transaction (one commit, one
        fsync): the runner gives back the slots its answers freed and takes as many
        requests again in one step. All or nothing: on an error neither happened."""
        ...

    def result_lines(self, batch_id: str, kind: str) -> Iterator[bytes]:
        """The output ("output": completed) or error ("error": failed) file's lines."""
        ...
