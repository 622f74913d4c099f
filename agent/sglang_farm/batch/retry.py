"""Pure: an attempt's outcome classified, and the back-off between attempts.

A 2xx is a result. What the farm did to the request (a worker that died, a drain, a
restart in a wave, a gateway with nowhere to route) shows as a connection error, a
timeout, a 5xx, 429 or 408, or smg's 404 "No worker available for model ..." (its answer
while no worker is routable: all drained, or restarting in a wave; `unroutable`): retried,
with bounded attempts. What the engine said about the request itself (a prompt over the
context length, a bad body: 400, any other 404, 413, 422 and the other 4xx) would get the
same answer again: that request's line in the error file, the batch goes on. 429 and 503
also tell `capacity` the farm is full (`overloaded`). 401 and 403 say the front door
refuses the service's own key (`[batch] gateway_key_file`): no request's fault, so the
runner pauses and counts no attempt (`uncounted`).
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
    UNAUTHORIZED = "unauthorized"  # 401, 403: the front door refuses the service's key
    UNROUTABLE = "unroutable"  # smg's 404 "No worker available": nothing routable now


_RETRY_STATUS = {
    401: Reason.UNAUTHORIZED,
    403: Reason.UNAUTHORIZED,
    408: Reason.TIMEOUT,
    429: Reason.RATE_LIMITED,
    503: Reason.UNAVAILABLE,
}


def classify_status(status: int) -> tuple[Outcome, Reason | None]:
    """An HTTP answer's status -> what to do with the request."""
    if 200 <= status < 300:
        return Outcome.SUCCESS, None
    if status in _RETRY_STATUS:
        return Outcome.RETRY, _RETRY_STATUS[status]
    if status >= 500:
        return Outcome.RETRY, Reason.SERVER_ERROR
    return Outcome.FAIL, None


# smg 1.13's words when it has no worker to route the request's model to (404, error code
# model_not_found): its workers are drained, restarting, or not added yet.
SMG_NO_WORKER = "No worker available"


def unroutable(status: int, error_code: object, message: object) -> bool:
    """smg's answer that no worker is routable for the model now: the farm's moment, not
    the request's fault (a model the farm never serves gets the same answer, and so ends
    as `attempts_exhausted` naming it)."""
    return (
        status == 404
        and error_code == "model_not_found"
        and isinstance(message, str)
        and message.startswith(SMG_NO_WORKER)
    )


def uncounted(reason: Reason | None) -> bool:
    """An outcome that says nothing about the request (the service's key was refused):
    no attempt is counted, and the runner pauses."""
    return reason is Reason.UNAUTHORIZED


def overloaded(status: int) -> bool:
    """An answer that says the farm cannot take more now (the runner sends fewer)."""
    return status in (429, 503)


def backoff(attempts: int, base_s: float) -> float:
    """Seconds before attempt `attempts + 1`: base, 2x, 4x ..., at most `MAX_BACKOFF_S`."""
    if base_s <= 0:
        return 0.0
    return float(min(MAX_BACKOFF_S, base_s * 2 ** max(0, attempts - 1)))
