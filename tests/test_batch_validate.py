"""Pure: the batch input's validation (`sglang_farm.batch.validate`): every bad line is
named with its line number, the field and what to write; duplicates are refused."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_farm.batch.validate import Problem, Request, check_line, validate_lines

CHAT = "/v1/chat/completions"


def line(**over: object) -> str:
    doc: dict[str, object] = {
        "custom_id": "a",
        "method": "POST",
        "url": CHAT,
        "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    }
    for k, v in over.items():
        if v is None:
            doc.pop(k)
        else:
            doc[k] = v
    return json.dumps(doc)


def problems_of(text: str, endpoint: str = CHAT) -> list[tuple[str | None, str]]:
    got = check_line(7, text, endpoint)
    assert isinstance(got, list), got
    assert all(p.line == 7 for p in got)
    return [(p.param, p.message) for p in got]


def test_a_good_line_is_a_request_with_its_body_as_json() -> None:
    got = check_line(1, line(), CHAT)
    assert isinstance(got, Request)
    assert (got.line, got.custom_id, got.url) == (1, "a", CHAT)
    assert json.loads(got.body)["messages"][0]["content"] == "hi"


def test_blank_lines_are_skipped() -> None:
    assert check_line(1, "   \n", CHAT) is None
    assert check_line(1, b"\n", CHAT) is None


def test_each_kind_of_bad_line_is_named_with_its_field_and_fix() -> None:
    assert problems_of("{oops")[0][0] is None and "not JSON" in problems_of("{oops")[0][1]
    assert "one JSON object per line" in problems_of("{oops")[0][1]
    assert "expected a JSON object" in problems_of("[1, 2]")[0][1]
    assert problems_of(line(custom_id=None))[0][0] == "custom_id"
    assert problems_of(line(custom_id=""))[0][0] == "custom_id"
    assert problems_of(line(custom_id=5))[0][0] == "custom_id"
    assert "shorten" in problems_of(line(custom_id="x" * 513))[0][1]
    assert problems_of(line(method="GET"))[0] == ("method", "must be 'POST', got 'GET'")
    param, msg = problems_of(line(url="/v1/completions"))[0]
    assert param == "url" and "split the file by url" in msg
    assert problems_of(line(body=None))[0][0] == "body"
    assert problems_of(line(body={"messages": []}))[0][0] == "body.messages"
    assert isinstance(
        check_line(7, line(url="/v1/completions", body={"prompt": "x"}), "/v1/completions"), Request
    )
    assert problems_of(line(url="/v1/completions", body={"x": 1}), "/v1/completions")[0][0] == (
        "body.prompt"
    )
    stream = problems_of(line(body={"messages": [{"role": "user"}], "stream": True}))
    assert stream[0][0] == "body.stream" and "cannot stream" in stream[0][1]
    assert problems_of(line(extra=1))[0][0] == "extra"


def test_every_problem_of_one_line_is_listed() -> None:
    got = problems_of(line(custom_id=None, method="PUT", url="/x", body=[]))
    assert [p for p, _ in got] == ["custom_id", "method", "url", "body"]


def test_not_utf8_is_named() -> None:
    got = check_line(3, b'{"custom_id": "\xff"}', CHAT)
    assert isinstance(got, list) and "UTF-8" in got[0].message and got[0].line == 3


def test_a_file_with_bad_lines_lists_every_one_and_no_request() -> None:
    text = [
        line(custom_id="a"),
        "nope",
        line(custom_id="b"),
        line(custom_id="a"),
        line(method="GET", custom_id="c"),
    ]
    got = validate_lines(text, CHAT)
    assert all(isinstance(p, Problem) for p in got)
    assert [(p.line, p.param) for p in got if isinstance(p, Problem)] == [
        (2, None),
        (4, "custom_id"),
        (5, "method"),
    ]
    dup = got[1]
    assert isinstance(dup, Problem) and dup.code == "duplicate_custom_id"
    assert "first on line 1" in dup.message


def test_an_empty_file_and_an_unknown_endpoint_are_refused() -> None:
    (empty,) = validate_lines(["", "  "], CHAT)
    assert isinstance(empty, Problem) and "no requests" in empty.message
    (bad,) = validate_lines([line()], "/v1/embeddings")
    assert isinstance(bad, Problem) and bad.param == "endpoint"


ids = st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=30)


@settings(max_examples=200, database=None, deadline=None)
@given(ids)
def test_a_file_is_accepted_exactly_when_its_ids_are_unique(custom_ids: list[str]) -> None:
    got = validate_lines([line(custom_id=c) for c in custom_ids], CHAT)
    if len(set(custom_ids)) == len(custom_ids):
        assert [r.custom_id for r in got if isinstance(r, Request)] == custom_ids
    else:
        assert all(isinstance(p, Problem) and p.code == "duplicate_custom_id" for p in got)
        assert len(got) == len(custom_ids) - len(set(custom_ids))
