"""The control socket server over real Unix sockets, against FakeOps."""

from __future__ import annotations

import asyncio
import contextlib
import grp
import json
import os
import pwd
import resource
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from fake_ops import FakeOps
from sglang_farm.control import codec
from sglang_farm.control.server import ControlServer
from sglang_farm.errors import ControlSocketError, RuntimeFailure
from sglang_farm.farm_view import GatewayStatus

# One decoded reply line. Its values are Any on purpose: a reply is JSON whose
# shape each test asserts by indexing into it, and a wrong shape fails there.
JsonObject = dict[str, Any]


def _json_object(line: bytes) -> JsonObject:
    obj = json.loads(line)
    assert isinstance(obj, dict), f"not a JSON object: {line!r}"
    return obj


@pytest.fixture
def sockdir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="sf")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def ops() -> FakeOps:
    return FakeOps(4)


@pytest.fixture
async def server(ops: FakeOps, sockdir: str) -> AsyncIterator[ControlServer]:
    srv = ControlServer(
        ops, os.path.join(sockdir, "control.sock"), None, version="1.2.3", idle_timeout=0.5
    )
    await srv.start()
    yield srv
    await srv.close()
    await ops.aclose()


class Conn:
    def __init__(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.r, self.w = r, w

    @classmethod
    async def open(cls, path: str) -> Conn:
        r, w = await asyncio.open_unix_connection(path, limit=2**24)
        return cls(r, w)

    async def send(self, obj: object) -> None:
        self.w.write(obj if isinstance(obj, bytes) else json.dumps(obj).encode() + b"\n")
        await self.w.drain()

    async def recv(self, timeout: float = 5.0) -> JsonObject:
        line = await asyncio.wait_for(self.r.readline(), timeout)
        assert line, "server closed the connection"
        return _json_object(line)

    async def eof(self, timeout: float = 5.0) -> bool:
        return await asyncio.wait_for(self.r.read(), timeout) == b""

    async def close(self) -> None:
        self.w.close()
        with contextlib.suppress(ConnectionError):
            await self.w.wait_closed()


async def call(
    path: str, cmd: str, args: dict[str, object] | None = None, rid: object = 1
) -> JsonObject:
    c = await Conn.open(path)
    try:
        await c.send({"id": rid, "cmd": cmd, "args": args or {}})
        return await c.recv()
    finally:
        await c.close()


def error_code(reply: JsonObject) -> str:
    assert reply["ok"] is False, reply
    code = reply["error"]["code"]
    assert isinstance(code, str), reply
    return code


async def test_status_reports_protocol_version_workers_and_vram(server: ControlServer) -> None:
    r = await call(server.path, "status", rid="s1")
    assert r["id"] == "s1" and r["ok"] is True
    st = r["result"]
    assert st["protocol_version"] == 1 and st["agent_version"] == "1.2.3"
    assert [w["id"] for w in st["workers"]] == [0, 1, 2, 3]
    assert st["workers"][2]["state"] == "ready" and st["workers"][2]["port"] == 30002
    assert st["gpus"][0]["total_bytes"] == 80 * 2**30
    assert (await call(server.path, "version"))["result"] == {
        "protocol_version": 1,
        "agent_version": "1.2.3",
    }


@pytest.mark.parametrize(
    ("line", "code"),
    [
        (b"this is not json\n", "bad_json"),
        (bytes(range(256)).replace(b"\n", b"") + b"\n", "bad_json"),  # binary garbage
        (b"\xc3\x28\n", "bad_json"),  # invalid UTF-8
        (b"[1, 2, 3]\n", "bad_json"),
        (b'{"id": 4, "cmd": "launch-missiles"}\n', "unknown_command"),
        (b'{"id": 4, "cmd": "restart", "args": {"worker": "three"}}\n', "bad_request"),
        (b'{"id": 4, "cmd": "restart", "args": {"worker": 9}}\n', "unknown_worker"),
        (b'{"id": 4, "cmd": "stop", "args": {"worker": 1, "drain": "off"}}\n', "bad_request"),
    ],
    ids=[
        "garbage",
        "binary",
        "bad-utf8",
        "not-object",
        "unknown-cmd",
        "bad-args",
        "unknown-worker",
        "bad-drain",
    ],
)
async def test_malformed_input_gets_error_and_connection_keeps_serving(
    server: ControlServer, line: bytes, code: str
) -> None:
    c = await Conn.open(server.path)
    await c.send(line)
    r = await c.recv()
    assert error_code(r) == code
    await c.send({"id": 5, "cmd": "version"})  # same connection still works
    assert (await c.recv())["ok"] is True
    await c.close()


@pytest.mark.parametrize(
    "line",
    [
        b'{"id":1,"cmd":"why","args":{"worker":' + b"9" * 5000 + b"}}\n",
        b'{"id":' + b"7" * 5000 + b',"cmd":"status"}\n',
        b'{"id":1,"cmd":"wait-ready","args":{"worker":1,"after":1e400}}\n',
        b'{"id":1,"cmd":"wait-ready","args":{"worker":1,"after":Infinity}}\n',
        b'{"id":1,"cmd":"wait-ready","args":{"worker":1,"timeout":NaN}}\n',
    ],
    ids=["int-5000-digits", "id-5000-digits", "float-1e400", "infinity", "nan"],
)
async def test_out_of_range_numbers_get_bad_request_without_a_traceback(
    server: ControlServer, line: bytes
) -> None:
    c = await Conn.open(server.path)
    with capture_logs() as logs:
        await c.send(line)
        r = await c.recv()
        assert error_code(r) == "bad_request" and "number" in r["error"]["message"]
        await c.send({"id": 5, "cmd": "version"})  # the connection survived
        assert (await c.recv())["ok"] is True
    await c.close()
    assert [e for e in logs if e.get("exc_info") or e["log_level"] == "error"] == []


async def test_bad_drain_is_refused_before_the_agent_is_asked(
    server: ControlServer, ops: FakeOps
) -> None:
    r = await call(server.path, "restart", {"worker": 1, "drain": "no"}, rid=2)
    assert r["id"] == 2 and error_code(r) == "bad_request"
    assert r["error"]["message"] == "restart: 'drain' must be true or false, got 'no'"
    assert ops.calls == []


async def test_no_drain_reaches_the_agent_and_is_logged(
    server: ControlServer, ops: FakeOps
) -> None:
    with capture_logs() as logs:
        r = await call(server.path, "stop", {"worker": 1, "drain": False}, rid=5)
        await call(server.path, "restart", {"worker": 2})
    assert r["result"]["workers"] == [1]
    assert ops.drains == [("stop", (1,), False), ("restart", (2,), True)]
    ev = [e for e in logs if e["event"] == "control_command"]
    assert [e["args"] for e in ev] == [
        {"worker": 1, "drain": False},
        {"worker": 2, "drain": True},
    ]


async def test_status_and_endpoints_without_a_gateway_say_so(server: ControlServer) -> None:
    st = (await call(server.path, "status"))["result"]
    assert st["gateway"] is None
    assert {(w["in_gateway"], w["last_drain_seconds"]) for w in st["workers"]} == {(False, None)}
    ep = (await call(server.path, "endpoints"))["result"]
    assert ep["gateway"] is None and len(ep["endpoints"]) == 4


async def test_drained_stop_over_the_socket_reports_gateway_and_drain(sockdir: str) -> None:
    gw = GatewayStatus("http://127.0.0.1:8000", up=True, members=0, errors=0)
    ops = FakeOps(2, gateway=gw)
    srv = ControlServer(ops, os.path.join(sockdir, "gw.sock"), None, version="x")
    await srv.start()
    try:
        st = (await call(srv.path, "status"))["result"]
        assert st["gateway"]["members"] == 2 and st["gateway"]["url"] == gw.url
        assert (await call(srv.path, "stop", {"worker": 0}))["ok"] is True
        st = (await call(srv.path, "status"))["result"]
        assert st["gateway"]["members"] == 1
        w0 = st["workers"][0]
        assert (w0["state"], w0["in_gateway"], w0["last_drain_seconds"]) == (
            "stopped",
            False,
            ops.step,
        )
        ep = (await call(srv.path, "endpoints"))["result"]
        assert ep == {
            "endpoints": [{"worker": 1, "base_url": "http://127.0.0.1:30001"}],
            "gateway": "http://127.0.0.1:8000",
        }
    finally:
        await srv.close()
        await ops.aclose()


async def test_unknown_worker_names_the_known_ones(server: ControlServer) -> None:
    r = await call(server.path, "why", {"worker": 9}, rid=3)
    assert r["id"] == 3 and error_code(r) == "unknown_worker"
    assert r["error"]["message"] == "no worker 9; workers are 0-3"


@pytest.mark.parametrize("newline", [True, False])
async def test_oversized_line_gets_bad_request_then_close(
    server: ControlServer, newline: bool
) -> None:
    c = await Conn.open(server.path)
    c.w.write(
        b'{"id":1,"cmd":"status","pad":"'
        + b"x" * (codec.MAX_LINE + 10)
        + b'"}'
        + (b"\n" if newline else b"")
    )
    r = await c.recv()
    assert error_code(r) == "bad_request" and "65536" in r["error"]["message"]
    assert await c.eof()
    await c.close()
    assert (await call(server.path, "version"))["ok"] is True


async def test_line_at_the_limit_is_accepted(server: ControlServer) -> None:
    head = b'{"id":1,"cmd":"status"}'
    c = await Conn.open(server.path)
    await c.send(head + b" " * (codec.MAX_LINE - len(head)) + b"\n")
    assert (await c.recv())["ok"] is True
    await c.close()


async def test_idle_client_does_not_block_others_and_is_dropped(server: ControlServer) -> None:
    idle = await Conn.open(server.path)
    half = await Conn.open(server.path)
    await half.send(b'{"id":1,"cmd":"sta')  # half a line, then silence
    t0 = time.monotonic()
    r = await call(server.path, "status")
    assert r["ok"] is True and time.monotonic() - t0 < 0.4  # idle_timeout is 0.5 s
    assert await idle.eof(timeout=3.0)  # dropped after the idle timeout
    assert await half.eof(timeout=3.0)
    await idle.close()
    await half.close()


async def test_request_without_trailing_newline_is_served_at_eof(server: ControlServer) -> None:
    c = await Conn.open(server.path)
    await c.send(b'{"id":8,"cmd":"version"}')
    c.w.write_eof()
    assert (await c.recv())["id"] == 8
    await c.close()


async def test_client_that_disconnects_mid_reply_does_not_hurt_the_server(
    server: ControlServer, ops: FakeOps
) -> None:
    ops.log_lines[1] = ["y" * 2000] * 10_000  # a ~20 MB reply
    for _ in range(5):
        c = await Conn.open(server.path)
        await c.send({"id": 1, "cmd": "logs", "args": {"worker": 1, "lines": 10_000}})
        await c.r.read(100)
        c.w.transport.abort()
    assert (await call(server.path, "version"))["ok"] is True


async def test_logs_tail_and_follow_stream_until_the_client_leaves(
    server: ControlServer, ops: FakeOps
) -> None:
    r = await call(server.path, "logs", {"worker": 2, "lines": 3})
    assert r["result"] == {"worker": 2, "lines": ["w2 line 47", "w2 line 48", "w2 line 49"]}

    c = await Conn.open(server.path)
    await c.send({"id": 6, "cmd": "logs", "args": {"worker": 2, "lines": 2, "follow": True}})
    assert [(await c.recv())["line"] for _ in range(2)] == ["w2 line 48", "w2 line 49"]
    for _ in range(100):
        if ops.follow_queues:
            break
        await asyncio.sleep(0.01)
    ops.push_log("fresh line")
    m = await c.recv()
    assert m == {"id": 6, "ok": True, "stream": "line", "line": "fresh line"}
    await c.close()  # disconnect mid-stream: the follower is released
    for _ in range(200):
        if not ops.follow_queues:
            break
        await asyncio.sleep(0.01)
    assert ops.follow_queues == []
    assert (await call(server.path, "status"))["ok"] is True


async def test_follow_ends_with_final_reply_when_the_source_ends(
    server: ControlServer, ops: FakeOps
) -> None:
    c = await Conn.open(server.path)
    await c.send({"id": 2, "cmd": "logs", "args": {"worker": 0, "lines": 0, "follow": True}})
    for _ in range(100):
        if ops.follow_queues:
            break
        await asyncio.sleep(0.01)
    ops.push_log("a")
    ops.push_log(None)
    assert (await c.recv())["line"] == "a"
    assert await c.recv() == {"id": 2, "ok": True, "result": {"worker": 0, "ended": True}}
    await c.close()


async def test_300_concurrent_clients_are_all_answered(server: ControlServer) -> None:
    async def one(i: int) -> JsonObject:
        return await call(server.path, "status", rid=i)

    t0 = time.monotonic()
    replies = await asyncio.gather(*(one(i) for i in range(300)))
    assert sorted(r["id"] for r in replies) == list(range(300))
    assert all(r["ok"] is True for r in replies)
    assert time.monotonic() - t0 < 10


async def test_concurrent_restarts_of_one_worker_second_is_busy(
    server: ControlServer, ops: FakeOps
) -> None:
    ops.issue_delay = 0.3
    a, b, other = await asyncio.gather(
        call(server.path, "restart", {"worker": 1}, rid="a"),
        call(server.path, "restart", {"worker": 1}, rid="b"),
        call(server.path, "restart", {"worker": 2}, rid="c"),
    )
    assert {a["ok"], b["ok"]} == {False, True}
    busy = a if a["ok"] is False else b
    assert error_code(busy) == "busy" and "worker 1" in busy["error"]["message"]
    assert other["ok"] is True  # a different worker is not serialized behind worker 1
    assert ops.calls.count(("restart", (1,))) == 1  # never a double restart


async def test_restart_all_is_busy_while_one_worker_changes(
    server: ControlServer, ops: FakeOps
) -> None:
    ops.issue_delay = 0.3
    one = asyncio.ensure_future(call(server.path, "stop", {"worker": 3}))
    await asyncio.sleep(0.1)
    r = await call(server.path, "restart", {"worker": "all"})
    assert error_code(r) == "busy" and "worker 3" in r["error"]["message"]
    assert (await one)["ok"] is True
    r2 = await call(server.path, "restart", {"worker": "all"})
    assert r2["result"]["workers"] == [0, 1, 2, 3]
    assert ops.calls[-1] == ("restart", (0, 1, 2, 3))  # one call: the agent does the waves


async def _wait_stream(path: str, args: dict[str, object]) -> list[JsonObject]:
    c = await Conn.open(path)
    await c.send({"id": 1, "cmd": "wait-ready", "args": args})
    out = []
    while True:
        m = await c.recv()
        out.append(m)
        if "stream" not in m:
            break
    await c.close()
    return out


async def test_restart_then_wait_ready_streams_phases_to_ready(
    server: ControlServer, ops: FakeOps
) -> None:
    r = await call(server.path, "restart", {"worker": 2})
    issued = r["result"]["issued_at"]
    msgs = await _wait_stream(server.path, {"worker": 2, "timeout": 5, "after": issued})
    phases = [m["state"] for m in msgs[:-1]]
    assert phases[0] in ("stopping", "starting") and phases[-1] == "ready"
    assert all(m["stream"] == "phase" for m in msgs[:-1])
    final = msgs[-1]["result"]
    assert final["ready"] is True and final["timed_out"] is False and final["pid"] == 2002


async def test_wait_ready_reports_failure_and_timeout(server: ControlServer, ops: FakeOps) -> None:
    ops.fail_next.add(1)
    r = await call(server.path, "restart", {"worker": 1})
    msgs = await _wait_stream(
        server.path,
        {"worker": 1, "timeout": 5, "after": r["result"]["issued_at"]},
    )
    final = msgs[-1]["result"]
    assert final["state"] == "failed" and final["ready"] is False and final["timed_out"] is False
    assert final["last_failure"]["kind"] == "cuda_oom_load"

    # A ready phase from before `after` does not count: the wait times out.
    msgs = await _wait_stream(server.path, {"worker": 0, "timeout": 0.3, "after": time.time() + 60})
    final = msgs[-1]["result"]
    assert final["timed_out"] is True and final["ready"] is False


async def test_runtime_failure_is_failed_and_bug_is_internal_without_details(
    server: ControlServer, ops: FakeOps
) -> None:
    ops.raise_on["restart"] = RuntimeFailure("systemd refused sglang@1.service: unit masked")
    r = await call(server.path, "restart", {"worker": 1})
    assert error_code(r) == "failed" and "unit masked" in r["error"]["message"]

    ops.raise_on["stop"] = ValueError("secret internal detail")
    with capture_logs() as logs:
        r = await call(server.path, "stop", {"worker": 1}, rid="req-42")
    assert error_code(r) == "internal"
    msg = r["error"]["message"]
    assert "secret" not in msg and "Traceback" not in msg and "req-42" in msg
    ev = [e for e in logs if e["event"] == "control_internal_error"]
    assert ev and ev[0]["request_id"] == "req-42" and ev[0]["log_level"] == "error"
    assert (await call(server.path, "status"))["ok"] is True


async def test_state_changes_are_logged_with_peer_uid_and_pid(server: ControlServer) -> None:
    with capture_logs() as logs:
        await call(server.path, "start", {"worker": 0}, rid=11)
        await call(server.path, "status")
    ev = [e for e in logs if e["event"] == "control_command"]
    assert len(ev) == 1  # status is read-only: not logged as a change
    assert ev[0]["cmd"] == "start" and ev[0]["uid"] == os.getuid() and ev[0]["pid"] == os.getpid()
    assert ev[0]["args"] == {"worker": 0} and ev[0]["request_id"] == 11


async def test_reload_reset_oom_and_endpoints(server: ControlServer, ops: FakeOps) -> None:
    ops.roll_on_reload = False  # worker 1 stays as it is: the stop below decides it
    before = time.time()
    r = await call(server.path, "reload")
    issued_at = r["result"].pop("issued_at")
    assert r["result"] == {
        "applied": True,
        "problems": [],
        "restarted": [1],
        "added": [],
        "removed": [],
    }
    # The agent's clock when it took the reload: a canary window it starts begins later.
    assert before <= issued_at <= time.time()
    r = await call(server.path, "reset-oom", {"worker": 3})
    assert r["result"] == {"worker": 3, "oom_step": 0} and ops.oom_resets == [3]
    await call(server.path, "stop", {"worker": 1})
    r = await call(server.path, "endpoints")
    assert [e["worker"] for e in r["result"]["endpoints"]] == [0, 2, 3]


async def test_why_returns_failure_lines_action_and_advice(
    server: ControlServer, ops: FakeOps
) -> None:
    ops.fail_next.add(0)
    await call(server.path, "start", {"worker": 0})
    await _wait_stream(server.path, {"worker": 0, "timeout": 5})
    w = (await call(server.path, "why", {"worker": 0}))["result"]
    assert w["state"] == "failed" and w["advice"].startswith("lower")
    assert w["last_failure"]["lines"][0].startswith("torch.OutOfMemoryError")
    assert "gave up" in w["last_action"] and w["oom_step"] == 1


async def test_stop_while_the_agent_restores_state_is_busy_and_status_still_works(
    server: ControlServer, ops: FakeOps
) -> None:
    ops.startup_reason = "the agent is restoring its state and adopting running workers"
    r = await call(server.path, "stop", {"worker": 3}, rid=9)
    st = await call(server.path, "status")
    assert r["id"] == 9 and error_code(r) == "busy"
    assert r["error"]["message"].startswith(
        f"{ops.startup_reason}; state changes wait until it is done: retry stop in"
    )
    assert ops.calls == [] and ops.workers[3].phase.value == "ready"
    assert st["ok"] is True and len(st["result"]["workers"]) == 4
    ops.startup_reason = None
    assert (await call(server.path, "stop", {"worker": 3}))["ok"] is True
    assert ops.calls == [("stop", (3,))]


# --- socket file: stale, in use, mode and group -------------------------------------


async def test_stale_socket_file_is_replaced(ops: FakeOps, sockdir: str) -> None:
    path = os.path.join(sockdir, "c.sock")
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(path)
    dead.close()  # the file stays, nobody listens
    srv = ControlServer(ops, path, None, version="x")
    await srv.start()
    assert (await call(path, "version"))["ok"] is True
    await srv.close()
    assert not os.path.exists(path)  # noqa: ASYNC240 -- a local stat, instant


async def test_live_agent_on_the_path_is_not_displaced(ops: FakeOps, sockdir: str) -> None:
    path = os.path.join(sockdir, "c.sock")
    first = ControlServer(ops, path, None, version="x")
    await first.start()
    second = ControlServer(ops, path, None, version="x")
    with pytest.raises(ControlSocketError, match="already listening"):
        await second.start()
    assert (await call(path, "version"))["ok"] is True
    await first.close()


async def test_socket_that_accepts_but_never_answers_is_kept(ops: FakeOps, sockdir: str) -> None:
    path = os.path.join(sockdir, "c.sock")
    mute = socket.socket(socket.AF_UNIX)
    mute.bind(path)
    mute.listen(8)  # the kernel completes connects; nobody ever reads or answers
    try:
        with pytest.raises(ControlSocketError, match="already listening"):
            await ControlServer(ops, path, None, version="x").start()
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
        c = socket.socket(socket.AF_UNIX)
        c.connect(path)  # still the mute listener's socket
        c.close()
    finally:
        mute.close()


async def test_live_socket_with_a_full_queue_is_kept_and_said_so(
    ops: FakeOps, sockdir: str
) -> None:
    # A live agent that is not accepting (a burst of clients, or its loop busy): its
    # listen queue is full and a non-blocking connect() gets EAGAIN. The probe must
    # take that as a live listener, never as a stale file.
    path = os.path.join(sockdir, "c.sock")
    busy = socket.socket(socket.AF_UNIX)
    busy.bind(path)
    busy.listen(0)
    queued: list[socket.socket] = []
    while True:  # fill its queue: the next connect() gets EAGAIN
        c = socket.socket(socket.AF_UNIX)
        c.setblocking(False)
        try:
            c.connect(path)
        except BlockingIOError:
            c.close()
            break
        queued.append(c)
    try:
        with pytest.raises(ControlSocketError, match=r"listening on .* connection queue is full"):
            await ControlServer(ops, path, None, version="x").start()
        queued[0].close()
        busy.accept()[0].close()  # the live listener still owns the path
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
    finally:
        for c in queued:
            c.close()
        busy.close()


async def test_regular_file_at_the_path_is_refused(ops: FakeOps, sockdir: str) -> None:
    path = os.path.join(sockdir, "c.sock")
    Path(path).write_text("important")  # noqa: ASYNC240 -- a tiny tmp file
    with pytest.raises(ControlSocketError, match="not a socket"):
        await ControlServer(ops, path, None, version="x").start()
    assert Path(path).read_text() == "important"  # noqa: ASYNC240 -- a tiny tmp file


async def test_mode_is_0660_with_group_and_0600_when_group_is_missing(
    ops: FakeOps, sockdir: str
) -> None:
    g = grp.getgrgid(os.getgid() if os.getgid() else 0)
    path = os.path.join(sockdir, "a.sock")
    srv = ControlServer(ops, path, g.gr_name, version="x")
    await srv.start()
    st = os.stat(path)
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == g.gr_gid
    await srv.close()

    path2 = os.path.join(sockdir, "b.sock")
    with capture_logs() as logs:
        srv2 = ControlServer(ops, path2, "no-such-group-" + uuid.uuid4().hex[:6], version="x")
        await srv2.start()
    assert stat.S_IMODE(os.stat(path2).st_mode) == 0o600 and srv2.group_gid is None
    # Said once, at info (the demo runs as root and needs no group: no alarm).
    (said,) = [e for e in logs if e["event"] == "control_socket_root_only"]
    assert said["log_level"] == "info" and "only root may use farmctl" in said["note"]
    assert not [e for e in logs if e["log_level"] in ("warning", "error")]
    assert [e["event"] for e in logs].count("control_listening") == 1
    await srv2.close()


# --- permissions, with real unprivileged users ---------------------------------------

CLIENT = r"""
import json, socket, sys
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1])
except PermissionError:
    print(json.dumps({"connect": "permission_denied"})); sys.exit(0)
s.sendall(sys.argv[2].encode() + b"\n")
f = s.makefile("rb")
print(f.readline().decode().strip())
"""


@pytest.fixture(scope="module")
def users() -> Iterator[dict[str, str]]:
    if os.geteuid() != 0 or not shutil.which("useradd") or not shutil.which("setpriv"):
        pytest.skip("needs root, useradd and setpriv")
    tag = uuid.uuid4().hex[:6]
    names = {"group": f"sfg{tag}", "member": f"sfm{tag}", "outsider": f"sfo{tag}"}
    subprocess.run(["groupadd", names["group"]], check=True)
    try:
        subprocess.run(["useradd", "-M", "-N", "-G", names["group"], names["member"]], check=True)
        subprocess.run(["useradd", "-M", "-N", names["outsider"]], check=True)
        yield names
    finally:
        for u in (names["member"], names["outsider"]):
            subprocess.run(["userdel", u], check=False, capture_output=True)
        subprocess.run(["groupdel", names["group"]], check=False, capture_output=True)


async def as_user(user: str, path: str, cmd: str, args: Mapping[str, object]) -> JsonObject:
    """Connect from a subprocess running as `user` with its group-database groups."""
    pw = pwd.getpwnam(user)
    proc = await asyncio.create_subprocess_exec(
        "setpriv",
        f"--reuid={pw.pw_uid}",
        f"--regid={pw.pw_gid}",
        "--init-groups",
        sys.executable,
        "-I",
        "-c",
        CLIENT,
        path,
        json.dumps({"id": 1, "cmd": cmd, "args": args}),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, errb = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 0, errb.decode()
    return _json_object(out)


@pytest.fixture
async def group_server(users: dict[str, str]) -> AsyncIterator[tuple[ControlServer, FakeOps]]:
    d = tempfile.mkdtemp(prefix="sf")
    os.chmod(d, 0o755)  # let the test users reach the socket; its own mode is the gate
    ops = FakeOps(2)
    srv = ControlServer(ops, os.path.join(d, "control.sock"), users["group"], version="x")
    await srv.start()
    yield srv, ops
    await srv.close()
    await ops.aclose()
    shutil.rmtree(d, ignore_errors=True)


async def test_group_member_may_read_and_change_state(
    group_server: tuple[ControlServer, FakeOps], users: dict[str, str]
) -> None:
    srv, ops = group_server
    r = await as_user(users["member"], srv.path, "status", {})
    assert r["ok"] is True
    r = await as_user(users["member"], srv.path, "restart", {"worker": 1})
    assert r["ok"] is True and ("restart", (1,)) in ops.calls


async def test_outsider_cannot_open_the_socket(
    group_server: tuple[ControlServer, FakeOps], users: dict[str, str]
) -> None:
    srv, _ = group_server
    assert await as_user(users["outsider"], srv.path, "status", {}) == {
        "connect": "permission_denied"
    }


async def test_outsider_is_forbidden_even_if_the_mode_is_loosened(
    group_server: tuple[ControlServer, FakeOps], users: dict[str, str]
) -> None:
    srv, ops = group_server
    os.chmod(srv.path, 0o666)  # an admin's mistake: peer credentials still hold
    for cmd, args in (("status", {}), ("restart", {"worker": 0}), ("logs", {"worker": 0})):
        r = await as_user(users["outsider"], srv.path, cmd, args)
        assert error_code(r) == "forbidden", (cmd, r)
        assert f"members of the group {users['group']}" in r["error"]["message"]
    assert not any(c[0] == "restart" for c in ops.calls)


async def test_connections_beyond_the_cap_get_busy_and_others_still_work(
    ops: FakeOps, sockdir: str
) -> None:
    path = os.path.join(sockdir, "cap.sock")
    srv = ControlServer(ops, path, None, version="x", max_clients=2, idle_timeout=5, root_reserve=0)
    await srv.start()
    held = [await Conn.open(path), await Conn.open(path)]
    await asyncio.sleep(0.05)
    extra = await Conn.open(path)
    r = await extra.recv()
    assert error_code(r) == "busy" and "too many control connections" in r["error"]["message"]
    assert await extra.eof()
    await held[0].send({"id": 1, "cmd": "version"})
    assert (await held[0].recv())["ok"] is True
    for c in (*held, extra):
        await c.close()
    await srv.close()


# --- quarantine and release-gpu -----------------------------------------------------------


async def test_quarantined_worker_in_status_and_why_over_the_socket(
    server: ControlServer, ops: FakeOps
) -> None:
    ops.quarantine(2)
    st = (await call(server.path, "status"))["result"]
    w2 = st["workers"][2]
    assert (w2["state"], w2["pid"], st["ready"]) == ("quarantined", None, 3)
    assert w2["quarantine"]["gpu"] == 2 and w2["quarantine"]["reason"] == "xid 79"
    assert w2["quarantine"]["detail"].startswith("GPU has fallen off the bus")
    assert w2["quarantines_by_reason"] == {"xid 79": 1}
    assert st["workers"][0]["quarantine"] is None
    why = (await call(server.path, "why", {"worker": 2}))["result"]
    assert why["state"] == "quarantined" and why["quarantine"] == w2["quarantine"]
    assert why["state_note"].startswith("GPU 2 is quarantined (xid 79): GPU has fallen off")
    assert "`farmctl release-gpu 2`" in why["next_step"]


async def test_release_gpu_arguments_are_checked_and_the_connection_keeps_serving(
    server: ControlServer, ops: FakeOps
) -> None:
    c = await Conn.open(server.path)
    try:
        await c.send({"id": 1, "cmd": "release-gpu", "args": {"gpu": "two"}})
        r = await c.recv()
        assert r["id"] == 1 and error_code(r) == "bad_request"
        assert r["error"]["message"] == (
            "release-gpu: 'gpu' must be a GPU index (an integer >= 0), got 'two'"
        )
        await c.send({"id": 2, "cmd": "release-gpu", "args": {"gpu": 7}})
        r = await c.recv()
        assert r["id"] == 2 and error_code(r) == "bad_request"
        assert r["error"]["message"] == (
            "no worker of this farm uses GPU 7; its workers use GPU 0-3 (farmctl status lists them)"
        )
        await c.send({"id": 3, "cmd": "status"})
        assert (await c.recv())["ok"] is True
    finally:
        await c.close()
    assert ops.calls == []


async def test_refused_then_granted_release_over_the_socket(
    server: ControlServer, ops: FakeOps
) -> None:
    ops.quarantine(2)
    ops.release_problems = ["GPU 2 still has 3.0 GiB in use: free it first"]
    with capture_logs() as logs:
        r = await call(server.path, "release-gpu", {"gpu": 2}, rid="rel")
    assert r["id"] == "rel" and r["ok"] is True
    assert r["result"] == {
        "released": False,
        "gpu": 2,
        "workers": [2],
        "problems": ["GPU 2 still has 3.0 GiB in use: free it first"],
    }
    assert list(r["result"]) == ["released", "gpu", "workers", "problems"]
    ev = [e for e in logs if e["event"] == "control_command"]
    assert ev and ev[0]["cmd"] == "release-gpu" and ev[0]["args"] == {"gpu": 2}
    st = (await call(server.path, "status"))["result"]
    assert st["workers"][2]["state"] == "quarantined"  # the quarantine stays

    ops.release_problems = []
    r = await call(server.path, "release-gpu", {"gpu": 2})
    assert r["result"] == {"released": True, "gpu": 2, "workers": [2], "problems": []}
    msgs = await _wait_stream(server.path, {"worker": 2, "timeout": 5})
    assert msgs[-1]["result"]["ready"] is True
    assert (await call(server.path, "status"))["result"]["workers"][2]["quarantine"] is None


async def test_release_gpu_while_the_agent_restores_state_is_busy(
    server: ControlServer, ops: FakeOps
) -> None:
    ops.quarantine(1)
    ops.startup_reason = "the agent is restoring its state and adopting running workers"
    r = await call(server.path, "release-gpu", {"gpu": 1})
    assert error_code(r) == "busy"
    assert r["error"]["message"].startswith(
        f"{ops.startup_reason}; state changes wait until it is done: retry release-gpu in"
    )
    assert ops.calls == [] and ops.workers[1].quarantine is not None


# --- a flood of idle connections under a small descriptor limit (issue 22, item 13) ------

_SERVER_PROCESS = r"""
import asyncio, resource, sys
sys.path.insert(0, sys.argv[1])
# The process runtime's inherited limit (a login shell's soft 1,024), and nothing above it.
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
from fake_ops import FakeOps
from sglang_farm.control.server import ControlServer

async def main() -> None:
    ops = FakeOps(4)
    srv = ControlServer(ops, sys.argv[2], None, version="x", idle_timeout=60)
    await srv.start()
    print("LISTENING", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await srv.close()
    await ops.aclose()

asyncio.run(main())
"""


def _flood(path: str, n: int) -> list[socket.socket]:
    """`n` connections that never send a byte (a full listen queue leaves some unconnected)."""
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        with contextlib.suppress(BlockingIOError, InterruptedError):
            s.connect(path)
        socks.append(s)
    return socks


def test_1100_idle_connections_under_nofile_1024_leave_a_request_answered(sockdir: str) -> None:
    """1,100 idle connections made accept() fail with EMFILE (the cap of 1,024 was above the
    limit), so the next farmctl waited in the listen queue until it timed out. The cap now
    follows the limit: the next request is answered, at worst `busy`, at once."""
    from sglang_farm.control.client import Client
    from sglang_farm.errors import AgentError

    path = os.path.join(sockdir, "control.sock")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 4096), hard))  # for the flood
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVER_PROCESS, str(Path(__file__).parent), path],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    idle: list[socket.socket] = []
    try:
        assert proc.stdout is not None and proc.stdin is not None
        line = ""
        while line != "LISTENING\n":  # after the server's own log lines
            line = proc.stdout.readline()
            assert line, "the server process exited"
        idle = _flood(path, 1100)
        time.sleep(0.5)  # the server takes (and answers or holds) the flood
        try:
            answer: object = Client(path, timeout=10).call("version")
        except AgentError as exc:
            answer = exc.code
        assert answer == "busy" or isinstance(answer, dict), answer
    finally:
        for s in idle:
            s.close()
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(timeout=20)
        if proc.stdout is not None:
            proc.stdout.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# --- issue 30, item 10: a group member's connections and buffered bytes -------------------

