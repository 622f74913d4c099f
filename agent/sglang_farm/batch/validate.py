"""Pure: an input file's lines -> the requests they ask for, or every bad line named.

A line of OpenAI's batch input is one JSON object `{"custom_id", "method", "url", "body"}`.
`check_line` judges one line alone (its number, the field at fault, what to write instead);
`validate_lines` runs it over a whole file and adds the one rule that needs the whole file:
each `custom_id` once. The store's loader (`sqlstore`) applies the same rule through the
database's uniqueness instead of a set, so a million-line file does not hold every id in
memory; both word the problem with `duplicate_problem`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
MAX_CUSTOM_ID = 512
_KEYS = frozenset({"custom_id", "method", "url", "body"})


@dataclass(frozen=True, slots=True)
class Request:
    """One valid input line: its 1-based line number and what to send (body as JSON text)."""

    line: int
    custom_id: str
    method: str
    url: str
    body: str


@dataclass(frozen=True, slots=True)
class Problem:
    """One bad line: OpenAI's batch error shape (`code`, `message`, `param`, `line`)."""

    line: int | None
    param: str | None
    message: str
    code: str = "invalid_request"

    def to_dict(self) -> dict[str, object]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


def check_line(line: int, raw: bytes | str, endpoint: str) -> Request | list[Problem] | None:
    """One line judged alone: a `Request`, the line's problems, or None for a blank line."""
    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            return [
                Problem(line, None, f"not UTF-8 text (byte {exc.start}); save the file as UTF-8")
            ]
    else:
        text = raw
    if not text.strip():
        return None
    try:
        doc = json.loads(text)
    except ValueError as exc:
        return [
            Problem(
                line,
                None,
                f"not JSON ({exc}); write one JSON object per line: "
                '{"custom_id": "...", "method": "POST", "url": "' + endpoint + '", "body": {...}}',
            )
        ]
    if not isinstance(doc, dict):
        return [Problem(line, None, f"expected a JSON object, got {type(doc).__name__}")]
    problems: list[Problem] = []
    for key in sorted(set(doc) - _KEYS):
        problems.append(
            Problem(line, key, f"unknown field {key!r}; a line has custom_id, method, url, body")
        )
    cid = doc.get("custom_id")
    if not isinstance(cid, str) or not cid:
        problems.append(
            Problem(
                line, "custom_id", "missing or not a non-empty string; give each line its own id"
            )
        )
    elif len(cid) > MAX_CUSTOM_ID:
        problems.append(
            Problem(line, "custom_id", f"longer than {MAX_CUSTOM_ID} characters; shorten it")
        )
    method = doc.get("method")
    if method != "POST":
        problems.append(Problem(line, "method", f"must be 'POST', got {method!r}"))
    url = doc.get("url")
    if url != endpoint:
        problems.append(
            Problem(
                line,
                "url",
                f"must be the batch's endpoint {endpoint!r}, got {url!r}; one batch serves one "
                "endpoint: split the file by url",
            )
        )
    body = doc.get("body")
    if not isinstance(body, dict):
        problems.append(Problem(line, "body", "missing or not a JSON object (the request's body)"))
    else:
        problems.extend(_check_body(line, body, endpoint))
    if problems:
        return problems
    assert isinstance(cid, str) and isinstance(body, dict)
    return Request(line, cid, "POST", endpoint, json.dumps(body, separators=(",", ":")))


def _check_body(line: int, body: dict[str, object], endpoint: str) -> list[Problem]:
    out: list[Problem] = []
    if endpoint == "/v1/chat/completions":
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            out.append(
                Problem(line, "body.messages", "missing or empty; a chat request needs messages")
            )
    elif "prompt" not in body:
        out.append(Problem(line, "body.prompt", "missing; a completion request needs a prompt"))
    if body.get("stream"):
        out.append(
            Problem(
                line, "body.stream", "a batch request cannot stream; remove stream or set false"
            )
        )
    return out


def duplicate_problem(line: int, custom_id: str, first: int) -> Problem:
    return Problem(
        line,
        "custom_id",
        f"duplicate custom_id {custom_id!r} (first on line {first}); each line needs its own id",
        code="duplicate_custom_id",
    )


def validate_lines(lines: Iterable[bytes | str], endpoint: str) -> list[Request] | list[Problem]:
    """A whole file: every request, or every problem (each bad line, each duplicate id)."""
    if endpoint not in ENDPOINTS:
        return [Problem(None, "endpoint", f"must be one of {', '.join(ENDPOINTS)}")]
    requests: list[Request] = []
    problems: list[Problem] = []
    seen: dict[str, int] = {}
    for n, raw in enumerate(lines, start=1):
        got = check_line(n, raw, endpoint)
        if got is None:
            continue
        if isinstance(got, list):
            problems.extend(got)
            continue
        first = seen.setdefault(got.custom_id, n)
        if first != n:
            problems.append(duplicate_problem(n, got.custom_id, first))
        else:
            requests.append(got)
    if problems:
        return problems
    if not requests:
        return [empty_problem()]
    return requests


def empty_problem() -> Problem:
    return Problem(None, None, "the file holds no requests; write one JSON object per line")
