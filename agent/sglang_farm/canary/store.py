"""I/O: the canary record in the state directory (`canary.json`): the last accepted
change (its hash and its config text) and the rejected changes (record.RejectedChanges).

A restarted agent reads it before it starts anything (docs/canary.md, "An agent
restart"): a config whose change was rejected runs the accepted config's text instead.
A missing file is an empty record (a first start); an unreadable one is logged and
kept aside, and the agent starts on the config file as before issue 23. The accepted
text becomes the config the agent (root) runs, so the file is read only if it is a
regular file (no symbolic link followed) owned by root or the agent's user and writable
by no one else; another's file is refused and left where it is.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from sglang_farm.canary.record import PREFIX, RejectedChanges
from sglang_farm.host.atomicfile import write_atomic

log = structlog.get_logger("sglang_farm.canary")

FILE = "canary.json"


@dataclass(frozen=True, slots=True)
class Accepted:
    change: str  # record.change_hash of what the workers run
    text: str | None  # the config's TOML text (None: it could not be read back)
    at: float  # wall clock


@dataclass(frozen=True, slots=True)
class CanaryRecord:
    accepted: Accepted | None = None
    rejected: RejectedChanges = field(default_factory=RejectedChanges)


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
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
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


def load(state_dir: str) -> CanaryRecord:
    path = Path(state_dir) / FILE
    try:
        raw = json.loads(_read_trusted(path))
        if not isinstance(raw, dict):
            raise ValueError("expected a JSON object")
        return CanaryRecord(
            _accepted(raw.get("accepted")), RejectedChanges.from_json(raw.get("rejected", []))
        )
    except FileNotFoundError:
        return CanaryRecord()
    except _Untrusted as exc:
        log.error(
            "canary_record_untrusted",
            path=str(path),
            error=str(exc),
            hint="ignored (not moved): the config file runs; remove it, or fix its owner "
            "(root) and mode (0600)",
        )
        return CanaryRecord()
    except (OSError, ValueError) as exc:
        aside = path.with_name(FILE + ".unreadable")
        with_aside = True
        try:
            os.replace(path, aside)
        except OSError:
            with_aside = False
        log.error(
            "canary_record_unreadable",
            path=str(path),
            error=str(exc),
            kept_aside=str(aside) if with_aside else None,
            hint="starting with no accepted or rejected change: the config file runs",
        )
        return CanaryRecord()


def save(state_dir: str, rec: CanaryRecord) -> None:
    acc = rec.accepted
    data = {
        "accepted": None if acc is None else {"change": acc.change, "text": acc.text, "at": acc.at},
        "rejected": rec.rejected.to_json(),
    }
    path = Path(state_dir) / FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(data, indent=1).encode(), 0o600)
