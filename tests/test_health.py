"""Health probes against real sockets: the worker's failures vs the agent's own, bounded bodies."""

from __future__ import annotations

import asyncio
import errno
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler

import httpx
import pytest

from http_fakes import Sent, endless_body_server, serving
from sglang_farm.sglang.health import HEALTH_BODY_LIMIT, LocalHttp, probe


@contextmanager
def health_server(status: int = 200) -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:  # `format`: stdlib's name
            return None

    with serving(Handler) as url:
        yield url


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_healthy_worker_is_ok_and_not_local() -> None:
    with health_server(200) as url:
        async with httpx.AsyncClient() as client:
            r = await probe(client, f"{url}/health", 5)
    assert (r.ok, r.detail, r.refused, r.local_error) == (True, "200", False, False)


async def test_a_refused_connection_is_the_workers_and_not_local() -> None:
    async with httpx.AsyncClient() as client:
        r = await probe(client, f"http://127.0.0.1:{_closed_port()}/health", 5)
    assert (r.ok, r.refused, r.local_error) == (False, True, False)


_EXHAUST = r"""
import asyncio, json, os, resource, sys
import httpx
from sglang_farm.sglang.health import probe

async def main() -> None:
    async with httpx.AsyncClient() as warm:  # imports what a probe needs while fds are left
        await probe(warm, sys.argv[1], 5)
    async with httpx.AsyncClient() as client:
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        held = []
        try:
            while True:
                held.append(os.open("/dev/null", os.O_RDONLY))
        except OSError as exc:
            assert exc.errno == 24, exc  # EMFILE: every descriptor is taken
        r = await probe(client, sys.argv[1], 5)
        for fd in held:
            os.close(fd)
    print(json.dumps({"ok": r.ok, "refused": r.refused, "local": r.local_error,
                      "detail": r.detail}))

asyncio.run(main())
"""


def test_a_probe_that_finds_the_agent_out_of_fds_is_unknown_not_the_workers_failure() -> None:
    """The agent's own EMFILE must never read as the worker refusing or failing."""
    with health_server(200) as url:
        out = subprocess.run(
            [sys.executable, "-c", _EXHAUST, f"{url}/health"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["local"] is True, result
    assert result["ok"] is False and result["refused"] is False, result
    assert "Too many open files" in result["detail"], result


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM])
async def test_a_local_oserror_raised_by_the_transport_is_unknown(code: int) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise OSError(code, "local trouble")

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        r = await probe(client, "http://127.0.0.1:1/health", 5)
    assert (r.ok, r.refused, r.local_error) == (False, False, True)


async def test_a_reset_connection_stays_the_workers_failure() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadError("reset", request=request) from ConnectionResetError(
            errno.ECONNRESET, "Connection reset by peer"
        )

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        r = await probe(client, "http://127.0.0.1:1/health", 5)
    assert (r.ok, r.local_error) == (False, False)


async def test_an_endless_health_body_is_judged_by_its_status_without_reading_it_all() -> None:
    sent = Sent()
    with endless_body_server(status=200, sent=sent) as url:
        async with httpx.AsyncClient() as client:
            r = await probe(client, f"{url}/health", 3)
        # The verdict is the status, not "timeout after 3 s": the read stopped at the
        # limit, and the probe hung up on the rest.
        assert r.ok and r.local_error is False
        assert f"over {HEALTH_BODY_LIMIT // 1024} KiB" in r.detail
        assert await asyncio.to_thread(sent.wait_hung_up)
    assert sent.body_bytes > HEALTH_BODY_LIMIT  # it did send more than the probe read


async def test_a_worker_dripping_a_body_forever_times_out_at_the_probe_timeout() -> None:
    """httpx's timeout is per read: one byte every 50 ms would never trip it on its own."""
    with endless_body_server(status=200, chunk=b"x", interval_s=0.05) as url:
        async with httpx.AsyncClient() as client:
            t0 = time.monotonic()
            async with asyncio.timeout(10):  # 10x the probe's timeout: catches only a hang
                r = await probe(client, f"{url}/health", 1)
    assert time.monotonic() - t0 >= 0.9  # not before its timeout (slowness only adds)
    assert (r.ok, r.local_error) == (False, False)
    assert r.detail == "timeout after 1 s"


