"""The one folder-trust rule (`folder_trust`) that the agent's folders (`securepath`) and
the staging's (`staging.dirs.trusted_dir`) both follow, on hand-built owners and modes."""

from __future__ import annotations

import stat

import pytest

from sglang_farm.host.folder_trust import Distrust, folder_distrust, link_distrust

ROOT, AGENT, OTHER = 0, 1000, 65534
TRUSTED = (ROOT, AGENT)
DIR = stat.S_IFDIR


@pytest.mark.parametrize(
    ("uid", "mode", "own", "expected"),
    [
        (ROOT, DIR | 0o755, True, None),
        (AGENT, DIR | 0o700, True, None),
        (OTHER, DIR | 0o700, False, Distrust.OWNER),
        (OTHER, DIR | 0o777, True, Distrust.OWNER),  # the owner is named first
        (ROOT, DIR | 0o777, False, Distrust.OTHERS_WRITE),
        (ROOT, DIR | 0o757, False, Distrust.OTHERS_WRITE),  # others' bit alone
        (ROOT, DIR | 0o775, False, Distrust.OTHERS_WRITE),  # group-writable is others too
        (ROOT, DIR | 0o1777, False, None),  # /tmp on the way: others add, never replace
        (ROOT, DIR | 0o1777, True, Distrust.OTHERS_WRITE),  # the farm's own: no other writer
        (ROOT, DIR | 0o1755, True, None),
    ],
)
def test_a_folder_is_trusted_only_when_no_other_user_can_replace_its_names(
    uid: int, mode: int, own: bool, expected: Distrust | None
) -> None:
    assert folder_distrust(uid, mode, TRUSTED, own=own) is expected


@pytest.mark.parametrize(
    ("group", "mode", "expected"),
    [
        (0, DIR | 0o775, None),  # root's group counts as root (the staging's folders)
        (0, DIR | 0o777, Distrust.OTHERS_WRITE),  # others' write bit still counts
        (100, DIR | 0o775, Distrust.OTHERS_WRITE),  # any other group is other users
        (100, DIR | 0o1775, None),  # sticky on the way
        (None, DIR | 0o775, Distrust.OTHERS_WRITE),  # no group given: every group counts
    ],
)
def test_a_group_of_roots_counts_as_root_only_where_the_group_is_given(
    group: int | None, mode: int, expected: Distrust | None
) -> None:
    assert folder_distrust(ROOT, mode, TRUSTED, own=False, group=group) is expected


def test_a_link_is_followed_only_when_a_trusted_owner_made_it() -> None:
    assert link_distrust(ROOT, TRUSTED) is None
    assert link_distrust(AGENT, TRUSTED) is None
    assert link_distrust(OTHER, TRUSTED) is Distrust.OWNER
