"""Pure: the control socket's wire format (protocol version 1).

One UTF-8 JSON object per line, at most `MAX_LINE` bytes before the newline.

    → {"id": 7, "cmd": "restart", "args": {"worker": 3}}
    ← {"id": 7, "ok": true, "result": {...}}
    ← {"id": 7, "ok": false, "error": {"code": "unknown_worker", "message": "..."}}
    ← {"id": 7, "ok": true, "stream": "line", "line": "..."}      (streams, then a final reply)

This module only turns bytes into typed requests (raising `RequestError`, a
`ProtocolError` that remembers the request id when one was readable), replies
into bytes; the client's half (request lines out, reply bytes back into `Reply`,
JSON with bounded numbers) is `wire`, which this module re-exports. farmctl imports
only `wire`, not this module: its dataclasses and enums cost ~8 ms at import.
What the results contain is `results`; who may send what is `auth`; what each
command does is `handlers`. No sockets, no clock.
docs/control-protocol.md is the user-facing description; keep the two in step.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Final, Literal

# The client's half of the format, re-exported: the agent's side and its tests use them.
from sglang_farm.control.wire import MAX_INT_DIGITS as MAX_INT_DIGITS
from sglang_farm.control.wire import NumberError, line, loads
from sglang_farm.control.wire import Reply as Reply
from sglang_farm.control.wire import RequestId as RequestId
from sglang_farm.control.wire import decode_reply as decode_reply
from sglang_farm.control.wire import encode_request as encode_request
from sglang_farm.errors import ProtocolError

PROTOCOL_VERSION: Final = 1
# Bytes before the newline. A status of 8 workers with full failures is ~10 KiB.
MAX_LINE: Final = 64 * 1024
# `logs lines=K` bound: the agent keeps a bounded tail; more is a mistake, not a wish.
MAX_LOG_LINES: Final = 10_000
# `wait-ready timeout=T` bound: a model load is minutes; an hour is past any deadline.
MAX_WAIT_SECONDS: Final = 3600.0


class ErrorCode(StrEnum):
    """The closed set of error codes a reply can carry."""

    BAD_JSON = "bad_json"  # not UTF-8, not JSON, or not a JSON object
    BAD_REQUEST = "bad_request"  # well-formed JSON but a bad shape, bad args, or too long
    UNKNOWN_COMMAND = "unknown_command"
    UNKNOWN_WORKER = "unknown_worker"
    FORBIDDEN = "forbidden"  # the peer's uid/gid may not run this command
    BUSY = "busy"  # another state change on the same worker is in progress
    FAILED = "failed"  # the agent tried and the runtime refused or failed
    INTERNAL = "internal"  # a bug in the agent; details only in its log


class Command(StrEnum):
    STATUS = "status"
    START = "start"
    STOP = "stop"
    RESTART = "restart"
    LOGS = "logs"
    WHY = "why"
    RELOAD = "reload"
    ENDPOINTS = "endpoints"
    VERSION = "version"
    RESET_OOM = "reset-oom"
    WAIT_READY = "wait-ready"
    RELEASE_GPU = "release-gpu"
    SETTLED = "settled"  # issue 26: farmctl wait polls it
    DRAIN_HOST = "drain-host"  # issue 26: the whole host out of the gateway, not stopped
    UNDRAIN_HOST = "undrain-host"


READ_ONLY: Final = frozenset(
    {
        Command.STATUS,
        Command.LOGS,
        Command.WHY,
        Command.ENDPOINTS,
        Command.VERSION,
        Command.WAIT_READY,
        Command.SETTLED,
    }
)
STATE_CHANGING: Final = frozenset(set(Command) - READ_ONLY)


class RequestError(ProtocolError):
    """A request that cannot be served; `request_id` is echoed in the error reply."""

    def __init__(self, code: ErrorCode, message: str, request_id: RequestId = None) -> None:
        super().__init__(str(code), message)
        self.error_code = code
        self.request_id = request_id


# --- typed arguments -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NoArgs:
    pass


@dataclass(frozen=True, slots=True)
class TargetArgs:
    """`start`: one worker id, or every worker."""

    worker: int | Literal["all"]


@dataclass(frozen=True, slots=True)
class StopArgs:
    """`stop`/`restart`: one worker id or every worker; `drain` False skips the gateway drain."""

    worker: int | Literal["all"]
    drain: bool = True


@dataclass(frozen=True, slots=True)
class WorkerArgs:
    """`why`/`reset-oom`: one worker id."""

    worker: int


@dataclass(frozen=True, slots=True)
class LogsArgs:
    worker: int
    lines: int = 100
    follow: bool = False


@dataclass(frozen=True, slots=True)
class WaitArgs:
    """`wait-ready`: `after` (epoch seconds) ignores a ready/failed phase entered before it."""

    worker: int
    timeout: float = 300.0
    after: float = 0.0


@dataclass(frozen=True, slots=True)
class GpuArgs:
    """`release-gpu`: one GPU index (the handler checks that a worker of the farm uses it)."""

    gpu: int


@dataclass(frozen=True, slots=True)
class ReleaseWorkerArgs:
    """`release-gpu` by worker (`{"worker": N}` instead of `{"gpu": G}`): release that
    worker's quarantine whichever GPU it names, after the GPUs the worker uses now pass."""

    worker: int


