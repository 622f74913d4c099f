"""The control wire codec: every error class, typed args, and reply round trips (pure).

What results contain is tested in test_control_results.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sglang_farm.control import codec
from sglang_farm.control.codec import (
    Command,
    ErrorCode,
    GpuArgs,
    LogsArgs,
    NoArgs,
    ReleaseWorkerArgs,
    RequestError,
    StopArgs,
    TargetArgs,
    WaitArgs,
    WorkerArgs,
    decode_reply,
    decode_request,
)
from sglang_farm.errors import ProtocolError


def req(obj: object) -> bytes:
    return json.dumps(obj).encode() + b"\n"


def err(line: bytes) -> RequestError:
    with pytest.raises(RequestError) as ei:
        decode_request(line)
    return ei.value


def test_decodes_restart_with_worker_id() -> None:
    r = decode_request(req({"id": 7, "cmd": "restart", "args": {"worker": 3}}))
    assert (r.id, r.cmd, r.args) == (7, Command.RESTART, StopArgs(3, drain=True))
    assert r.changes_state


def test_decodes_all_target_string_id_and_missing_args() -> None:
    assert decode_request(req({"id": "a", "cmd": "stop", "args": {"worker": "all"}})).args == (
        StopArgs("all", drain=True)
    )
    assert decode_request(req({"cmd": "start", "args": {"worker": "all"}})).args == (
        TargetArgs("all")
    )
    r = decode_request(b'{"cmd":"status"}')  # no id, no args, no newline
    assert (r.id, r.cmd, r.args, r.changes_state) == (None, Command.STATUS, NoArgs(), False)


@pytest.mark.parametrize("cmd", ["stop", "restart"])
@pytest.mark.parametrize("drain", [True, False])
def test_stop_and_restart_take_drain_true_or_false(cmd: str, drain: bool) -> None:
    r = decode_request(req({"id": 1, "cmd": cmd, "args": {"worker": "all", "drain": drain}}))
    assert (r.cmd, r.args) == (Command(cmd), StopArgs("all", drain=drain))


def test_logs_and_wait_ready_defaults_and_values() -> None:
    assert decode_request(req({"cmd": "logs", "args": {"worker": 2}})).args == LogsArgs(
        2, 100, False
    )
    a = decode_request(req({"cmd": "logs", "args": {"worker": 2, "lines": 5, "follow": True}})).args
    assert a == LogsArgs(2, 5, True)
    w = decode_request(
        req({"cmd": "wait-ready", "args": {"worker": 1, "timeout": 2, "after": 10.5}})
    )
    assert w.args == WaitArgs(1, 2.0, 10.5)
    assert decode_request(req({"cmd": "why", "args": {"worker": 0}})).args == WorkerArgs(0)


@pytest.mark.parametrize(
    "line",
    [
        b"\xff\xfe{}\n",
        b"not json\n",
        b'{"cmd": "status"\n',
        b"[1,2]\n",
        b'"status"\n',
        b"null\n",
        b"[" * 60_000 + b"\n",
    ],
    ids=["not-utf8", "garbage", "truncated", "array", "string", "null", "deep-nesting"],
)
def test_malformed_lines_are_bad_json(line: bytes) -> None:
    e = err(line)
    assert e.error_code is ErrorCode.BAD_JSON and e.code == "bad_json"
    assert e.request_id is None
    assert isinstance(e, ProtocolError)


def test_unknown_command_keeps_id_and_lists_commands() -> None:
    e = err(req({"id": 9, "cmd": "explode"}))
    assert e.error_code is ErrorCode.UNKNOWN_COMMAND and e.request_id == 9
    assert "'explode'" in e.message and "restart" in e.message


@pytest.mark.parametrize(
    ("obj", "fragment"),
    [
        ({"id": 1, "cmd": 5}, "'cmd' must be a string"),
        ({"id": 1}, "'cmd' must be a string"),
        ({"id": 1, "cmd": "status", "args": [1]}, "'args' must be an object"),
        ({"id": 1, "cmd": "status", "extra": 1}, "unknown request keys ['extra']"),
        ({"id": 1, "cmd": "status", "args": {"x": 1}}, "it takes no arguments"),
        ({"id": 1, "cmd": "restart", "args": {}}, "'worker' must be a worker id or \"all\""),
        ({"id": 1, "cmd": "restart", "args": {"worker": -1}}, 'or "all", got -1'),
        ({"id": 1, "cmd": "why", "args": {"worker": "all"}}, "'worker' must be a worker id"),
        ({"id": 1, "cmd": "why", "args": {}}, "missing 'worker'"),
        ({"id": 1, "cmd": "why", "args": {"worker": True}}, "got True"),
        ({"id": 1, "cmd": "logs", "args": {"worker": 1, "lines": 10**6}}, "'lines' must be"),
        ({"id": 1, "cmd": "logs", "args": {"worker": 1, "follow": "yes"}}, "'follow' must be"),
        ({"id": 1, "cmd": "wait-ready", "args": {"worker": 1, "timeout": 0}}, "'timeout' must be"),
        ({"id": 1, "cmd": "wait-ready", "args": {"worker": 1, "timeout": "x"}}, "must be a number"),
        ({"id": 1, "cmd": "start", "args": {"worker": 1, "force": True}}, "accepted: worker"),
        ({"id": 1, "cmd": "restart", "args": {"worker": 1, "drain": "no"}}, "'drain' must be"),
        ({"id": 1, "cmd": "stop", "args": {"worker": 1, "drain": 0}}, "true or false, got 0"),
        ({"id": 1, "cmd": "stop", "args": {"worker": 1, "drain": None}}, "'drain' must be"),
        ({"id": 1, "cmd": "start", "args": {"worker": 1, "drain": False}}, "['drain']"),
        ({"id": 1, "cmd": "stop", "args": {"drain": False}}, "'worker' must be a worker id"),
        ({"id": 1, "cmd": "stop", "args": {"worker": 1, "force": 1}}, "accepted: drain, worker"),
        ({"id": 1, "cmd": "release-gpu", "args": {}}, "missing 'gpu' (a GPU index"),
        ({"id": 1, "cmd": "release-gpu"}, "missing 'gpu'"),
        ({"id": 1, "cmd": "release-gpu", "args": {"gpu": -1}}, "(an integer >= 0), got -1"),
        ({"id": 1, "cmd": "release-gpu", "args": {"gpu": "5"}}, "got '5'"),
        ({"id": 1, "cmd": "release-gpu", "args": {"gpu": True}}, "'gpu' must be a GPU index"),
        ({"id": 1, "cmd": "release-gpu", "args": {"gpu": 1.0}}, "'gpu' must be a GPU index"),
        ({"id": 1, "cmd": "release-gpu", "args": {"gpu": "all"}}, "'gpu' must be a GPU index"),
        ({"id": 1, "cmd": "release-gpu", "args": {"gpu": 1, "worker": 1}}, "not both"),
        ({"id": 1, "cmd": "release-gpu", "args": {"worker": "all"}}, "'worker' must be a"),
        ({"id": 1, "cmd": "release-gpu", "args": {"worker": -1}}, "got -1"),
        ({"id": 1, "cmd": "release-gpu", "args": {"id": 5}}, "accepted: gpu, worker"),
    ],
)
def test_bad_shapes_and_args_are_bad_request_with_id(obj: object, fragment: str) -> None:
    e = err(req(obj))
    assert e.error_code is ErrorCode.BAD_REQUEST
    assert e.request_id == 1
    assert fragment in e.message


@pytest.mark.parametrize("bad_id", [True, 1.5, [1], {"a": 1}])
def test_id_must_be_int_or_string(bad_id: object) -> None:
    e = err(req({"id": bad_id, "cmd": "status"}))
    assert e.error_code is ErrorCode.BAD_REQUEST and e.request_id is None


def test_oversized_line_is_bad_request() -> None:
    line = req({"id": 1, "cmd": "status", "args": {}})[:-2] + b" " * codec.MAX_LINE + b"}\n"
    assert err(line).error_code is ErrorCode.BAD_REQUEST


def test_every_command_is_classified_once() -> None:
    assert set(Command) == codec.READ_ONLY | codec.STATE_CHANGING
    assert not codec.READ_ONLY & codec.STATE_CHANGING
    assert {
        Command.START,
        Command.STOP,
        Command.RESTART,
        Command.RELOAD,
        Command.RESET_OOM,
        Command.RELEASE_GPU,
        Command.DRAIN_HOST,
        Command.UNDRAIN_HOST,
    } == codec.STATE_CHANGING


def test_release_gpu_takes_one_gpu_index_and_changes_state() -> None:
    r = decode_request(req({"id": 3, "cmd": "release-gpu", "args": {"gpu": 5}}))
    assert (r.id, r.cmd, r.args, r.changes_state) == (3, Command.RELEASE_GPU, GpuArgs(5), True)
    assert decode_request(codec.encode_request(4, "release-gpu", {"gpu": 0})).args == GpuArgs(0)


def test_release_gpu_takes_a_worker_instead_of_a_gpu() -> None:
    """Issue 22 item 7: a quarantine naming a GPU the worker no longer uses is released by
    the worker's id (`farmctl release-gpu --worker N`)."""
    r = decode_request(req({"id": 3, "cmd": "release-gpu", "args": {"worker": 2}}))
    assert (r.cmd, r.args, r.changes_state) == (Command.RELEASE_GPU, ReleaseWorkerArgs(2), True)