_PORT_CHECK_OUT_OF_FDS = r"""
import json, os, resource, sys
from sglang_farm.host.ports import port_problem, port_state

resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
held = []
try:
    while True:
        held.append(os.open("/dev/null", os.O_RDONLY))
except OSError as exc:
    assert exc.errno == 24, exc  # EMFILE: every descriptor is taken
problem = port_problem("127.0.0.1", int(sys.argv[1]))
state = str(port_state("127.0.0.1", int(sys.argv[1])))
for fd in held:
    os.close(fd)
print(json.dumps({"problem": problem, "state": state}))
"""


def test_the_port_check_reports_rather_than_raises_when_the_agent_is_out_of_fds() -> None:
    """The relaunch's port gate must not raise (a raise there counted as the worker's crash)."""
    out = subprocess.run(
        [sys.executable, "-c", _PORT_CHECK_OUT_OF_FDS, str(_closed_port())],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["state"] == "unknown"  # the launch gate does not blame the worker
    assert "Too many open files" in result["problem"]
    assert "agent" in result["problem"]  # says whose problem it is, not the port's


# --- LocalHttp: the agent's own client for probes and polls (issue 17) -------------------


async def test_local_http_judges_status_and_refusal_as_httpx_does() -> None:
    client = LocalHttp()
    with health_server(200) as ok_url, health_server(503) as busy_url:
        ok = await probe(client, f"{ok_url}/health", 5)
        busy = await probe(client, f"{busy_url}/health", 5)
    refused = await probe(client, f"http://127.0.0.1:{_closed_port()}/health", 5)
    assert (ok.ok, ok.detail, ok.refused, ok.local_error) == (True, "200", False, False)
    assert (busy.ok, busy.detail, busy.refused) == (False, "503", False)
    assert (refused.ok, refused.refused, refused.local_error) == (False, True, False)


async def test_local_http_reads_chunked_bodies_and_bounds_an_endless_one() -> None:
    sent = Sent()
    with endless_body_server(status=200, sent=sent) as url:
        r = await probe(LocalHttp(), f"{url}/health", 3)
        answer = await LocalHttp().get(f"{url}/x", limit=3 * 65536 + 1)
        # The status verdict, not "timeout after 3 s"; both reads hung up at their limit.
        assert await asyncio.to_thread(sent.wait_hung_up, 2)
    assert r.ok and f"over {HEALTH_BODY_LIMIT // 1024} KiB" in r.detail
    assert answer.truncated and len(answer.body) == 3 * 65536  # three whole chunks, no more


async def test_local_http_times_out_a_dripping_body_at_the_probe_timeout() -> None:
    with endless_body_server(status=200, chunk=b"x", interval_s=0.05) as url:
        t0 = time.monotonic()
        async with asyncio.timeout(10):  # 10x the probe's timeout: catches only a hang
            r = await probe(LocalHttp(), f"{url}/health", 1)
    assert time.monotonic() - t0 >= 0.9  # not before its timeout (slowness only adds)
    assert (r.ok, r.local_error, r.detail) == (False, False, "timeout after 1 s")


async def test_local_http_answers_a_garbled_head_as_the_workers_failure() -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]

    def answer() -> None:
        conn, _ = server.accept()
        conn.recv(4096)
        conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        conn.close()

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    r = await probe(LocalHttp(), f"http://127.0.0.1:{port}/health", 5)
    t.join(5)
    server.close()
    assert (r.ok, r.refused, r.local_error) == (False, False, False)
    assert "malformed" in r.detail


_EXHAUST_LOCAL = _EXHAUST.replace("import httpx", "from sglang_farm.sglang.health import LocalHttp")
_EXHAUST_LOCAL = _EXHAUST_LOCAL.replace(
    "async with httpx.AsyncClient() as warm:", "if warm := LocalHttp():"
).replace("async with httpx.AsyncClient() as client:", "if client := LocalHttp():")


def test_local_http_out_of_fds_is_the_agents_trouble_not_the_workers() -> None:
    with health_server(200) as url:
        out = subprocess.run(
            [sys.executable, "-c", _EXHAUST_LOCAL, f"{url}/health"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert (result["local"], result["ok"], result["refused"]) == (True, False, False), result
    assert "Too many open files" in result["detail"], result
