"""Pure: an attempt's outcome classified, and the back-off between attempts.

A 2xx is a result. What the farm did to the request (a worker that died, a drain, a
restart in a wave, a gateway with nowhere to route) shows as a connection error, a
timeout, a 5xx, 429 or 408: retried, with bounded attempts. What the engine said about the
request itself (a prompt over the context length, a bad body: 400, 404, 413, 422 and the
other 4xx) would get the same answer again: that request's line in the error file, the
batch goes on. 429 and 503 also tell `capacity` the farm is full (`overloaded`).
"""

from __future__ import annotations

from enum import StrEnum

MAX_BACKOFF_S = 60.0


class Outcome(StrEnum):
    SUCCESS = "success"
    RETRY = "retry"
    FAIL = "fail"


class Reason(StrEnum):
    """Why an attempt is retried (the `reason` label of the retries metric)."""

    CONNECTION = "connection"  # refused, reset, closed mid-answer: a worker or gateway died
    TIMEOUT = "timeout"
    SERVER_ERROR = "server_error"  # 5xx but 503
    UNAVAILABLE = "unavailable"  # 503: draining, nothing routable, overloaded
    RATE_LIMITED = "rate_limited"  # 429
    BAD_ANSWER = "bad_answer"  # a 2xx whose body is not JSON: cut short


_RETRY_STATUS = {408: Reason.TIMEOUT, 429: Reason.RATE_LIMITED, 503: Reason.UNAVAILABLE}


def classify_status(status: int) -> tuple[Outcome, Reason | None]:
    """An HTTP answer's status -> what to do with the request."""
    if 200 <= status < 300:
        return Outcome.SUCCESS, None
    if status in _RETRY_STATUS:
        return Outcome.RETRY, _RETRY_STATUS[status]
    if status >= 500:
        return Outcome.RETRY, Reason.SERVER_ERROR
    return Outcome.FAIL, None


def overloaded(status: int) -> bool:
    """An answer that says the farm cannot take more now (the runner sends fewer)."""
    return status in (429, 503)


def backoff(attempts: int, base_s: float) -> float:
    """Seconds before attempt `attempts + 1`: base, 2x, 4x ..., at most `MAX_BACKOFF_S`."""
    if base_s <= 0:
        return 0.0
    return float(min(MAX_BACKOFF_S, base_s * 2 ** max(0, attempts - 1)))
