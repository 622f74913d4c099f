"""The sock_diag messages (pure, over hand-built replies) and the kernel's LISTEN dump
against the tables it replaces on the liveness beats (issue 32, 4.8)."""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import struct
import time

import pytest

from sglang_farm.host import portowner, sockdiag
from sglang_farm.host.listeners import Listener

V4 = ipaddress.IPv4Address
V6 = ipaddress.IPv6Address


def _msg(family: int, state: int, address: bytes, port: int, uid: int, inode: int) -> bytes:
    sockid = struct.pack("!HH", port, 0) + address.ljust(16, b"\0") + bytes(16) + bytes(12)
    body = (
        struct.pack("=BBBB", family, state, 0, 0) + sockid + struct.pack("=5I", 0, 0, 0, uid, inode)
    )
    assert len(body) == 72
    return struct.pack("=IHHII", 16 + len(body), sockdiag.SOCK_DIAG_BY_FAMILY, 2, 1, 0) + body


def _done() -> bytes:
    return struct.pack("=IHHII", 20, sockdiag.NLMSG_DONE, 2, 1, 0) + struct.pack("=i", 0)


def test_the_request_asks_one_family_for_tcp_listen_sockets_only() -> None:
    req = sockdiag.dump_request(socket.AF_INET6, 7)
    length, kind, flags, seq, _pid = struct.unpack_from("=IHHII", req)
    family, proto, _ext, _pad, states = struct.unpack_from("=BBBBI", req, 16)
    assert (length, len(req), kind, seq) == (72, 72, sockdiag.SOCK_DIAG_BY_FAMILY, 7)
    assert flags == sockdiag.NLM_F_REQUEST | sockdiag.NLM_F_DUMP
    assert (family, proto, states) == (socket.AF_INET6, socket.IPPROTO_TCP, 1 << 10)
    assert req[24:] == bytes(48)  # every socket: no address or port to match


def test_a_reply_gives_its_listeners_and_says_where_the_dump_ends() -> None:
    lo = bytes([127, 0, 0, 1])
    mapped = V6("::ffff:127.0.0.1").packed
    data = (
        _msg(socket.AF_INET, 10, lo, 30003, 65534, 4711)
        + _msg(socket.AF_INET, 1, lo, 30004, 0, 4799)  # ESTABLISHED: not a listener
        + _msg(socket.AF_INET, 10, lo, 30005, 0, 0)  # no inode: nothing to trace
        + _msg(socket.AF_INET6, 10, mapped, 30007, 0, 5003)
    )
    assert sockdiag.parse_reply(data) == (
        [
            Listener(V4("127.0.0.1"), 30003, 65534, 4711),
            Listener(V6("::ffff:127.0.0.1"), 30007, 0, 5003),
        ],
        False,
    )
    assert sockdiag.parse_reply(data[:92] + _done()) == (
        [Listener(V4("127.0.0.1"), 30003, 65534, 4711)],
        True,
    )


def test_a_refused_dump_raises_its_errno_and_a_short_message_is_skipped() -> None:
    err = struct.pack("=IHHII", 36, sockdiag.NLMSG_ERROR, 0, 1, 0) + struct.pack("=i", -errno.EPERM)
    with pytest.raises(sockdiag.DiagError) as exc:
        sockdiag.parse_reply(err + bytes(16))
    assert exc.value.errno == errno.EPERM
    short = struct.pack("=IHHII", 24, sockdiag.SOCK_DIAG_BY_FAMILY, 2, 1, 0) + bytes(8)
    assert sockdiag.parse_reply(short + _done()) == ([], True)
    # A length past the buffer ends the parse: nothing after it can be trusted.
    assert sockdiag.parse_reply(struct.pack("=IHHII", 999, 20, 2, 1, 0)) == ([], True)


def test_the_kernels_listen_dump_is_every_listener_of_the_tables(
    sockets: list[socket.socket],
) -> None:
    """The same listeners as `/proc/net/tcp{,6}`, with connections and TIME-WAIT sockets
    beside them, over IPv4 and IPv6 (where the host has it)."""
    v4 = socket.socket()
    v4.bind(("127.0.0.1", 0))
    v4.listen()
    sockets.append(v4)
    port = v4.getsockname()[1]
    if socket.has_ipv6 and os.path.exists("/proc/net/tcp6"):
        with_v6 = socket.socket(socket.AF_INET6)
        sockets.append(with_v6)
        try:
            with_v6.bind(("::1", 0))
            with_v6.listen()
        except OSError:
            pass  # no ::1 here: IPv4 alone
    for _ in range(20):  # connections, some closed to TIME-WAIT: rows the dump skips
        c = socket.create_connection(("127.0.0.1", port))
        a = v4.accept()[0]
        c.close()
        sockets.append(a)
    # Other processes of this machine open and close listeners meanwhile: compared only
    # while the tables read the same before and after.
    for _ in range(50):
        before = set(portowner.read_listeners())
        dumped = portowner.diag_listeners()
        after = set(portowner.read_listeners())
        if before == after:
            assert sorted(dumped, key=str) == sorted(before, key=str)
            break
        time.sleep(0.05)
    else:
        pytest.fail("the machine's listeners never held still for three reads")
    assert any(x.port == port and x.inode for x in dumped)


def test_without_sock_diag_the_listeners_come_from_the_tables(
    sockets: list[socket.socket],
) -> None:
    """An old kernel or a sandbox without sock_diag: the tables, as before."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    sockets.append(s)

    def refused() -> list[Listener]:
        raise sockdiag.DiagError(errno.EPROTONOSUPPORT, "no sock_diag")

    found = portowner.kernel_listeners(diag=refused)
    assert any(x.port == s.getsockname()[1] for x in found)