# Run as another user: opens argv[2] connections, each sending argv[3] bytes of a line it
# never finishes, then waits up to 30 s until argv[4] of them are answered (or closed);
# prints how many were, and their error codes; holds the rest open until stdin closes.
HOLDER = r"""
import json, select, socket, sys, time
path, n, partial, want = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
socks = []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    if partial:
        head = b'{"id": 1, "cmd": "status", "pad": "'
        s.sendall(head + b"x" * (partial - len(head)))
    socks.append(s)
answers, pending, deadline = {}, set(socks), time.monotonic() + 30
while len(answers) < want and time.monotonic() < deadline:
    ready, _, _ = select.select(list(pending), [], [], 0.2)
    for s in ready:
        data = s.recv(65536)
        pending.discard(s)
        line = data.split(b"\n")[0]
        answers[s.fileno()] = json.loads(line)["error"] if line else {"code": "eof"}
print(json.dumps([a.get("code") for a in answers.values()]), flush=True)
print(json.dumps([a.get("message") for a in answers.values()][:1]), flush=True)
sys.stdin.read()
"""


async def _hold_as(user: str, path: str, n: int, partial: int, want: int) -> tuple[Any, list[Any]]:
    pw = pwd.getpwnam(user)
    proc = await asyncio.create_subprocess_exec(
        "setpriv",
        f"--reuid={pw.pw_uid}",
        f"--regid={pw.pw_gid}",
        "--init-groups",
        sys.executable,
        "-I",
        "-c",
        HOLDER,
        path,
        str(n),
        str(partial),
        str(want),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    codes = await asyncio.wait_for(proc.stdout.readline(), 60)
    messages = await asyncio.wait_for(proc.stdout.readline(), 5)
    assert codes, (await proc.communicate())[1].decode()
    return proc, [json.loads(codes), json.loads(messages)]


async def _release(proc: Any) -> None:
    proc.stdin.close()
    await asyncio.wait_for(proc.wait(), 20)


async def test_a_member_holding_every_connection_leaves_root_room(
    users: dict[str, str], sockdir: str
) -> None:
    """A group member's 1,024 held streams made root's `farmctl status` busy. Now one uid
    holds at most a quarter of the cap, and root has room beyond the cap."""
    os.chmod(sockdir, 0o755)
    ops = FakeOps(2)
    srv = ControlServer(
        ops, os.path.join(sockdir, "c.sock"), users["group"], version="x", max_clients=8
    )
    await srv.start()
    try:
        proc, (codes, messages) = await _hold_as(users["member"], srv.path, 8, 0, 6)
        assert codes == ["busy"] * 6, codes
        assert "its share of 8" in messages[0]
        # Root takes what is left of the cap and more: its commands are still answered.
        held = [await Conn.open(srv.path) for _ in range(6)]
        reply = await call(srv.path, "status")
        assert reply["ok"] is True, reply
        await _release(proc)
        for c in held:
            await c.close()
    finally:
        await srv.close()
        await ops.aclose()


async def test_unfinished_lines_are_bounded_in_all_and_root_still_served(
    users: dict[str, str], sockdir: str
) -> None:
    """1,100 connections holding 64 KiB of an unfinished line each took the agent from
    46 MiB to 260-415 MiB. The bytes held in all are bounded: past `BUFFER_BUDGET`, the
    member's connection is answered `busy` and closed, and root is still served."""
    budget = 4 << 20  # the bound docs/security.md names (server.BUFFER_BUDGET)
    os.chmod(sockdir, 0o755)
    ops = FakeOps(2)
    srv = ControlServer(ops, os.path.join(sockdir, "c.sock"), users["group"], version="x")
    await srv.start()
    n, size = 100, codec.MAX_LINE - 1
    fits = budget // size
    try:
        proc, (codes, messages) = await _hold_as(users["member"], srv.path, n, size, n - fits)
        assert len(codes) >= n - fits and set(codes) == {"busy"}, codes
        assert "too many unfinished requests" in messages[0]
        assert srv.buffered_bytes <= budget
        reply = await call(srv.path, "status")
        assert reply["ok"] is True, reply
        await _release(proc)
        await asyncio.sleep(0.2)
        assert srv.buffered_bytes == 0
    finally:
        await srv.close()
        await ops.aclose()
