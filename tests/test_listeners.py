"""The TCP-table parser and the ownership verdict (pure), over sample `/proc/net/tcp{,6}` text."""

from __future__ import annotations

import ipaddress

from sglang_farm.host.listeners import (
    Listener,
    OwnerKind,
    Ownership,
    judge,
    parse_listeners,
    reaches,
)

# As a little-endian host prints them (x86_64): 127.0.0.1:30003 LISTEN by uid 65534, an
# established connection to it, 0.0.0.0:22 LISTEN by root, and 127.0.0.1:30004 in TIME_WAIT.
TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:7533 00000000:0000 0A 00000000:00000000 00:00000000 00000000 65534        0 4711 1 00000000c833f5c3 100 0 0 10 0
   1: 00000000:0016 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 15267 1 00000000afbd38c9 100 0 0 10 0
   2: 0100007F:7533 0100007F:D431 01 00000000:00000000 00:00000000 00000000 65534        0 4799 1 0000000000000000 20 4 30 10 -1
   3: 0100007F:7534 0100007F:D432 06 00000000:00000000 03:00000A3C 00000000     0        0 0 3 0000000000000000
"""  # noqa: E501

# ::1:30005 and :::30006 LISTEN, ::ffff:127.0.0.1:30007 LISTEN, an established ::1 row.
TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000001000000:7535 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000   998        0 5001 1 0000000000000000 100 0 0 10 0
   1: 00000000000000000000000000000000:7536 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 5002 1 0000000000000000 100 0 0 10 0
   2: 0000000000000000FFFF00000100007F:7537 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 5003 1 0000000000000000 100 0 0 10 0
   3: 00000000000000000000000001000000:B515 00000000000000000000000001000000:E4AE 01 00000000:00000000 03:0000047C 00000000     0        0 5004 3 0000000000000000
"""  # noqa: E501

V4 = ipaddress.IPv4Address
V6 = ipaddress.IPv6Address


def test_parse_listeners_keeps_only_listen_rows_with_address_port_uid_and_inode() -> None:
    assert parse_listeners(TCP, byteorder="little") == [
        Listener(V4("127.0.0.1"), 30003, 65534, 4711),
        Listener(V4("0.0.0.0"), 22, 0, 15267),
    ]


def test_parse_listeners_reads_ipv6_words_in_host_order() -> None:
    assert parse_listeners(TCP6, byteorder="little") == [
        Listener(V6("::1"), 30005, 998, 5001),
        Listener(V6("::"), 30006, 0, 5002),
        Listener(V6("::ffff:127.0.0.1"), 30007, 0, 5003),
    ]


def test_parse_listeners_on_a_big_endian_host_reads_words_as_printed() -> None:
    row = "   0: 7F000001:7533 00000000:0000 0A 00000000:00000000 00:00000000 00000000 0 0 9 1 0"
    assert parse_listeners(row, byteorder="big") == [Listener(V4("127.0.0.1"), 30003, 0, 9)]


def test_parse_listeners_skips_rows_it_does_not_understand() -> None:
    text = "\n".join(
        [
            "   0: 0100007F:7533 00000000:0000 0A",  # truncated
            "   1: 0100007F:ZZZZ 00000000:0000 0A 0:0 0:0 0 0 0 77 1 0",  # bad port
            "   2: 01007F:7533 00000000:0000 0A 0:0 0:0 0 0 0 78 1 0",  # bad address width
            "   3: 0100007F:7533 00000000:0000 0A 0:0 0:0 0 0 0 0 1 0",  # no inode
            "garbage",
            "",
        ]
    )
    assert parse_listeners(text, byteorder="little") == []


def _l(addr: str, port: int = 30003, inode: int = 1, uid: int = 0) -> Listener:
    return Listener(ipaddress.ip_address(addr), port, uid, inode)


def test_a_connection_reaches_the_same_address_and_wildcards_of_its_port() -> None:
    assert reaches(_l("127.0.0.1"), "127.0.0.1", 30003)
    assert reaches(_l("0.0.0.0"), "127.0.0.1", 30003)
    assert reaches(_l("::"), "127.0.0.1", 30003)  # dual-stack unless IPV6_V6ONLY
    assert reaches(_l("::ffff:127.0.0.1"), "127.0.0.1", 30003)
    assert reaches(_l("::1"), "::1", 30003)
    assert reaches(_l("::"), "::1", 30003)
    assert reaches(_l("10.0.0.5"), "worker-3.example", 30003)  # a name: any address counts


