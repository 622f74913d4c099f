"""I/O: what the agent must not forget across its own restarts, and where it keeps it.

Restart counts, back-off position, failure history and the OOM-ladder step in force
live in `<state_dir>/state.json`, and beside the workers the host's own state: held out
of the gateway (`farmctl drain-host`, issue 26), so that the agent restart of a package
upgrade does not put a drained host back in the gateway by itself. Converting to and
from that JSON is pure; `save` writes atomically (temp file + rename), twice: the file
and its second copy (`state.json.copy`, `atomicfile.write_with_copy`).

Fail closed (issue 30, items 5 and 9). A file found damaged at start is kept aside
(`.corrupt-<time>`) and its copy read instead; only when both are unusable does the
farm start with nothing remembered, and then its safety holds fail closed or are
announced: the host is held out of the gateway (a drain may have been lost: `farmctl
undrain-host` ends the hold), and the quarantines it may have held are said to be
dropped (NVML quarantines a failing GPU again), in the log and in `farmctl status`
(`StateStore.alerts`). A save that fails (a full disk) is kept as an alert until a
save succeeds, counted (`save_failures`), and a command whose change could not be
saved fails with the reason (`StateStore.save_now`, `StateNotSaved`). A broken file
never stops the farm.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import structlog

from sglang_farm.errors import FarmError
from sglang_farm.farm_view import Phase
from sglang_farm.host.atomicfile import copy_path, write_with_copy
from sglang_farm.sglang.failures import Failure, FailureKind
from sglang_farm.state_alerts import AlertKind, StateAlert
from sglang_farm.workers.phase_sets import HELD
from sglang_farm.workers.supervisor import (
    FailurePast,
    GpuQuarantine,
    WorkerState,
    restored_quarantine,
)

log = structlog.get_logger("sglang_farm.state")
FORMAT = 1


@dataclass(frozen=True, slots=True)
class Remembered:
    """What the file remembers, for the agent to put back into the core at start (the
    store reads and judges it; only the agent changes the supervisor's state)."""

    states: Mapping[int, WorkerState]  # each remembered worker's state, history restored
    phases: Mapping[int, Phase | None]  # the phase each was left in (a held one, or None)
    held_out_since: float | None = None  # the host stays held out of the gateway since


def worker_to_dict(s: WorkerState, mono_to_wall: float) -> dict[str, Any]:
    """The persisted part of a worker's state; monotonic times become wall-clock times."""
    return {
        # Only phases an agent restart must not undo; the rest is observed anew.
        "phase": str(s.phase) if s.phase in HELD else None,
        "quarantine": {
            "gpu": s.quarantine.gpu,
            "reason": s.quarantine.reason,
            "detail": s.quarantine.detail,
            "at": s.quarantine.at + mono_to_wall,
        }
        if s.quarantine is not None
        else None,
        "quarantines_by_reason": dict(s.quarantines_by_reason),
        "failures": s.failures,
        "oom_step": s.oom_step,
        "restarts": [[at + mono_to_wall, reason] for at, reason in s.restarts],
        "restarts_by_reason": dict(s.restarts_by_reason),
        "oom_events": dict(s.oom_events),
        "last_failure": s.last_failure.to_dict() if s.last_failure else None,
        "last_failure_at": s.last_failure_at + mono_to_wall if s.last_failure_at else None,
        "last_action": s.last_action,
        "failure_past": str(s.failure_past) if s.failure_past is not None else None,
        "last_load_seconds": s.last_load_seconds,
        # Which process this farm launched last, and when (wall clock): a restarted agent
        # tells by it whether an adopted worker started after a model copy's install.
        "launch": {"pid": s.pid, "at": s.launched_at + mono_to_wall}
        if s.pid is not None and s.launched_at is not None
        else None,
    }


def _failure(d: Any) -> Failure | None:
    if not isinstance(d, dict):
        return None
    try:
        kind = FailureKind(d["kind"])
    except (KeyError, ValueError):
        return None
    return Failure(
        kind,
        str(d.get("summary", "")),
        str(d.get("advice", "")),
        tuple(str(x) for x in d.get("lines", ())),
    )


def _past(v: Any) -> FailurePast | None:
    try:
        return FailurePast(v) if isinstance(v, str) else None
    except ValueError:
        return None  # a word of a later version: the failure is shown as current


def restore_worker(s: WorkerState, d: dict[str, Any], wall_to_mono: float) -> WorkerState:
    """`s` with the remembered fields of `d` (bad fields are skipped, not fatal)."""

    def num(key: str, default: float) -> float:
        v = d.get(key, default)
        return float(v) if isinstance(v, (int, float)) else default

    at = d.get("last_failure_at")
    q = d.get("quarantine")
    quarantine = None
    if isinstance(q, dict) and isinstance(q.get("gpu"), int):
        quarantine = GpuQuarantine(
            q["gpu"],
            str(q.get("reason", "")),
            str(q.get("detail", "")),
            float(q["at"]) + wall_to_mono if isinstance(q.get("at"), (int, float)) else 0.0,
        )
    return replace(
        s,
        quarantine=quarantine,
        quarantines_by_reason={
            str(k): int(v) for k, v in dict(d.get("quarantines_by_reason", {})).items()
        },
        failures=int(num("failures", 0)),
        oom_step=int(num("oom_step", 0)),
        restarts=tuple(
            (float(r[0]) + wall_to_mono, str(r[1]))
            for r in d.get("restarts", ())
            if isinstance(r, list) and len(r) == 2 and isinstance(r[0], (int, float))
        ),
        restarts_by_reason={
            str(k): int(v) for k, v in dict(d.get("restarts_by_reason", {})).items()
        },
        oom_events={str(k): int(v) for k, v in dict(d.get("oom_events", {})).items()},
        last_failure=_failure(d.get("last_failure")),
        last_failure_at=float(at) + wall_to_mono if isinstance(at, (int, float)) else None,
        last_action=d.get("last_action") if isinstance(d.get("last_action"), str) else None,
        failure_past=_past(d.get("failure_past")),
        last_load_seconds=d.get("last_load_seconds")
        if isinstance(d.get("last_load_seconds"), (int, float))
        else None,
    )


def host_to_dict(held_out_since: float | None, mono_to_wall: float) -> dict[str, Any]:
    """The host's persisted state: since when it is held out of the gateway (wall clock),
    or null."""
    return {"held_out_since": held_out_since + mono_to_wall if held_out_since is not None else None}


def save(
    path: Path, workers: dict[int, dict[str, Any]], host: Mapping[str, Any] | None = None
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"format": FORMAT, "workers": {str(k): v for k, v in workers.items()}}
    if host is not None:
        doc["host"] = dict(host)
    data = json.dumps(doc, indent=1, sort_keys=True)
    write_with_copy(path, data.encode(), 0o600)  # as before: only root reads it


class StateNotSaved(FarmError):
    """A command's change is in force but could not be saved: an agent restart would
    undo it. The message names the file, why, and what to do."""


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"a number out of range: {text[:40]}")
    return value


