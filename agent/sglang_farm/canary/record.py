"""Pure: the rejected-change record: a stable hash of what the workers would run, and
the rule that a change rolled back by a canary verdict is not retried until the config
changes again.

What "the change" is: everything that decides what a worker process does, given as
plain data by the caller (for each worker: argv, environment, interpreter, model
revision; `workload()` builds one worker's entry). The hash is SHA-256 of the data's
canonical JSON (keys sorted, no whitespace, UTF-8), so it is the same across agent
restarts, Python versions and dict orders, and any difference in argv order, a flag's
value, one environment variable, the interpreter path or the model revision gives
another hash. A config edit that changes none of these (a comment, a drain budget) keeps
the hash, and so keeps a rejected change held.

The rule (`RejectedChanges.decide`): a desired hash that is already running needs
nothing; one that was rejected is HELD (with the verdict's evidence) and never rolled
on its own, neither at a reload nor at an agent restart; any other rolls. A rejection
is lifted only by an operator's explicit retry (`forget`), so editing the config away
and back again does not silently retry it either. The record keeps the latest
`MAX_REJECTED` rejections (oldest dropped) and converts to and from JSON for the state
directory.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

MAX_REJECTED = 32
PREFIX = "sha256:"


def _canonical(value: object, path: str) -> Any:
    """`value` as JSON-ready data; raises TypeError naming the path of anything else."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise TypeError(f"{path}: {value!r} has no stable JSON form")
        return value
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{path}: key {k!r} is not a string")
            out[k] = _canonical(v, f"{path}.{k}")
        return out
    if isinstance(value, list | tuple):
        return [_canonical(v, f"{path}[{i}]") for i, v in enumerate(value)]
    raise TypeError(
        f"{path}: {type(value).__name__} is not plain data (give str, int, float, bool, "
        "None, lists and mappings)"
    )


def change_hash(what: Mapping[str, object]) -> str:
    """ "sha256:<64 hex>" of `what`'s canonical JSON. Raises TypeError for non-plain data."""
    data = _canonical(what, "change")
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return PREFIX + hashlib.sha256(text.encode()).hexdigest()


def short(change: str) -> str:
    """The hash as people see it: "sha256:" and 12 hex digits."""
    return change[: len(PREFIX) + 12]


def workload(
    argv: Sequence[str],
    env: Mapping[str, str],
    python: str,
    model_revision: str | None,
) -> dict[str, object]:
    """One worker's entry: what its process runs. Its GPU, port and unit name belong in
    the caller's key (e.g. `{"workers": {"0": workload(...), ...}}`)."""
    return {
        "argv": list(argv),
        "env": dict(env),
        "python": python,
        "model_revision": model_revision,
    }


@dataclass(frozen=True, slots=True)
class Accepted:
    """The change the baseline runs, as recorded (canary.store keeps it in canary.json)."""

    change: str  # change_hash of what the workers run
    text: str | None  # the config's TOML text (None: it could not be read back)
    at: float  # wall clock


@dataclass(frozen=True, slots=True)
class Rejection:
    change: str  # the hash
    evidence: str  # the verdict's line
    at: float  # wall-clock seconds, given by the caller


class Decision(StrEnum):
    NOTHING = "nothing"  # the desired change already runs
    ROLL = "roll"  # roll it: canary first
    HELD = "held"  # rejected before: stay on the running config


@dataclass(frozen=True, slots=True)
class RejectedChanges:
    entries: tuple[Rejection, ...] = ()

    def rejection(self, change: str) -> Rejection | None:
        for r in self.entries:
            if r.change == change:
                return r
        return None

    def reject(self, change: str, evidence: str, at: float) -> RejectedChanges:
        """The record with `change` rejected (again, latest evidence kept), bounded."""
        kept = tuple(r for r in self.entries if r.change != change)
        return RejectedChanges((*kept, Rejection(change, evidence, at))[-MAX_REJECTED:])

    def forget(self, change: str) -> RejectedChanges:
        """The operator's explicit retry: `change` may roll again."""
        return RejectedChanges(tuple(r for r in self.entries if r.change != change))

    def decide(self, desired: str, running: str | None) -> Decision:
        """What to do about the config's `desired` hash while `running` runs (None:
        nothing accepted yet, e.g. a first start, which has no baseline to judge by)."""
        if desired == running:
            return Decision.NOTHING
        if self.rejection(desired) is not None:
            return Decision.HELD
        return Decision.ROLL

    def to_json(self) -> list[dict[str, object]]:
        return [{"change": r.change, "evidence": r.evidence, "at": r.at} for r in self.entries]

    @classmethod
    def from_json(cls, data: object) -> RejectedChanges:
        """Raises ValueError naming what is wrong with a stored record."""
        if not isinstance(data, list):
            raise ValueError(f"rejected changes: expected a list, got {type(data).__name__}")
        out = []
        for i, item in enumerate(data):
            if not isinstance(item, dict):
                raise ValueError(f"rejected changes[{i}]: expected an object")
            change, evidence, at = item.get("change"), item.get("evidence"), item.get("at")
            if not (isinstance(change, str) and change.startswith(PREFIX)):
                raise ValueError(f"rejected changes[{i}].change: expected 'sha256:…'")
            if not isinstance(evidence, str):
                raise ValueError(f"rejected changes[{i}].evidence: expected a string")
            if isinstance(at, bool) or not isinstance(at, int | float):
                raise ValueError(f"rejected changes[{i}].at: expected a number")
            out.append(Rejection(change, evidence, float(at)))
        return cls(tuple(out[-MAX_REJECTED:]))