def test_replies_round_trip_and_are_single_ascii_lines() -> None:
    ok = codec.encode_ok(3, {"x": "é\nnext"})
    assert ok.endswith(b"\n") and ok.count(b"\n") == 1 and ok.isascii()
    r = decode_reply(ok)
    assert (r.id, r.ok, r.result, r.final) == (3, True, {"x": "é\nnext"}, True)

    e = decode_reply(codec.encode_error("q", ErrorCode.BUSY, "worker 3 is busy"))
    assert (e.id, e.ok, e.error_code, e.error_message) == ("q", False, "busy", "worker 3 is busy")

    s = decode_reply(codec.encode_stream(4, "line", {"line": "hello"}))
    assert (s.stream, s.payload, s.final) == ("line", {"line": "hello"}, False)

    line = codec.encode_request(5, "logs", {"worker": 1})
    assert decode_request(line).args == LogsArgs(1)


@pytest.mark.parametrize("line", [b"nope\n", b'{"id":1}\n', b'{"ok":false}\n', b"\xff\n"])
def test_malformed_replies_raise_protocol_error(line: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_reply(line)


def test_codec_pulls_in_no_other_project_module() -> None:
    # farmctl imports the codec on every run: it must not drag in the agent's views.
    code = (
        "import json, sys, sglang_farm; before = set(sys.modules); "
        "import sglang_farm.control.codec; "
        "print(json.dumps(sorted(set(sys.modules) - before)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    loaded = {m for m in json.loads(out) if m.startswith("sglang_farm")}
    assert "sglang_farm.control.codec" in loaded
    assert loaded <= {
        "sglang_farm.control",
        "sglang_farm.control.codec",
        "sglang_farm.control.wire",
        "sglang_farm.errors",
    }


# --- numbers that json.loads would turn into a crash or a non-finite value -------------

HUGE = "9" * 5000  # past CPython's int-string limit: int() raises ValueError
LONG = "9" * 4000  # under that limit, still no worker id or request id


@pytest.mark.parametrize(
    "line",
    [
        f'{{"id":1,"cmd":"why","args":{{"worker":{HUGE}}}}}'.encode(),
        f'{{"id":{HUGE},"cmd":"status"}}'.encode(),
        f'{{"id":1,"cmd":"why","args":{{"worker":{LONG}}}}}'.encode(),
        f'{{"id":{LONG},"cmd":"status"}}'.encode(),
        f'{{"id":1,"cmd":"logs","args":{{"worker":1,"lines":-{HUGE}}}}}'.encode(),
        b'{"id":1,"cmd":"wait-ready","args":{"worker":1,"after":1e400}}',
        b'{"id":1,"cmd":"wait-ready","args":{"worker":1,"after":-1e400}}',
        b'{"id":1,"cmd":"wait-ready","args":{"worker":1,"timeout":1e309}}',
        b'{"id":1,"cmd":"wait-ready","args":{"worker":1,"after":NaN}}',
        b'{"id":1,"cmd":"wait-ready","args":{"worker":1,"after":Infinity}}',
        b'{"id":1,"cmd":"wait-ready","args":{"worker":1,"after":-Infinity}}',
        b'{"id":1,"cmd":"status","args":{"x":[1e999]}}',
    ],
    ids=[
        "huge-int-worker",
        "huge-int-id",
        "long-int-worker",
        "long-int-id",
        "huge-negative-int",
        "float-overflow",
        "float-negative-overflow",
        "float-just-over",
        "nan-literal",
        "infinity-literal",
        "minus-infinity-literal",
        "overflow-nested",
    ],
)
def test_out_of_range_numbers_are_bad_request_not_a_crash(line: bytes) -> None:
    e = err(line)
    assert e.error_code is ErrorCode.BAD_REQUEST
    assert "number" in e.message and len(e.message) < 200, e.message


def test_largest_finite_float_and_64_bit_ints_still_decode() -> None:
    r = decode_request(
        b'{"id":18446744073709551615,"cmd":"wait-ready",'
        b'"args":{"worker":1,"after":1.7976931348623157e308}}'
    )
    assert r.id == 2**64 - 1 and r.args == WaitArgs(1, 300.0, 1.7976931348623157e308)


@pytest.mark.parametrize(
    "line",
    [f'{{"id":1,"ok":true,"result":{HUGE}}}'.encode(), b'{"id":1,"ok":true,"result":NaN}'],
)
def test_replies_with_out_of_range_numbers_raise_protocol_error(line: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_reply(line)
