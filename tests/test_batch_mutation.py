"""The batch service's pure rules that a mutation run (`python -m bench mutants`) found
unheld by their own tests, each pinned here."""

from __future__ import annotations

import json

from sglang_farm.batch.capacity import (
    DEFAULT_MAX_RUNNING,
    MIN_SHARE,
    Throttle,
    target,
    workers_from_status,
)
from sglang_farm.batch.lifecycle import parse_window
from sglang_farm.batch.requeststate import RequestState, after_attempt
from sglang_farm.batch.retry import MAX_BACKOFF_S, Outcome, backoff, classify_status
from sglang_farm.batch.validate import MAX_CUSTOM_ID, Request, check_line, validate_lines

CHAT = "/v1/chat/completions"


def line(cid: str) -> str:
    return json.dumps(
        {"custom_id": cid, "method": "POST", "url": CHAT, "body": {"messages": [{"role": "user"}]}}
    )


def test_a_custom_id_of_the_longest_length_is_accepted() -> None:
    assert isinstance(check_line(1, line("x" * MAX_CUSTOM_ID), CHAT), Request)
    assert isinstance(check_line(1, line("x" * (MAX_CUSTOM_ID + 1)), CHAT), list)


def test_a_blank_line_in_the_middle_does_not_end_the_file() -> None:
    got = validate_lines([line("a"), "", line("b")], CHAT)
    assert [(r.line, r.custom_id) for r in got if isinstance(r, Request)] == [(1, "a"), (3, "b")]


def test_every_unit_of_a_completion_window() -> None:
    assert (parse_window("2s"), parse_window("2m"), parse_window("2h")) == (2, 120, 7200)
    assert parse_window("1h") == 3600  # one of a unit is a window


def test_an_answer_waits_for_nothing() -> None:
    assert after_attempt(Outcome.SUCCESS, 0, max_attempts=3, backoff_s=1).delay_s == 0.0
    assert after_attempt(Outcome.FAIL, 0, max_attempts=3, backoff_s=1).delay_s == 0.0
    assert after_attempt(Outcome.RETRY, 2, max_attempts=3, backoff_s=1).state is (
        RequestState.FAILED
    )


def test_the_back_off_stops_at_a_minute_and_2xx_is_every_success() -> None:
    assert MAX_BACKOFF_S == 60.0  # docs/batch.md and docs/config.md say "at most 60 s"
    assert backoff(7, 1.0) == 60.0 and backoff(6, 1.0) == 32.0
    assert classify_status(299)[0] is Outcome.SUCCESS
    assert classify_status(300)[0] is Outcome.FAIL


def test_the_documented_defaults_of_capacity() -> None:
    assert DEFAULT_MAX_RUNNING == 32  # docs/config.md: "32 for a worker that does not set it"
    t = Throttle()
    for i in range(10):
        t = t.overload(float(i * 2))
    assert t.share == MIN_SHARE == 1 / 16
    assert target(576, t, None) == 36


def test_a_malformed_worker_entry_is_skipped_and_the_rest_read() -> None:
    status = {"workers": [{"id": "x"}, "junk", {"id": 1, "state": "ready", "in_gateway": True}]}
    workers, _, _ = workers_from_status(status, {})
    assert [w.id for w in workers] == [1]


def test_a_full_share_is_left_as_it_is_and_one_slot_serves() -> None:
    assert Throttle().ok(5.0) == Throttle()
    assert target(1, Throttle(), None) == 1
