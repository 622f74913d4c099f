"""Pure: the batch's status machine (`lifecycle`), one request's states (`requeststate`),
the retry classification and back-off (`retry`)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_farm.batch.lifecycle import (
    ALLOWED,
    TERMINAL,
    BatchStatus,
    Progress,
    allowed,
    can_cancel,
    parse_window,
    step,
)
from sglang_farm.batch.requeststate import RequestState, after_attempt
from sglang_farm.batch.retry import (
    MAX_BACKOFF_S,
    Outcome,
    Reason,
    backoff,
    classify_status,
    overloaded,
)

S = BatchStatus


def test_openais_lifecycle_is_the_only_way_through() -> None:
    assert allowed(S.VALIDATING, S.IN_PROGRESS) and allowed(S.VALIDATING, S.FAILED)
    assert allowed(S.IN_PROGRESS, S.FINALIZING) and allowed(S.FINALIZING, S.COMPLETED)
    assert allowed(S.IN_PROGRESS, S.EXPIRED)
    assert allowed(S.IN_PROGRESS, S.CANCELLING) and allowed(S.CANCELLING, S.CANCELLED)
    assert not allowed(S.IN_PROGRESS, S.COMPLETED)
    assert not allowed(S.CANCELLING, S.IN_PROGRESS)
    for end in TERMINAL:
        assert ALLOWED[end] == frozenset()
    assert can_cancel(S.VALIDATING) and can_cancel(S.IN_PROGRESS)
    assert not can_cancel(S.FINALIZING) and not can_cancel(S.COMPLETED)


def test_a_batch_finalizes_when_every_request_has_its_answer() -> None:
    assert step(S.IN_PROGRESS, Progress(10, 9, 1, 0), now=0, expires_at=100) is S.FINALIZING
    assert step(S.IN_PROGRESS, Progress(10, 8, 1, 1), now=0, expires_at=100) is None
    assert step(S.FINALIZING, Progress(10, 9, 1, 0), now=0, expires_at=100) is S.COMPLETED


def test_a_batch_past_its_window_expires_unless_it_is_done() -> None:
    assert step(S.IN_PROGRESS, Progress(10, 5, 0, 2), now=100, expires_at=100) is S.EXPIRED
    assert step(S.IN_PROGRESS, Progress(10, 10, 0, 0), now=200, expires_at=100) is S.FINALIZING


def test_a_cancelling_batch_waits_for_what_is_in_flight() -> None:
    assert step(S.CANCELLING, Progress(10, 5, 0, 3), now=0, expires_at=100) is None
    assert step(S.CANCELLING, Progress(10, 5, 0, 0), now=0, expires_at=100) is S.CANCELLED


@settings(max_examples=300, database=None)
@given(
    st.sampled_from(list(S)),
    st.integers(0, 50),
    st.integers(0, 50),
    st.integers(0, 50),
    st.integers(0, 50),
    st.floats(0, 200),
)
def test_step_only_takes_allowed_transitions(
    status: S, completed: int, failed: int, in_flight: int, left: int, now: float
) -> None:
    p = Progress(completed + failed + in_flight + left, completed, failed, in_flight)
    new = step(status, p, now=now, expires_at=100)
    assert new is None or allowed(status, new)
    if status in TERMINAL or status is S.VALIDATING:
        assert new is None


def test_completion_windows() -> None:
    assert parse_window("24h") == 86400
    assert parse_window("90s") == 90 and parse_window("2d") == 172800
    for bad in ("", "h", "0h", "-1h", "1.5h", "24", 24, None, "24w"):
        assert parse_window(bad) is None


@pytest.mark.parametrize(
    ("status", "outcome", "reason"),
    [
        (200, Outcome.SUCCESS, None),
        (400, Outcome.FAIL, None),  # over the context length, a bad body
        (404, Outcome.FAIL, None),
        (413, Outcome.FAIL, None),
        (422, Outcome.FAIL, None),
        (408, Outcome.RETRY, Reason.TIMEOUT),
        (429, Outcome.RETRY, Reason.RATE_LIMITED),
        (500, Outcome.RETRY, Reason.SERVER_ERROR),
        (502, Outcome.RETRY, Reason.SERVER_ERROR),
        (503, Outcome.RETRY, Reason.UNAVAILABLE),  # a drain, nothing routable
        (504, Outcome.RETRY, Reason.SERVER_ERROR),
    ],
)
def test_the_engine_s_answer_is_classified(
    status: int, outcome: Outcome, reason: Reason | None
) -> None:
    assert classify_status(status) == (outcome, reason)


def test_only_429_and_503_say_the_farm_is_full() -> None:
    assert overloaded(429) and overloaded(503)
    assert not overloaded(500) and not overloaded(400) and not overloaded(200)


def test_backoff_doubles_and_is_capped() -> None:
    assert [backoff(n, 1.0) for n in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 8.0]
    assert backoff(30, 1.0) == MAX_BACKOFF_S
    assert backoff(3, 0.0) == 0.0


def test_a_request_is_retried_until_its_attempts_are_used_up() -> None:
    n = after_attempt(Outcome.RETRY, 0, max_attempts=3, backoff_s=1.0)
    assert (n.state, n.attempts, n.delay_s, n.gave_up) == (RequestState.PENDING, 1, 1.0, False)
    n = after_attempt(Outcome.RETRY, 1, max_attempts=3, backoff_s=1.0)
    assert (n.state, n.attempts, n.delay_s) == (RequestState.PENDING, 2, 2.0)
    n = after_attempt(Outcome.RETRY, 2, max_attempts=3, backoff_s=1.0)
    assert (n.state, n.attempts, n.gave_up) == (RequestState.FAILED, 3, True)


def test_an_answer_ends_the_request_whatever_the_attempts() -> None:
    assert (
        after_attempt(Outcome.SUCCESS, 4, max_attempts=5, backoff_s=1).state
        is RequestState.COMPLETED
    )
    fail = after_attempt(Outcome.FAIL, 0, max_attempts=5, backoff_s=1)
    assert (fail.state, fail.gave_up) == (RequestState.FAILED, False)


@settings(max_examples=200, database=None)
@given(st.integers(1, 20), st.lists(st.sampled_from(list(Outcome)), min_size=1, max_size=40))
def test_no_request_is_tried_more_than_max_attempts(
    max_attempts: int, outcomes: list[Outcome]
) -> None:
    attempts = 0
    for o in outcomes:
        n = after_attempt(o, attempts, max_attempts=max_attempts, backoff_s=0.5)
        attempts = n.attempts
        assert attempts <= max_attempts
        if n.state is not RequestState.PENDING:
            break
    else:
        return
    assert n.state in (RequestState.COMPLETED, RequestState.FAILED)
