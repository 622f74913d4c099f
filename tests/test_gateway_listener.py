"""Issue 30, item 3: the managed gateway's admin key goes only to the farm's own listener.

`gateway.listener.ListenerGuard` checks, before each request that carries the key, that
the socket listening on the gateway's port is held by the gateway's own processes, and
after it that the port did not change hands meanwhile; a key that may have reached
another process is replaced (`gateway.rotation.KeyRotation`) and smg restarted to read
it. Real sockets and the real /proc; the other user is `nobody` for real.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from pathlib import Path

import httpx
import pytest

from asuser import popen_as_nobody, require
from async_wait import wait_until
from sglang_farm.errors import GatewayError, GatewayErrorCode
from sglang_farm.gateway.adminkey import ensure_admin_key
from sglang_farm.gateway.listener import ListenerGuard, read_listening
from sglang_farm.gateway.managed import GENERATED_ADMIN_KEY_NAME
from sglang_farm.gateway.rotation import KeyRotation
from sglang_farm.gateway.smg import SmgGateway
from sglang_farm.host.portowner import read_listeners
from sglang_farm.runtime.gateway_child import ChildGateway


def listening(port: int = 0) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


class Runner:
    def __init__(self) -> None:
        self.restarts = 0

    async def restart(self) -> None:
        self.restarts += 1


async def own_pids() -> frozenset[int]:
    return frozenset({os.getpid()})


class Gateway:
    """The gateway's processes as the guard asks for them: this test's own, until `gone`
    (another process, the test's, then holds the port: not the gateway's)."""

    def __init__(self) -> None:
        self.gone = False

    async def pids(self) -> frozenset[int]:
        return frozenset({1}) if self.gone else frozenset({os.getpid()})


async def test_a_port_that_changes_hands_during_a_request_gets_the_key_replaced(
    tmp_path: Path, sockets: list[socket.socket]
) -> None:
    sockets.append(listening())
    port = sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    key_file = tmp_path / GENERATED_ADMIN_KEY_NAME
    old_key = ensure_admin_key(key_file)
    sent: list[str] = []
    swap = [True]
    gateway = Gateway()

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request.headers.get("authorization", ""))
        if swap[0]:
            # While the request runs, the gateway's socket goes away and another
            # process's takes the port: the key may have reached whoever holds it.
            swap[0] = False
            sockets.pop().close()
            sockets.append(listening(port))
            gateway.gone = True
        return httpx.Response(200, json={"workers": []})

    guard = ListenerGuard(url, "127.0.0.1", port, gateway.pids)
    runner = Runner()
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        client = SmgGateway(url, api_key=old_key, client=http, guard=guard)
        rotation = KeyRotation(url, key_file, runner, client.set_key)
        guard.on_exposed = rotation.exposed
        assert await client.list() == []
        await rotation.wait()
        new_key = key_file.read_text().strip()
        assert new_key != old_key and len(new_key) >= 40
        assert oct(key_file.stat().st_mode & 0o777) == "0o600"
        assert runner.restarts == 1 and rotation.rotations == 1
        # The next request carries the new key; the port did not change: nothing rotated.
        gateway.gone = False  # (the test's socket plays the restarted gateway's from now)
        assert await client.list() == []
        await rotation.wait()
    assert sent == [f"Bearer {old_key}", f"Bearer {new_key}"]
    assert runner.restarts == 1 and rotation.rotations == 1


async def test_the_gateways_own_new_socket_during_a_request_is_no_exposure(
    sockets: list[socket.socket],
) -> None:
    """smg restarted (by itself, or by the agent for a new key) binds a new socket: the
    port changed hands, but only between the gateway's own processes."""
    sockets.append(listening())
    port = sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}"

    def handler(request: httpx.Request) -> httpx.Response:
        sockets.pop().close()
        sockets.append(listening(port))
        return httpx.Response(200, json={"workers": []})

    exposed: list[str] = []
    guard = ListenerGuard(url, "127.0.0.1", port, own_pids, on_exposed=exposed.append)
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        client = SmgGateway(url, api_key="k" * 43, client=http, guard=guard)
        assert await client.list() == []
        assert await client.list() == []
    assert exposed == []


async def test_a_listener_of_another_user_is_sent_nothing() -> None:
    require()
    code = (
        "import socket, sys, time\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
        "print(s.getsockname()[1], flush=True); time.sleep(120)\n"
    )
    squatter = popen_as_nobody([sys.executable, "-I", "-c", code])
    try:
        assert squatter.stdout is not None
        port = int(squatter.stdout.readline())
        url = f"http://127.0.0.1:{port}"
        sent: list[httpx.Request] = []

        def handler(request: httpx.Request) -> httpx.Response:
            sent.append(request)
            return httpx.Response(200, json={"workers": []})

        exposed: list[str] = []
        guard = ListenerGuard(url, "127.0.0.1", port, own_pids, on_exposed=exposed.append)
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            client = SmgGateway(url, api_key="k" * 43, client=http, guard=guard)
            with pytest.raises(GatewayError) as err:
                await client.list()
            assert not await client.up()
        assert err.value.code is GatewayErrorCode.NOT_OURS
        # Whoever holds the port may have had the key from an earlier agent: replaced,
        # once for this squat (not at every refused request).
        assert len(exposed) == 1 and f"PID {squatter.pid} (user nobody)" in exposed[0]
        assert f"PID {squatter.pid} (user nobody)" in str(err.value)
        assert "k" * 43 not in str(err.value)
        assert sent == []
    finally:
        squatter.kill()
        squatter.communicate(timeout=10)


async def test_nothing_listening_is_unreachable_and_sent_nothing() -> None:
    with listening() as s:
        port = s.getsockname()[1]
    guard = ListenerGuard(f"http://127.0.0.1:{port}", "127.0.0.1", port, own_pids)
    with pytest.raises(GatewayError) as err:
        await guard.verify()
    assert err.value.code is GatewayErrorCode.UNREACHABLE


async def test_the_child_gateway_restarts_at_once_for_a_new_key(tmp_path: Path) -> None:
    waits: list[float] = []

    async def sleep(s: float) -> None:
        waits.append(s)
        await asyncio.sleep(0)

    child = ChildGateway(
        [sys.executable, "-c", "import time; time.sleep(600)"], tmp_path / "gw.log", sleep=sleep
    )
    await child.start()
    try:
        await wait_until(lambda: child.pid is not None, 60)
        first = child.pid
        assert first in await child.pids()
        await child.restart()
        await wait_until(lambda: child.pid not in (None, first), 60)
        assert waits == []  # no back-off: the restart is the agent's own
        assert first not in await child.pids()
    finally:
        await child.close()


def test_the_listeners_read_are_every_listener_of_the_tables(
    sockets: list[socket.socket],
) -> None:
    """`read_listening` stops each table at its first row of another state (the kernel
    prints the listening hash first): on this kernel it finds every LISTEN socket the
    whole tables hold, with many connections after them."""
    sockets.append(listening())
    port = sockets[0].getsockname()[1]
    for _ in range(20):  # connections: rows after the listeners
        c = socket.create_connection(("127.0.0.1", port))
        sockets.append(c)
        sockets.append(sockets[0].accept()[0])
    # Other processes of this machine open and close listeners meanwhile: compared only
    # while the whole tables read the same before and after.
    for _ in range(50):
        before, prefix, after = set(read_listeners()), set(read_listening()), set(read_listeners())
        if before == after:
            assert prefix == before
            break
    else:
        pytest.fail("the machine's listeners never held still for three reads")
    assert any(x.port == port for x in read_listening())
