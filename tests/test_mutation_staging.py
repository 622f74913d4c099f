"""Staging's pure rules that mutation testing found unheld (issue 27): byte counts for
people, the exact remount a too-small tmpfs needs, and the manifest's parsing."""

from __future__ import annotations

import json

import pytest

from sglang_farm.staging.manifest import (
    FileEntry,
    Manifest,
    digest_from_blob_name,
    manifest_from_json,
    parse_sha256sums,
)
from sglang_farm.staging.plan import MountFacts, gib, space_problem

MiB, GiB = 1 << 20, 1 << 30


def test_gib_picks_the_largest_unit_that_fits() -> None:
    assert gib(1023) == "1023 bytes"
    assert gib(1024) == "1.0 KiB"
    assert gib(MiB - 1) == "1024.0 KiB"
    assert gib(MiB) == "1.0 MiB"
    assert gib(3 * GiB + GiB // 5) == "3.2 GiB"
    assert gib(-2 * MiB) == "-2.0 MiB"


def test_a_too_small_tmpfs_is_told_the_exact_size_to_remount_with() -> None:
    shm = MountFacts("/dev/shm", "tmpfs", "rw,size=1048576k", 100 * MiB, GiB)
    problem = space_problem(300 * MiB, 0, shm, "/dev/shm/m", "the model")
    assert problem is not None
    msg, fix = problem
    assert msg.endswith("200.0 MiB short; the tmpfs's size is its mount option size=1048576k")
    # 1 GiB + 200 MiB short = 1224 MiB, rounded up past it: 1225M.
    assert fix == (
        "grow it by at least 200.0 MiB: `mount -o remount,size=1225M /dev/shm` "
        "(and in /etc/fstab to keep it), or free space there, or lower [model] headroom"
    )


def test_what_fits_exactly_is_no_problem() -> None:
    disk = MountFacts("/srv", "ext4", "rw", 10 * GiB, 100 * GiB)
    assert space_problem(9 * GiB, GiB, disk, "/srv/m", "the model") is None
    assert space_problem(9 * GiB, GiB + 1, disk, "/srv/m", "the model") is not None


# ---- staging.manifest -------------------------------------------------------------------

H64, H40 = "ab" * 32, "cd" * 20


def test_a_hub_blob_name_says_which_digest_it_is() -> None:
    assert digest_from_blob_name(H64) == (H64, None)
    assert digest_from_blob_name(H40) == (None, H40)
    assert digest_from_blob_name("config.json") == (None, None)


def test_digest_text_names_the_digest_that_vouches() -> None:
    assert FileEntry("a", 1, sha256=H64, git_sha1=H40).digest_text == f"sha256 {H64}"
    assert FileEntry("a", 1, git_sha1=H40).digest_text == f"git blob {H40}"
    assert FileEntry("a", 1).digest_text == "size only"


def test_a_recorded_digest_that_is_not_a_string_voids_the_manifest() -> None:
    for bad in ({"sha256": H64, "git_sha1": 5}, {"sha256": 5, "git_sha1": H40}):
        text = json.dumps({"origin": "/src", "files": [{"path": "a", "size": 1, **bad}]})
        assert manifest_from_json(text) is None
    good = {"origin": "/src", "files": [{"path": "a", "size": 1, "sha256": H64}]}
    assert manifest_from_json(json.dumps(good)) == Manifest(
        "/src", (FileEntry("a", 1, sha256=H64),)
    )


def test_sha256sums_skips_comments_and_blank_lines_and_takes_one_letter_names() -> None:
    text = f"# made by sha256sum\n\n{H64}  a\n{H64.upper()} *./b/c\n"
    assert parse_sha256sums(text) == {"a": H64, "b/c": H64}


def test_a_bad_sha256sums_line_is_quoted_up_to_80_characters() -> None:
    line = "x" * 100
    with pytest.raises(ValueError) as e:
        parse_sha256sums(f"{H64}  ok\n{line}\n")
    assert str(e.value) == f"line 2 is not '<sha256>  <file>': {'x' * 80!r}"