@dataclass(frozen=True, slots=True)
class DrainHostArgs:
    """`drain-host`: how long to wait for the requests in flight; None: the farm's
    `[gateway] drain_timeout`."""

    timeout: float | None = None


Args = (
    NoArgs
    | TargetArgs
    | StopArgs
    | WorkerArgs
    | LogsArgs
    | WaitArgs
    | GpuArgs
    | ReleaseWorkerArgs
    | DrainHostArgs
)


@dataclass(frozen=True, slots=True)
class Request:
    id: RequestId
    cmd: Command
    args: Args

    @property
    def changes_state(self) -> bool:
        return self.cmd in STATE_CHANGING


# --- decoding requests -----------------------------------------------------------


def decode_request(line: bytes) -> Request:
    """Parse one request line (newline optional). Raises `RequestError`."""
    if len(line.rstrip(b"\r\n")) > MAX_LINE:
        raise RequestError(ErrorCode.BAD_REQUEST, f"request longer than {MAX_LINE} bytes")
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(ErrorCode.BAD_JSON, f"request is not UTF-8 ({exc.reason})") from exc
    try:
        obj = loads(text)
    except NumberError as exc:
        raise RequestError(ErrorCode.BAD_REQUEST, f"request has {exc}") from None
    except (json.JSONDecodeError, RecursionError) as exc:
        where = f" at column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else ""
        raise RequestError(ErrorCode.BAD_JSON, f"request is not valid JSON{where}") from exc
    if not isinstance(obj, dict):
        raise RequestError(
            ErrorCode.BAD_JSON, f"request must be a JSON object, got {_json_type(obj)}"
        )
    return _request_from_obj(obj)


def _request_from_obj(obj: dict[str, object]) -> Request:
    raw_id = obj.get("id")
    if raw_id is not None and (isinstance(raw_id, bool) or not isinstance(raw_id, int | str)):
        raise RequestError(
            ErrorCode.BAD_REQUEST, f"'id' must be an integer or a string, got {_json_type(raw_id)}"
        )
    rid: RequestId = raw_id if isinstance(raw_id, int | str) else None
    extra = sorted(set(obj) - {"id", "cmd", "args"})
    if extra:
        raise RequestError(
            ErrorCode.BAD_REQUEST,
            f"unknown request keys {extra}; a request has 'id', 'cmd' and 'args'",
            rid,
        )
    cmd_raw = obj.get("cmd")
    if not isinstance(cmd_raw, str):
        raise RequestError(ErrorCode.BAD_REQUEST, "'cmd' must be a string", rid)
    try:
        cmd = Command(cmd_raw)
    except ValueError:
        raise RequestError(
            ErrorCode.UNKNOWN_COMMAND,
            f"unknown command {cmd_raw[:64]!r}; commands are {', '.join(c.value for c in Command)}",
            rid,
        ) from None
    args_raw = obj.get("args", {})
    if args_raw is None:
        args_raw = {}
    if not isinstance(args_raw, dict):
        raise RequestError(
            ErrorCode.BAD_REQUEST, f"'args' must be an object, got {_json_type(args_raw)}", rid
        )
    try:
        args = _parse_args(cmd, args_raw)
    except _ArgError as exc:
        raise RequestError(ErrorCode.BAD_REQUEST, f"{cmd}: {exc}", rid) from None
    return Request(rid, cmd, args)


class _ArgError(Exception):
    pass


_ALLOWED: Final[Mapping[Command, frozenset[str]]] = {
    Command.START: frozenset({"worker"}),
    Command.STOP: frozenset({"worker", "drain"}),
    Command.RESTART: frozenset({"worker", "drain"}),
    Command.WHY: frozenset({"worker"}),
    Command.RESET_OOM: frozenset({"worker"}),
    Command.LOGS: frozenset({"worker", "lines", "follow"}),
    Command.WAIT_READY: frozenset({"worker", "timeout", "after"}),
    Command.RELEASE_GPU: frozenset({"gpu", "worker"}),
    Command.DRAIN_HOST: frozenset({"timeout"}),
}