def load(path: Path) -> dict[int, dict[str, Any]]:
    """The remembered workers, read only (the doctor's look): `path`, else its copy."""
    return read_state(path).workers


@dataclass(frozen=True, slots=True)
class Loaded:
    """What `read_state` found: the workers and host remembered, the file they came
    from, and why the first choice was not used (`problem`: None when it was)."""

    workers: dict[int, dict[str, Any]]
    host: dict[str, Any]
    source: Path | None  # None: nothing usable (or nothing at all) was found
    problem: str | None = None  # why `path` itself was unusable (absent: None)
    lost: bool = False  # a file existed and neither it nor its copy could be read


def _parse(path: Path) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
    """Raises FileNotFoundError, or another exception for an unreadable file."""
    raw = json.loads(path.read_text(), parse_float=_finite)
    workers = raw["workers"]
    host = raw.get("host")
    return (
        {int(k): v for k, v in workers.items() if isinstance(v, dict)},
        host if isinstance(host, dict) else {},
    )


_UNREADABLE = (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError)


def read_state(path: Path) -> Loaded:
    """`path`, else its second copy (damaged or missing first). Moves nothing."""
    try:
        workers, host = _parse(path)
        return Loaded(workers, host, path)
    except FileNotFoundError:
        problem: str | None = None
    except _UNREADABLE as exc:
        problem = str(exc)[:200] or type(exc).__name__
    copy = copy_path(path)
    try:
        workers, host = _parse(copy)
        return Loaded(workers, host, copy, problem)
    except FileNotFoundError:
        return Loaded({}, {}, None, problem, lost=problem is not None)
    except _UNREADABLE as exc:
        if problem is None:
            problem = "missing"
        return Loaded({}, {}, None, f"{problem}; its copy: {str(exc)[:200]}", lost=True)


