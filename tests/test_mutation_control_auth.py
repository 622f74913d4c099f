"""control.auth's rules that mutation testing found unheld (issue 27): the group lookups
against the group database, and the default cache age (a `usermod -aG` counts within a
minute)."""

from __future__ import annotations

import grp
import os
import pwd

import pytest

from sglang_farm.control.auth import Gate, Peer, group_gid, uid_in_group


def test_group_gid_looks_the_name_up() -> None:
    assert group_gid(None) is None
    assert group_gid("root") == 0
    assert group_gid("no-such-group-sglang-farm") is None


def passwd(name: str, uid: int, gid: int) -> pwd.struct_passwd:
    return pwd.struct_passwd((name, "x", uid, gid, "", "/", "/bin/sh"))


@pytest.fixture
def group_db(monkeypatch: pytest.MonkeyPatch) -> None:
    """alice (1001): primary group 100, supplementary 500; bob (1002): primary 100 only."""
    users = {1001: passwd("alice", 1001, 100), 1002: passwd("bob", 1002, 100)}
    groups = {"alice": [100, 500], "bob": [100]}

    def getpwuid(uid: int) -> pwd.struct_passwd:
        return users[uid]  # KeyError for an unknown uid, as pwd raises

    def getgrouplist(name: str, gid: int) -> list[int]:
        return groups[name]

    monkeypatch.setattr(pwd, "getpwuid", getpwuid)
    monkeypatch.setattr(os, "getgrouplist", getgrouplist)


@pytest.mark.usefixtures("group_db")
def test_uid_in_group_primary_and_supplementary() -> None:
    assert uid_in_group(1001, 100)  # primary
    assert uid_in_group(1001, 500)  # supplementary
    assert not uid_in_group(1002, 500)
    assert not uid_in_group(4242, 100)  # no such user


def test_uid_in_group_is_false_when_the_group_list_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(name: str, gid: int) -> list[int]:
        raise OSError("getgrouplist failed")

    monkeypatch.setattr(os, "getgrouplist", failing)
    me = pwd.getpwuid(os.geteuid())
    other = next(g.gr_gid for g in grp.getgrall() if g.gr_gid != me.pw_gid)
    assert not uid_in_group(me.pw_uid, other)
    assert uid_in_group(me.pw_uid, me.pw_gid)  # the primary group needs no list


async def test_membership_is_looked_up_again_after_a_minute() -> None:
    lookups: list[int] = []
    now = [1000.0]

    def is_member(uid: int, gid: int) -> bool:
        lookups.append(uid)
        return False

    g = Gate(500, "sglang", own_uid=990, is_member=is_member, clock=lambda: now[0])
    await g.allows(Peer(1, 1001, 100))
    now[0] += 60.0
    await g.allows(Peer(1, 1001, 100))
    assert lookups == [1001]
    now[0] += 0.5
    await g.allows(Peer(1, 1001, 100))
    assert lookups == [1001, 1001]