def _parse_args(cmd: Command, args: dict[str, object]) -> Args:
    allowed = _ALLOWED.get(cmd, frozenset())
    extra = sorted(set(args) - allowed)
    if extra:
        accepted = f"accepted: {', '.join(sorted(allowed))}" if allowed else "it takes no arguments"
        raise _ArgError(f"unknown arguments {extra}; {accepted}")
    if cmd is Command.START:
        return TargetArgs(_target(args))
    if cmd in (Command.STOP, Command.RESTART):
        return StopArgs(_target(args), _bool(args, "drain", True))
    if cmd in (Command.WHY, Command.RESET_OOM):
        return WorkerArgs(_worker(args))
    if cmd is Command.LOGS:
        lines = _int(args, "lines", 100, 0, MAX_LOG_LINES)
        return LogsArgs(_worker(args), lines, _bool(args, "follow", False))
    if cmd is Command.WAIT_READY:
        timeout = _number(args, "timeout", 300.0)
        if not 0 < timeout <= MAX_WAIT_SECONDS:
            raise _ArgError(
                f"'timeout' must be in (0, {MAX_WAIT_SECONDS:g}] seconds, got {timeout}"
            )
        after = _number(args, "after", 0.0)
        return WaitArgs(_worker(args), timeout, after)
    if cmd is Command.RELEASE_GPU:
        # One or the other: by GPU (every worker quarantined on it) or by worker.
        if "worker" in args and "gpu" in args:
            raise _ArgError("give 'gpu' (a GPU index) or 'worker' (a worker id), not both")
        if "worker" in args:
            return ReleaseWorkerArgs(_worker(args))
        return GpuArgs(_gpu(args))
    if cmd is Command.DRAIN_HOST:
        if "timeout" not in args:
            return DrainHostArgs()
        timeout = _number(args, "timeout", 0.0)
        if not 0 <= timeout <= MAX_WAIT_SECONDS:
            raise _ArgError(
                f"'timeout' must be in [0, {MAX_WAIT_SECONDS:g}] seconds, got {timeout}"
            )
        return DrainHostArgs(timeout)
    return NoArgs()


def _worker(args: Mapping[str, object]) -> int:
    if "worker" not in args:
        raise _ArgError("missing 'worker' (a worker id)")
    w = args["worker"]
    if isinstance(w, bool) or not isinstance(w, int) or w < 0:
        raise _ArgError(f"'worker' must be a worker id (an integer >= 0), got {w!r}")
    return w


def _gpu(args: Mapping[str, object]) -> int:
    if "gpu" not in args:
        raise _ArgError(
            "missing 'gpu' (a GPU index, as NVML and nvidia-smi number them) or 'worker' "
            "(a worker id)"
        )
    g = args["gpu"]
    if isinstance(g, bool) or not isinstance(g, int) or g < 0:
        raise _ArgError(f"'gpu' must be a GPU index (an integer >= 0), got {g!r}")
    return g


def _target(args: Mapping[str, object]) -> int | Literal["all"]:
    if args.get("worker") == "all":
        return "all"
    try:
        return _worker(args)
    except _ArgError:
        raise _ArgError(
            f"'worker' must be a worker id or \"all\", got {args.get('worker')!r}"
        ) from None


def _int(args: Mapping[str, object], key: str, default: int, lo: int, hi: int) -> int:
    v = args.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise _ArgError(f"{key!r} must be an integer in {lo}..{hi}, got {v!r}")
    return v


def _bool(args: Mapping[str, object], key: str, default: bool) -> bool:
    v = args.get(key, default)
    if not isinstance(v, bool):
        raise _ArgError(f"{key!r} must be true or false, got {v!r}")
    return v


def _number(args: Mapping[str, object], key: str, default: float) -> float:
    v = args.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int | float) or v != v:  # NaN != NaN
        raise _ArgError(f"{key!r} must be a number, got {v!r}")
    return float(v)


def _json_type(v: object) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int | float):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    return "an object"


# --- encoding requests and replies ------------------------------------------------


def encode_ok(rid: RequestId, result: object) -> bytes:
    return line({"id": rid, "ok": True, "result": result})


def encode_error(rid: RequestId, code: ErrorCode, message: str) -> bytes:
    return line({"id": rid, "ok": False, "error": {"code": str(code), "message": message}})


def encode_stream(rid: RequestId, kind: str, payload: Mapping[str, object]) -> bytes:
    """One stream message: `{"id", "ok": true, "stream": kind, **payload}`."""
    return line({"id": rid, "ok": True, "stream": kind, **payload})