def load_all(path: Path) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
    """The remembered workers and host; ({}, {}) when there is no file (`read_state`)."""
    got = read_state(path)
    return got.workers, got.host


def _compare_key(d: Mapping[int, Mapping[str, Any]]) -> object:
    """What counts as a change worth a write: wall-clock conversions drift by microseconds.

    `.get`, not `[]`: the remembered side comes from a file, which may lack fields.
    """
    return {
        w: (
            v.get("failures"),
            v.get("oom_step"),
            len(v.get("restarts") or ()),
            v.get("restarts_by_reason"),
            v.get("oom_events"),
            v.get("last_action"),
            v.get("failure_past"),
            v.get("last_load_seconds"),
            v.get("phase"),
            (v.get("quarantine") or {}).get("reason"),
            (v.get("launch") or {}).get("pid"),  # a new process: its launch is remembered
        )
        for w, v in d.items()
    }


class StateStore:
    """The supervisor's memory on disk: restored once at start, saved when it changed.

    `clock` is the supervisor's (monotonic) clock and `wall` the wall clock: the file holds
    wall-clock times, since monotonic ones mean nothing to the next agent process.
    """

    def __init__(self, path: Path, clock: Callable[[], float], wall: Callable[[], float]) -> None:
        # Restored: each worker's last launch by a farm, (pid, wall time).
        self.launches: dict[int, tuple[int, float]] = {}
        self.path = path
        self._clock = clock
        self._wall = wall
        self._persisted: dict[int, dict[str, Any]] = {}
        self._persisted_host: dict[str, Any] = {}
        # Issue 30: why the file was not usable at start (kept until the agent stops),
        # the latest save's failure (None once a save succeeds), and the failures so far.
        self.start_alert: StateAlert | None = None
        self.not_saved: StateAlert | None = None
        self.save_failures = 0

    async def save_from(
        self, workers: Mapping[int, WorkerState], held_out_since: float | None
    ) -> None:
        """The supervisor's workers and the host's hold out of the gateway (drain-host):
        read on the event loop, written in a thread."""
        await asyncio.to_thread(self.save, dict(workers), held_out_since=held_out_since)

    async def save_now(
        self,
        workers: Mapping[int, WorkerState],
        held_out_since: float | None,
        change: str,
        undone: str,
    ) -> None:
        """A command's change saved before it answers: raises StateNotSaved naming the
        file and why when it cannot be (`change`: what is in force now, `undone`: what an
        agent restart would do then)."""
        await self.save_from(workers, held_out_since)
        bad = self.not_saved
        if bad is not None:
            raise StateNotSaved(
                f"{change}, but it is not saved: {self.path}: {bad.error}; an agent restart "
                f"would {undone}. Free space in {self.path.parent} (or fix its permissions), "
                "then run the command again"
            )

    def alerts(self) -> tuple[StateAlert, ...]:
        """What `farmctl status` says about this file now."""
        return tuple(a for a in (self.start_alert, self.not_saved) if a is not None)

    def restore(
        self, workers: Mapping[int, WorkerState], gpus: Mapping[int, Sequence[int]]
    ) -> Remembered:
        """Each remembered worker's history on its state in `workers` (the fresh ones),
        the phases they were left in, and the host's hold (`Remembered`).

        `gpus` are each worker's GPUs in the config now: a remembered quarantine that
        names none of them, or none at all, is dropped (`supervisor.restored_quarantine`
        says why), with a warning naming the worker and both GPUs. A host held out of the
        gateway (`farmctl drain-host`) stays held out (`Remembered.held_out_since`).
        """
        got = read_state(self.path)
        saved, host = got.workers, got.host
        offset = self._clock() - self._wall()
        if got.problem is not None:
            self._keep_aside(got)
        phases: dict[int, Phase | None] = {}
        states: dict[int, WorkerState] = {}
        held_out_since: float | None = None
        for wid, d in saved.items():
            if wid not in workers:
                continue
            launch = d.get("launch")
            if isinstance(launch, dict):
                pid, at = launch.get("pid"), launch.get("at")
                if isinstance(pid, int) and isinstance(at, (int, float)):
                    self.launches[wid] = (pid, float(at))
            try:
                raw = d.get("phase")
                remembered = Phase(raw) if isinstance(raw, str) else None
                was = restore_worker(workers[wid], d, offset)
                restored, phase, dropped = restored_quarantine(was, remembered, gpus.get(wid, ()))
                states[wid] = restored
                phases[wid] = phase
                if dropped is not None:
                    mine = gpus.get(wid, ())
                    log.warning(
                        "quarantine_dropped",
                        worker=wid,
                        gpu=mine[0] if len(mine) == 1 else ",".join(map(str, mine)),
                        quarantined_gpu=was.quarantine.gpu if was.quarantine else None,
                        why=dropped,
                        then="the worker starts as any other; the farm quarantines its GPU "
                        "again if NVML finds it failing",
                    )
            except (TypeError, ValueError, AttributeError, OverflowError) as exc:
                log.warning(
                    "state_worker_skipped",
                    worker=wid,
                    error=str(exc),
                    hint="its remembered restarts are dropped; the farm goes on",
                )
        since = host.get("held_out_since")
        if got.lost:
            # Fail closed: a drain-host hold may have been in this file. The host stays
            # out of the gateway until an operator says it may serve.
            held_out_since = self._clock()
        elif isinstance(since, (int, float)) and not isinstance(since, bool):
            held_out_since = float(since) + offset
            log.warning(
                "host_still_held_out",
                since=since,
                why="farmctl drain-host took this host out of the gateway before the agent "
                "restarted; its workers stay out",
                fix="farmctl undrain-host puts them back",
            )
        # Read from the copy: the first save writes both files whole again.
        self._persisted = saved if got.source == self.path else {}
        self._persisted_host = host if got.source == self.path else {}
        if saved:
            log.info("state_restored", path=str(got.source), workers=len(saved))
        return Remembered(states, phases, held_out_since)

    def _keep_aside(self, got: Loaded) -> None:
        """The unusable file moved aside for a post-mortem (never read or overwritten
        again), said in the log and kept for `farmctl status`."""
        kept: Path | None = self.path.with_name(f"{self.path.name}.corrupt-{int(self._wall())}")
        assert kept is not None
        try:
            self.path.rename(kept)
        except FileNotFoundError:
            kept = None  # only its copy was there
        except OSError:
            kept = self.path
        if got.lost:
            then = (
                "nothing remembered: the host is held out of the gateway (a drain-host "
                "may have been lost; farmctl undrain-host once it may serve), and any GPU "
                "quarantine it held is dropped (the farm quarantines a GPU again when NVML "
                "finds it failing; sglang-farm doctor checks them)"
            )
        else:
            then = f"read its second copy {got.source} instead"
        self.start_alert = StateAlert(
            str(self.path),
            AlertKind.UNREADABLE,
            got.problem or "",
            self._wall(),
            str(kept) if kept is not None else None,
            then,
        )
        log.warning(
            "state_unreadable",
            path=str(self.path),
            error=got.problem,
            kept=str(kept) if kept is not None else None,
            then=then,
        )

    def save(
        self, workers: Mapping[int, WorkerState], *, held_out_since: float | None = None
    ) -> None:
        """Write the file if something worth remembering changed; a failed write is logged.
        `held_out_since`: the supervisor's `held_out_since` (the host's drain)."""
        offset = self._wall() - self._clock()
        data = {w: worker_to_dict(s, offset) for w, s in workers.items()}
        host = host_to_dict(held_out_since, offset)
        held_then = self._persisted_host.get("held_out_since") is not None
        if (
            self.not_saved is None  # after a failure, the file may hold an older state
            and _compare_key(data) == _compare_key(self._persisted)
            and held_then == (held_out_since is not None)
        ):
            return
        try:
            save(self.path, data, host)
        except OSError as exc:
            self.save_failures += 1
            first = self.not_saved is None
            why = exc.strerror or str(exc)
            self.not_saved = StateAlert(
                str(self.path),
                AlertKind.NOT_SAVED,
                why,
                self.not_saved.since if self.not_saved is not None else self._wall(),
                then="an agent restart would forget what changed since (a drain-host, a "
                "stop, a quarantine): free space in the state_dir or fix its permissions",
            )
            (log.error if first else log.debug)(
                "state_save_failed",
                path=str(self.path),
                error=why,
                failures=self.save_failures,
                hint="an agent restart would forget what changed since; free space in "
                "state_dir or fix its permissions (said once until a save succeeds)",
            )
            return
        self._persisted = data
        self._persisted_host = host
        if self.not_saved is not None:
            log.info("state_saved_again", path=str(self.path), failures=self.save_failures)
            self.not_saved = None
