"""Pure: the half of the control wire format that farmctl needs (protocol version 1).

Request lines out, reply lines in (`Reply`), and JSON with bounded numbers for both
directions. `codec` (the agent's side) builds on it. It imports only `json`, `math` and
`errors`, and defines no dataclass or enum: farmctl imports it on every run, and
dataclass and enum creation at import cost more than the rest of a `farmctl status`
(docs/benchmarks.md, "Where the time goes").
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Final

from sglang_farm.errors import ProtocolError

RequestId = int | str | None

# The error code of a line that is not a JSON object (codec.ErrorCode.BAD_JSON).
BAD_JSON: Final = "bad_json"

# The error code of an operation the agent tried and the runtime refused or failed
# (codec.ErrorCode.FAILED).
FAILED: Final = "failed"

# What holds a farm that will not settle by itself (`settled`'s `failures[].kind`), in the
# order `farmctl wait` names them (its exit code is the first one's:
# docs/control-protocol.md). Named once: control.settled builds them, farmctl maps each to
# its exit.
STAGE_FAILED: Final = "stage_failed"
ROLLOUT_HALTED: Final = "rollout_halted"
CANARY_ROLLED_BACK: Final = "canary_rolled_back"
CANARY_HELD: Final = "canary_held"
HOST_DRAINED: Final = "host_drained"
WORKER_FAILED: Final = "worker_failed"
WORKER_QUARANTINED: Final = "worker_quarantined"
FAILURE_KINDS: Final = (
    STAGE_FAILED,
    ROLLOUT_HALTED,
    CANARY_ROLLED_BACK,
    CANARY_HELD,
    HOST_DRAINED,
    WORKER_FAILED,
    WORKER_QUARANTINED,
)

# Every protocol integer (worker ids, line counts, request ids) fits in 64 bits: 20
# digits. Longer literals are refused before int() sees them: CPython's int() raises a
# bare ValueError past 4,300 digits (outside json's own errors) and is quadratic below.
MAX_INT_DIGITS: Final = 20


class NumberError(ValueError):
    """A number literal outside what the protocol carries (see `loads`)."""


def _parse_int(literal: str) -> int:
    if len(literal.lstrip("-")) > MAX_INT_DIGITS:
        raise NumberError(
            f"an integer of {len(literal.lstrip('-'))} digits; numbers in a request "
            f"have at most {MAX_INT_DIGITS}"
        )
    return int(literal)


def _parse_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):  # 1e400 parses to inf
        raise NumberError(
            f"the number {literal[:32]!r}, out of range; numbers in a request are finite"
        )
    return value


def _parse_constant(literal: str) -> float:
    # json accepts NaN, Infinity and -Infinity, which are not JSON (RFC 8259 section 6).
    raise NumberError(f"the number {literal!r}; numbers in a request are finite")


def loads(text: str) -> object:
    """`json.loads`, raising `NumberError` for huge or non-finite numbers."""
    return json.loads(
        text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant
    )


def line(obj: Mapping[str, object]) -> bytes:
    """One wire line. ensure_ascii keeps every line plain ASCII whatever bytes a log held."""
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode("ascii") + b"\n"


def encode_request(rid: RequestId, cmd: str, args: Mapping[str, object] | None = None) -> bytes:
    return line({"id": rid, "cmd": cmd, "args": dict(args or {})})


class Reply:
    """One reply line. `stream` is set on stream messages; `error_*` on failures."""

    __slots__ = ("error_code", "error_message", "id", "ok", "payload", "result", "stream")

    def __init__(
        self,
        id: RequestId,
        ok: bool,
        result: object = None,
        stream: str | None = None,
        payload: Mapping[str, object] | None = None,
        error_code: str | None = None,
        error_message: str | None = None,
    ) -> None:
        self.id = id
        self.ok = ok
        self.result = result
        self.stream = stream
        self.payload = payload
        self.error_code = error_code
        self.error_message = error_message

    @property
    def final(self) -> bool:
        return self.stream is None

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__slots__)
        return f"Reply({fields})"


def decode_reply(raw: bytes) -> Reply:
    """Parse one reply line. Raises `ProtocolError` (bad_json) on anything malformed."""
    try:
        obj = loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        # ValueError covers json's JSONDecodeError and `NumberError`.
        raise ProtocolError(BAD_JSON, f"reply is not JSON: {exc}") from exc
    if not isinstance(obj, dict) or not isinstance(obj.get("ok"), bool):
        raise ProtocolError(BAD_JSON, "reply is not an object with 'ok'")
    rid = obj.get("id")
    rid = rid if isinstance(rid, int | str) and not isinstance(rid, bool) else None
    if not obj["ok"]:
        err = obj.get("error")
        if not isinstance(err, dict):
            raise ProtocolError(BAD_JSON, "error reply without 'error'")
        return Reply(
            rid,
            False,
            error_code=str(err.get("code", "")),
            error_message=str(err.get("message", "")),
        )
    stream = obj.get("stream")
    if isinstance(stream, str):
        payload = {k: v for k, v in obj.items() if k not in ("id", "ok", "stream")}
        return Reply(rid, True, stream=stream, payload=payload)
    return Reply(rid, True, result=obj.get("result"))
