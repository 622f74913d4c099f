"""The canary record in the state directory (canary/store.py): round trip, unreadable,
and another user's file refused (its accepted text would become root's config)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from asuser import nobody_python
from sglang_farm.canary import record, store
from sglang_farm.canary.record import RejectedChanges

H = "sha256:" + "a" * 64


def test_the_record_round_trips_root_only(tmp_path: Path) -> None:
    rec = store.CanaryRecord(
        record.Accepted(H, "[farm]\n", 12.5), RejectedChanges().reject(H, "too slow", 13.0)
    )
    store.save(str(tmp_path), rec)
    assert store.load(str(tmp_path)) == rec
    assert (os.stat(tmp_path / store.FILE).st_mode & 0o777) == 0o600
    assert store.load(str(tmp_path / "none")) == store.CanaryRecord()


def test_an_unreadable_record_without_a_copy_is_kept_aside_and_its_loss_said(
    tmp_path: Path,
) -> None:
    (tmp_path / store.FILE).write_text("{not json")
    rec = store.load(str(tmp_path))
    assert rec.accepted is None and rec.rejected == RejectedChanges()
    (alert,) = rec.alerts
    assert alert.kind == "unreadable" and alert.kept is not None
    assert Path(alert.kept).read_text() == "{not json"  # kept whole
    assert not (tmp_path / store.FILE).exists()
    assert "rejected changes are lost" in alert.then


def test_another_users_record_is_refused_kept_aside_and_never_run(shared_dir: Path) -> None:
    """nobody plants a record whose 'accepted' config would run its own program as root.
    Issue 30: it is moved aside (a save would have overwritten it), never run; its
    rejections, which can only hold a change back, are kept."""
    forged = {
        "accepted": {"change": H, "text": '[farm]\npython = "/tmp/evil"\n', "at": 1.0},
        "rejected": [{"change": H, "evidence": "forged", "at": 2.0}],
    }
    nobody_python(
        "import sys, pathlib; pathlib.Path(sys.argv[1]).write_text(sys.argv[2])",
        str(shared_dir / store.FILE),
        json.dumps(forged),
    )
    rec = store.load(str(shared_dir))
    assert rec.accepted is None
    assert [r.evidence for r in rec.rejected.entries] == ["forged"]
    (alert,) = rec.alerts
    assert alert.kind == "refused" and "another user could have written it" in alert.error
    assert alert.kept is not None and json.loads(Path(alert.kept).read_text()) == forged
    assert not (shared_dir / store.FILE).exists()


def test_a_symbolic_link_is_not_followed(tmp_path: Path) -> None:
    real = tmp_path / "elsewhere.json"
    store.save(str(tmp_path), store.CanaryRecord(record.Accepted(H, None, 1.0)))
    (tmp_path / store.FILE).rename(real)
    (tmp_path / (store.FILE + ".copy")).unlink()
    (tmp_path / store.FILE).symlink_to(real)
    rec = store.load(str(tmp_path))
    assert rec.accepted is None
    assert rec.alerts[0].kind == "refused" and "symbolic link" in rec.alerts[0].error


def test_a_damaged_record_is_read_from_its_copy_and_written_whole_again(tmp_path: Path) -> None:
    rec = store.CanaryRecord(
        record.Accepted(H, "[farm]\n", 12.5), RejectedChanges().reject(H, "too slow", 13.0)
    )
    store.save(str(tmp_path), rec)
    path = tmp_path / store.FILE
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    got = store.load(str(tmp_path))
    assert (got.accepted, got.rejected) == (rec.accepted, rec.rejected)
    assert got.alerts[0].kind == "unreadable" and "canary.json.copy" in got.alerts[0].then
    assert path.read_bytes() == data  # whole again
    assert store.load(str(tmp_path)) == rec  # and no alert the next time


def test_a_refused_record_that_could_not_be_moved_is_never_overwritten(tmp_path: Path) -> None:
    path = tmp_path / store.FILE
    path.write_text("{}")
    os.chmod(path, 0o666)
    try:
        store.save(str(tmp_path), store.CanaryRecord())
    except OSError as exc:
        assert "refused record" in str(exc)
    else:
        raise AssertionError("a refused record was overwritten")
    assert path.read_text() == "{}"
