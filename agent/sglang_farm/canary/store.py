"""I/O: the canary record in the state directory (`canary.json`): the last accepted
change (its hash and its config text) and the rejected changes (record.RejectedChanges).

A restarted agent reads it before it starts anything (docs/canary.md, "An agent
restart"): a config whose change was rejected runs the accepted config's text instead.
A missing file is an empty record (a first start). The accepted text becomes the config
the agent (root) runs, so the file is read only if it is a regular file (no symbolic
link followed) owned by root or the agent's user and writable by no one else.

Fail closed (issue 30, item 6): every save writes the file and its second copy
(`canary.json.copy`, `atomicfile.write_with_copy`). A file that is refused (another
user could have written it) or unreadable (cut short) is moved aside as
`canary.json.refused-<UTC time>`, never overwritten, and its copy read instead, so the
rejections it held still hold. With no usable copy either, the rejections of a refused
file that still parses are kept (a forged rejection can only hold a change back; its
accepted text is never run), and the loss is announced: each problem is a
`StateAlert` in the record (`CanaryRecord.alerts`) for the log and `farmctl status`.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from sglang_farm.canary.record import PREFIX, Accepted, RejectedChanges
from sglang_farm.host.atomicfile import copy_path, write_with_copy
from sglang_farm.state_alerts import AlertKind, StateAlert

log = structlog.get_logger("sglang_farm.canary")

FILE = "canary.json"


@dataclass(frozen=True, slots=True)
class CanaryRecord:
    accepted: Accepted | None = None
    rejected: RejectedChanges = field(default_factory=RejectedChanges)
    # Issue 30: what was wrong with the file at load (kept aside, copy read or not).
    alerts: tuple[StateAlert, ...] = ()


def _accepted(d: object) -> Accepted | None:
    if d is None:
        return None
    if not isinstance(d, dict):
        raise ValueError("accepted: expected an object")
    change, text, at = d.get("change"), d.get("text"), d.get("at")
    if not (isinstance(change, str) and change.startswith(PREFIX)):
        raise ValueError("accepted.change: expected 'sha256:…'")
    if text is not None and not isinstance(text, str):
        raise ValueError("accepted.text: expected a string")
    if isinstance(at, bool) or not isinstance(at, int | float):
        raise ValueError("accepted.at: expected a number")
    return Accepted(change, text, float(at))


class _Untrusted(Exception):
    pass


def _read_trusted(path: Path) -> str:
    """The file's text; FileNotFoundError when absent; _Untrusted for another's file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _Untrusted("a symbolic link (never followed)") from exc
        raise
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise _Untrusted("not a regular file")
        if st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022:
            raise _Untrusted(
                f"owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):04o}: "
                "another user could have written it"
            )
        return fh.read().decode("utf-8")


def _parse(text: str) -> CanaryRecord:
    raw = json.loads(text)
    if not isinstance(raw, dict):
        raise ValueError("expected a JSON object")
    return CanaryRecord(
        _accepted(raw.get("accepted")), RejectedChanges.from_json(raw.get("rejected", []))
    )


def _rejections_only(path: Path) -> RejectedChanges:
    """The rejections of a refused file (kept aside) that still parses, else none: a
    forged one can only hold a change back, never run a config."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                return RejectedChanges()
            rec = _parse(fh.read(8 << 20).decode("utf-8"))
    except (OSError, ValueError):
        return RejectedChanges()
    return rec.rejected


def _read(path: Path) -> tuple[CanaryRecord | None, AlertKind | None, str]:
    """(the record, None, "") or (None, what was wrong, why); FileNotFoundError if absent."""
    try:
        return _parse(_read_trusted(path)), None, ""
    except _Untrusted as exc:
        return None, AlertKind.REFUSED, str(exc)
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as exc:
        return None, AlertKind.UNREADABLE, str(exc)[:200]


def _aside(path: Path) -> Path | None:
    """`path` moved to `<name>.refused-<UTC time>` beside it (never overwritten again);
    None when it could not be moved."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    kept = path.with_name(f"{path.name}.refused-{stamp}")
    n = 1
    while kept.exists() or kept.is_symlink():
        n += 1
        kept = path.with_name(f"{path.name}.refused-{stamp}.{n}")
    try:
        os.rename(path, kept)
    except OSError:
        return None
    return kept


def load(state_dir: str) -> CanaryRecord:
    """The record: the file, else (refused or unreadable, moved aside) its second copy,
    else the rejections a refused file still holds; each problem in `alerts`."""
    path = Path(state_dir) / FILE
    alerts: list[StateAlert] = []
    rejected = RejectedChanges()
    for each in (path, copy_path(path)):
        try:
            rec, kind, why = _read(each)
        except FileNotFoundError:
            continue
        if rec is not None:
            if alerts:
                alerts = [
                    StateAlert(a.file, a.kind, a.error, a.since, a.kept, f"read {each} instead")
                    for a in alerts
                ]
                log.warning(
                    "canary_record_copy_read",
                    path=str(path),
                    copy=str(each),
                    hint="the rejections and the accepted config of the copy hold",
                )
            if each != path:
                try:  # the record whole in both places again
                    save(state_dir, rec)
                except OSError as exc:
                    log.error("canary_record_not_saved", error=str(exc), state_dir=state_dir)
            return CanaryRecord(rec.accepted, rec.rejected, tuple(alerts))
        assert kind is not None
        kept = _aside(each)
        if kept is not None and kind is AlertKind.REFUSED:
            for r in _rejections_only(kept).entries:
                rejected = rejected.reject(r.change, r.evidence, r.at)
        alerts.append(
            StateAlert(
                str(each),
                kind,
                why,
                time.time(),
                str(kept) if kept is not None else None,
                "",
            )
        )
        log.error(
            "canary_record_untrusted" if kind is AlertKind.REFUSED else "canary_record_unreadable",
            path=str(each),
            error=why,
            kept_aside=str(kept) if kept is not None else None,
            hint="never read again nor overwritten; check it, and fix the state_dir's owner "
            "(root) and modes (0600)",
        )
    if not alerts:
        return CanaryRecord()
    then = (
        "no accepted config is known: the config file runs as on a first start; "
        + (
            f"{len(rejected.entries)} rejection(s) kept from the refused file"
            if rejected.entries
            else "its rejected changes are lost (a change rejected before may run)"
        )
        + ": check the kept file and put it back as canary.json (0600, root's) if it is sound"
    )
    log.error("canary_record_lost", path=str(path), then=then)
    return CanaryRecord(
        None,
        rejected,
        tuple(StateAlert(a.file, a.kind, a.error, a.since, a.kept, then) for a in alerts),
    )


def save(state_dir: str, rec: CanaryRecord) -> None:
    """Write the record and its copy. Raises OSError, also when a file at the path is
    another's (a refused record that could not be moved aside is never overwritten)."""
    acc = rec.accepted
    data = {
        "accepted": None if acc is None else {"change": acc.change, "text": acc.text, "at": acc.at},
        "rejected": rec.rejected.to_json(),
    }
    path = Path(state_dir) / FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    for each in (path, copy_path(path)):
        try:
            st = os.lstat(each)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022:
            raise OSError(
                errno.EEXIST, f"{each} is a refused record (not overwritten): move it away"
            )
    write_with_copy(path, json.dumps(data, indent=1).encode(), 0o600)
