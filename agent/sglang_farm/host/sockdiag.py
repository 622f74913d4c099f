"""Pure: the kernel's sock_diag netlink messages that list the LISTEN TCP sockets.

Why not `/proc/net/tcp`: the kernel prints every socket of the namespace there, the
connections and TIME-WAIT ones included, whatever the reader wants; with 1,700 TIME-WAIT
connections on the 2-core test machine one reading of `tcp` and `tcp6` cost 13 ms of CPU
(`tcp6` walks the whole connection hash even when it prints nothing), and the liveness
beats read them up to once a second: about 1 % of a core of an idle agent (issue 32,
4.8). A sock_diag dump asking for LISTEN only walks the listening hash alone
(net/ipv4/inet_diag.c, `inet_diag_dump_icsk` skips the connection hash when no other
state is asked for; `ss -lt` asks so): 0.1 ms for both families, however busy the host.

The messages (include/uapi/linux/netlink.h, sock_diag.h, inet_diag.h), native byte order
unless "be":

    nlmsghdr          len u32, type u16, flags u16, seq u32, pid u32          16 bytes
    inet_diag_req_v2  family u8, protocol u8, ext u8, pad u8, states u32, id  56 bytes
    inet_diag_sockid  sport be16, dport be16, src be32[4], dst be32[4],
                      if u32, cookie u32[2]                                    48 bytes
    inet_diag_msg     family u8, state u8, timer u8, retrans u8, id,
                      expires u32, rqueue u32, wqueue u32, uid u32, inode u32 72 bytes

The reply is one or more buffers of messages; `NLMSG_DONE` ends the dump, `NLMSG_ERROR`
carries a negative errno.
"""

from __future__ import annotations

import ipaddress
import socket
import struct

from sglang_farm.host.listeners import Listener

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLMSG_ERROR = 2
NLMSG_DONE = 3
NLM_F_REQUEST = 0x1
NLM_F_DUMP = 0x300  # NLM_F_ROOT | NLM_F_MATCH
TCP_LISTEN = 10  # include/net/tcp_states.h
FAMILIES = (socket.AF_INET, socket.AF_INET6)

_HDR = struct.Struct("=IHHII")
_REQ = struct.Struct("=BBBBI48x")  # the socket id is all zeros: every socket
_MSG_HEAD = struct.Struct("=BB2x")
_SPORT = struct.Struct("!H")
_UID_INODE = struct.Struct("=II")
_MSG_LEN = 72
_ADDRESS_AT = 8  # inet_diag_msg: 4 bytes of head, sport and dport, then src
_UID_AT = 64


class DiagError(OSError):
    """The kernel refused the dump (`NLMSG_ERROR`): its errno."""


def dump_request(family: int, seq: int) -> bytes:
    """A request for every LISTEN TCP socket of `family` (AF_INET or AF_INET6)."""
    body = _REQ.pack(family, socket.IPPROTO_TCP, 0, 0, 1 << TCP_LISTEN)
    return (
        _HDR.pack(_HDR.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, seq, 0)
        + body
    )


def parse_reply(data: bytes) -> tuple[list[Listener], bool]:
    """One buffer of a dump's reply -> its listeners, and whether the dump ended in it.

    A message of another state or family, a short one or one without an inode is
    skipped, as `listeners.parse_listeners` skips a row it does not understand: an
    unseen listener never makes a worker ready. Raises `DiagError` for `NLMSG_ERROR`.
    """
    out: list[Listener] = []
    off = 0
    while off + _HDR.size <= len(data):
        length, kind, _flags, _seq, _pid = _HDR.unpack_from(data, off)
        if length < _HDR.size or off + length > len(data):
            return out, True  # a malformed length: nothing after it can be trusted
        if kind == NLMSG_DONE:
            return out, True
        if kind == NLMSG_ERROR:
            errno = -struct.unpack_from("=i", data, off + _HDR.size)[0]
            raise DiagError(errno, f"sock_diag dump refused: errno {errno}")
        body = data[off + _HDR.size : off + length]
        if kind == SOCK_DIAG_BY_FAMILY and len(body) >= _MSG_LEN:
            found = _listener(body)
            if found is not None:
                out.append(found)
        off += (length + 3) & ~3  # NLMSG_ALIGN
    return out, False


def _listener(body: bytes) -> Listener | None:
    family, state = _MSG_HEAD.unpack_from(body)
    if state != TCP_LISTEN or family not in FAMILIES:
        return None
    uid, inode = _UID_INODE.unpack_from(body, _UID_AT)
    if inode == 0:
        return None  # no socket inode (being torn down): nothing to trace
    size = 4 if family == socket.AF_INET else 16
    raw = body[_ADDRESS_AT : _ADDRESS_AT + size]
    address = ipaddress.IPv4Address(raw) if size == 4 else ipaddress.IPv6Address(raw)
    return Listener(address, _SPORT.unpack_from(body, 4)[0], uid, inode)
