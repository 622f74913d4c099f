"""Pure: one request's states and what an attempt's outcome makes of it.

pending -> in_flight (claimed by one runner, with a lease) -> completed | failed, or
back to pending (a retry, after a back-off) while attempts remain. A request whose
runner died while it was in flight is claimed again when its lease passes (or at once by
the same instance's next start): the engine may see it twice, the store records one
result, because a result is written only by the claim that holds it (`sqlstore`).
An attempt is counted when its outcome is known; one cut short by a crash is not.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from sglang_farm.batch.retry import Outcome, backoff


class RequestState(StrEnum):
    PENDING = "pending"
    IN_FLIGHT = "in_flight"
    COMPLETED = "completed"
    FAILED = "failed"


FINISHED = frozenset({RequestState.COMPLETED, RequestState.FAILED})


@dataclass(frozen=True, slots=True)
class Next:
    """What to record for an attempt: the state, the attempts counted, and for a retry
    the seconds to wait before the next attempt."""

    state: RequestState
    attempts: int
    delay_s: float = 0.0
    gave_up: bool = False  # failed because the attempts ran out (not the engine's answer)


def after_attempt(outcome: Outcome, attempts: int, *, max_attempts: int, backoff_s: float) -> Next:
    """The request's next state after one more attempt (`attempts` counted before it)."""
    n = attempts + 1
    if outcome is Outcome.SUCCESS:
        return Next(RequestState.COMPLETED, n)
    if outcome is Outcome.FAIL:
        return Next(RequestState.FAILED, n)
    if n >= max_attempts:
        return Next(RequestState.FAILED, n, gave_up=True)
    return Next(RequestState.PENDING, n, backoff(n, backoff_s))