def test_a_connection_does_not_reach_other_ports_or_addresses() -> None:
    assert not reaches(_l("127.0.0.1", port=30004), "127.0.0.1", 30003)
    assert not reaches(_l("10.0.0.5"), "127.0.0.1", 30003)
    assert not reaches(_l("0.0.0.0"), "::1", 30003)  # an IPv4 wildcard takes no IPv6
    assert not reaches(_l("::1"), "127.0.0.1", 30003)


def test_judge_nothing_listening_is_none() -> None:
    v = judge([_l("127.0.0.1", port=30004)], "127.0.0.1", 30003, ours=frozenset(), holders={})
    assert v == Ownership(OwnerKind.NONE, 30003)


def test_judge_a_listener_held_by_the_workers_processes_is_ours() -> None:
    v = judge([_l("0.0.0.0", inode=7)], "127.0.0.1", 30003, ours=frozenset({7}), holders={})
    assert v == Ownership(OwnerKind.OURS, 30003, inodes=frozenset({7}))


def test_judge_a_listener_held_by_another_process_is_foreign_and_named() -> None:
    v = judge(
        [_l("127.0.0.1", inode=7, uid=65534)],
        "127.0.0.1",
        30003,
        ours=frozenset(),
        holders={7: frozenset({4243, 4242})},
    )
    assert (v.kind, v.pid, v.uid) == (OwnerKind.FOREIGN, 4242, 65534)
    assert v.holder() == "PID 4242 (user uid 65534)"


def test_judge_one_foreign_listener_beside_ours_is_foreign() -> None:
    # SO_REUSEPORT: both sockets take connections; the worker's own is not enough.
    ls = [_l("0.0.0.0", inode=7), _l("127.0.0.1", inode=8, uid=65534)]
    v = judge(ls, "127.0.0.1", 30003, ours=frozenset({7}), holders={8: frozenset({99})})
    assert (v.kind, v.pid) == (OwnerKind.FOREIGN, 99)


def test_judge_a_listener_no_process_holds_without_a_worker_to_compare_is_unseen() -> None:
    ls = [_l("127.0.0.1", inode=7, uid=65534)]
    v = judge(ls, "127.0.0.1", 30003, ours=frozenset(), holders={})
    assert (v.kind, v.pid, v.uid) == (OwnerKind.UNSEEN, None, 65534)


def test_judge_an_unseen_listener_of_another_user_is_foreign_named_by_user() -> None:
    # The hardened agent (no CAP_SYS_PTRACE) cannot read nobody's descriptors.
    ls = [_l("127.0.0.1", inode=7, uid=65534)]
    v = judge(ls, "127.0.0.1", 30003, ours=frozenset(), holders={}, our_uids=frozenset({998}))
    assert (v.kind, v.pid, v.uid) == (OwnerKind.FOREIGN, None, 65534)
    assert v.holder() == "a process of user uid 65534 (the agent cannot see which)"
    leads = Ownership(v.kind, v.port, None, 65534, "nobody", candidates=(1, 2, 3, 4, 5, 6))
    assert leads.holder() == (
        "a process of user nobody (the agent cannot see which; that user runs "
        "PID 1, 2, 3, 4, 5, ...)"
    )


def test_judge_an_unseen_listener_of_the_workers_own_user_counts_as_its_own() -> None:
    # Nor the worker user's: only that user (or root) could have bound it.
    ls = [_l("127.0.0.1", inode=7, uid=998)]
    v = judge(ls, "127.0.0.1", 30003, ours=frozenset(), holders={}, our_uids=frozenset({998}))
    assert v.kind is OwnerKind.OURS


def test_judge_a_seen_holder_of_the_workers_user_outside_its_tree_is_foreign() -> None:
    # Another worker of the same user, seen: named, not excused by its user.
    ls = [_l("127.0.0.1", inode=7, uid=998)]
    v = judge(
        ls,
        "127.0.0.1",
        30003,
        ours=frozenset(),
        holders={7: frozenset({55})},
        our_uids=frozenset({998}),
    )
    assert (v.kind, v.pid) == (OwnerKind.FOREIGN, 55)


def test_judge_ignores_listeners_the_workers_address_does_not_reach() -> None:
    ls = [_l("127.0.0.1", inode=7), _l("10.0.0.5", inode=8)]
    v = judge(ls, "127.0.0.1", 30003, ours=frozenset({7}), holders={8: frozenset({99})})
    assert v.kind is OwnerKind.OURS
