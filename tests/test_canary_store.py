"""The canary record in the state directory (canary/store.py): round trip, unreadable,
and another user's file refused (its accepted text would become root's config)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from asuser import nobody_python, shared_dir
from sglang_farm.canary import store
from sglang_farm.canary.record import RejectedChanges

__all__ = ["shared_dir"]  # the fixture, imported for pytest

H = "sha256:" + "a" * 64


def test_the_record_round_trips_root_only(tmp_path: Path) -> None:
    rec = store.CanaryRecord(
        store.Accepted(H, "[farm]\n", 12.5), RejectedChanges().reject(H, "too slow", 13.0)
    )
    store.save(str(tmp_path), rec)
    assert store.load(str(tmp_path)) == rec
    assert (os.stat(tmp_path / store.FILE).st_mode & 0o777) == 0o600
    assert store.load(str(tmp_path / "none")) == store.CanaryRecord()


def test_an_unreadable_record_is_kept_aside_and_ignored(tmp_path: Path) -> None:
    (tmp_path / store.FILE).write_text("{not json")
    assert store.load(str(tmp_path)) == store.CanaryRecord()
    assert (tmp_path / (store.FILE + ".unreadable")).exists()


def test_another_users_record_is_refused_and_left_in_place(shared_dir: Path) -> None:
    """nobody plants a record whose 'accepted' config would run its own program as root."""
    forged = {
        "accepted": {"change": H, "text": '[farm]\npython = "/tmp/evil"\n', "at": 1.0},
        "rejected": [],
    }
    nobody_python(
        "import sys, pathlib; pathlib.Path(sys.argv[1]).write_text(sys.argv[2])",
        str(shared_dir / store.FILE),
        json.dumps(forged),
    )
    assert store.load(str(shared_dir)) == store.CanaryRecord()
    assert (shared_dir / store.FILE).exists()  # not moved: it is not ours


def test_a_symbolic_link_is_not_followed(tmp_path: Path) -> None:
    real = tmp_path / "elsewhere.json"
    store.save(str(tmp_path), store.CanaryRecord(store.Accepted(H, None, 1.0)))
    (tmp_path / store.FILE).rename(real)
    (tmp_path / store.FILE).symlink_to(real)
    assert store.load(str(tmp_path)) == store.CanaryRecord()
