"""Who may use the control socket: `auth.Gate` with a fake group database and clock.

The same policy against real users and a real socket is in test_control_server.py.
"""

from __future__ import annotations

import os
import socket

from sglang_farm.control.auth import Gate, Peer, peer_of

OWN_UID = 990
GID = 500


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class GroupDb:
    """Answers membership from `members` and counts the lookups."""

    def __init__(self, *members: int) -> None:
        self.members = set(members)
        self.lookups: list[tuple[int, int]] = []

    def __call__(self, uid: int, gid: int) -> bool:
        self.lookups.append((uid, gid))
        return gid == GID and uid in self.members


def gate(db: GroupDb, clock: Clock | None = None, gid: int | None = GID) -> Gate:
    return Gate(gid, "sglang", own_uid=OWN_UID, is_member=db, clock=clock or Clock(), ttl=60.0)


async def test_root_and_the_agents_own_uid_are_allowed_without_a_lookup() -> None:
    db = GroupDb()
    g = gate(db)
    assert await g.allows(Peer(1, 0, 0))
    assert await g.allows(Peer(1, OWN_UID, 12345))
    assert db.lookups == []


async def test_primary_group_is_allowed_and_others_are_looked_up() -> None:
    db = GroupDb(1001)
    g = gate(db)
    assert await g.allows(Peer(1, 1002, GID))  # primary gid: no lookup needed
    assert db.lookups == []
    assert await g.allows(Peer(1, 1001, 100))  # supplementary member
    assert not await g.allows(Peer(1, 1003, 100))
    assert db.lookups == [(1001, GID), (1003, GID)]


async def test_membership_is_cached_for_the_ttl_then_looked_up_again() -> None:
    db, clock = GroupDb(), Clock()
    g = gate(db, clock)
    assert not await g.allows(Peer(1, 1001, 100))
    db.members.add(1001)  # usermod -aG
    clock.now += 60.0
    assert not await g.allows(Peer(1, 1001, 100))  # still cached
    assert len(db.lookups) == 1
    clock.now += 0.5
    assert await g.allows(Peer(1, 1001, 100))  # past the TTL: looked up again
    assert len(db.lookups) == 2


async def test_without_a_group_only_root_and_own_uid_may() -> None:
    db = GroupDb(1001)
    g = gate(db, gid=None)
    assert await g.allows(Peer(1, 0, 0))
    assert not await g.allows(Peer(1, 1001, GID))
    assert db.lookups == []
    assert g.refusal(Peer(1, 1001, GID)) == (
        "uid 1001 may not use the control socket: it is root-only because the group "
        "sglang does not exist; run farmctl as root (sudo farmctl ...)"
    )


def test_refusal_names_the_group_and_the_fix() -> None:
    assert gate(GroupDb()).refusal(Peer(1, 1001, 100)) == (
        "uid 1001 may not use the control socket: only root and members of the group "
        "sglang may; ask an admin to run 'usermod -aG sglang <user>' or use sudo"
    )


def test_peer_of_reads_the_connected_process_credentials() -> None:
    a, b = socket.socketpair(socket.AF_UNIX)
    with a, b:
        assert peer_of(a) == Peer(os.getpid(), os.geteuid(), os.getegid())
