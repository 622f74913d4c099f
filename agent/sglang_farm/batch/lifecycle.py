"""Pure: a batch's status machine, OpenAI's lifecycle.

validating -> in_progress | failed (the input refused); in_progress -> finalizing (every
request answered) -> completed; in_progress -> expired (its completion window passed:
the results so far are kept, the rest go to the error file as `batch_expired`);
in_progress | validating -> cancelling (a cancel) -> cancelled (once nothing is in
flight; results kept, the rest in the error file as `batch_cancelled`).
`step` is the one decision the runner asks of a live batch on each pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class BatchStatus(StrEnum):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


TERMINAL = frozenset(
    {BatchStatus.FAILED, BatchStatus.COMPLETED, BatchStatus.EXPIRED, BatchStatus.CANCELLED}
)

ALLOWED: dict[BatchStatus, frozenset[BatchStatus]] = {
    BatchStatus.VALIDATING: frozenset(
        {BatchStatus.IN_PROGRESS, BatchStatus.FAILED, BatchStatus.CANCELLING}
    ),
    BatchStatus.IN_PROGRESS: frozenset(
        {BatchStatus.FINALIZING, BatchStatus.EXPIRED, BatchStatus.CANCELLING}
    ),
    BatchStatus.FINALIZING: frozenset({BatchStatus.COMPLETED}),
    BatchStatus.CANCELLING: frozenset({BatchStatus.CANCELLED}),
    BatchStatus.FAILED: frozenset(),
    BatchStatus.COMPLETED: frozenset(),
    BatchStatus.EXPIRED: frozenset(),
    BatchStatus.CANCELLED: frozenset(),
}

# The batch object's timestamp field each status sets when entered.
STAMP: dict[BatchStatus, str] = {
    BatchStatus.IN_PROGRESS: "in_progress_at",
    BatchStatus.FAILED: "failed_at",
    BatchStatus.FINALIZING: "finalizing_at",
    BatchStatus.COMPLETED: "completed_at",
    BatchStatus.EXPIRED: "expired_at",
    BatchStatus.CANCELLING: "cancelling_at",
    BatchStatus.CANCELLED: "cancelled_at",
}


def allowed(old: BatchStatus, new: BatchStatus) -> bool:
    return new in ALLOWED[old]


def can_cancel(status: BatchStatus) -> bool:
    return allowed(status, BatchStatus.CANCELLING)


@dataclass(frozen=True, slots=True)
class Progress:
    """What the store counts of one batch's requests."""

    total: int
    completed: int
    failed: int
    in_flight: int

    @property
    def unfinished(self) -> int:
        """Pending or in flight: not answered yet."""
        return self.total - self.completed - self.failed


def step(status: BatchStatus, p: Progress, *, now: float, expires_at: float) -> BatchStatus | None:
    """The status a live batch moves to now, or None to stay.

    An in-progress batch whose every request is answered finalizes, even past its window
    (nothing is left to lose); one with requests left past its window expires. A
    cancelling batch is cancelled once nothing is in flight (answers on the way are kept).
    A finalizing batch completes (the output files are the store's rows: nothing to write).
    """
    if status is BatchStatus.IN_PROGRESS:
        if p.unfinished == 0:
            return BatchStatus.FINALIZING
        if now >= expires_at:
            return BatchStatus.EXPIRED
        return None
    if status is BatchStatus.FINALIZING:
        return BatchStatus.COMPLETED
    if status is BatchStatus.CANCELLING:
        return BatchStatus.CANCELLED if p.in_flight == 0 else None
    return None


_WINDOW_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_window(text: object) -> float | None:
    """`completion_window` in seconds: OpenAI's "24h", or any "<n>s|m|h|d" (this service
    honours shorter ones too); None when not of that form."""
    if not isinstance(text, str) or len(text) < 2 or text[-1] not in _WINDOW_UNITS:
        return None
    number = text[:-1]
    if not number.isdigit() or int(number) <= 0:
        return None
    return float(int(number) * _WINDOW_UNITS[text[-1]])
