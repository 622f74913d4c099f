"""sd_notify datagrams, read off a real local NOTIFY_SOCKET (no systemd needed)."""

from __future__ import annotations

import asyncio
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from sglang_farm.runtime.notify import extend_timeout, keep_start_alive, notify


@pytest.fixture
def notify_socket(monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A datagram socket where systemd's would be, named in NOTIFY_SOCKET."""
    folder = Path(tempfile.mkdtemp(prefix="sf"))  # AF_UNIX paths are capped at 107 bytes
    path = folder / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.setblocking(False)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    try:
        yield sock
    finally:
        sock.close()
        path.unlink()
        folder.rmdir()


def received(sock: socket.socket) -> list[str]:
    """Every datagram waiting on `sock`, in order."""
    out: list[str] = []
    while True:
        try:
            out.append(sock.recv(4096).decode())
        except BlockingIOError:
            return out


def test_notify_sends_the_fields_as_one_datagram(notify_socket: socket.socket) -> None:
    assert notify("READY=1", "STATUS=2/8 ready")
    assert received(notify_socket) == ["READY=1\nSTATUS=2/8 ready"]


def test_notify_without_systemd_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert not notify("READY=1")
    assert not extend_timeout(30)


def test_extend_timeout_sends_whole_microseconds(notify_socket: socket.socket) -> None:
    assert extend_timeout(30)
    assert extend_timeout(1.5)
    assert received(notify_socket) == [
        "EXTEND_TIMEOUT_USEC=30000000",
        "EXTEND_TIMEOUT_USEC=1500000",
    ]


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_extend_timeout_refuses_a_window_systemd_cannot_take(bad: float) -> None:
    with pytest.raises(ValueError, match="EXTEND_TIMEOUT_USEC"):
        extend_timeout(bad)


async def test_keep_start_alive_extends_the_start_while_a_slow_preflight_runs(
    notify_socket: socket.socket,
) -> None:
    # A preflight of 0.35 s with a 0.3 s window: extended at entry, every window/3
    # while it runs (each extension outlives the next), and once more at exit so the
    # rest of the start gets a whole window.
    async with keep_start_alive(window=0.3):
        await asyncio.sleep(0.35)
        during = received(notify_socket)
    after = received(notify_socket)
    assert set(during) == {"EXTEND_TIMEOUT_USEC=300000"}
    assert 3 <= len(during) <= 6, during  # at 0, 0.1, 0.2, 0.3 s
    assert after == ["EXTEND_TIMEOUT_USEC=300000"]


async def test_keep_start_alive_stops_extending_after_its_limit(
    notify_socket: socket.socket,
) -> None:
    # A preflight that hangs past `limit` is no longer covered: the start then fails at
    # the unit's own deadline instead of never.
    async with keep_start_alive(window=0.3, limit=0.15):
        await asyncio.sleep(0.5)
        during = received(notify_socket)
    assert 1 <= len(during) <= 3, during  # at 0 and 0.1 s, none after 0.15 s
    assert received(notify_socket) == []  # no final extension once the limit passed


async def test_keep_start_alive_without_systemd_just_runs_the_body(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    ran = False
    async with keep_start_alive(window=0.3):
        ran = True
    assert ran
