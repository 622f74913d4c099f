"""Pure: a worker's start as `farmctl status` and `why` show it (issue 34 §4), from the
status JSON's `start` (`control.results.start_result`): the phase a starting worker is in
and for how long, each phase's seconds, the capacity SGLang chose, with the workers
whose capacity differs from most of their siblings', and the phases well slower than the
siblings' (`slow`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any


def _words(phase: object) -> str:
    return str(phase).replace("_", " ")


def _secs(s: float) -> str:
    return f"{s:.0f} s" if s >= 10 else f"{s:.1f} s"


def phase_cell(start: Mapping[str, Any] | None, now: float) -> str | None:
    """`loading weights 42 s` for a start in progress; None otherwise."""
    if not start or not start.get("in_progress"):
        return None
    since = start.get("phase_since")
    age = f" {_secs(max(now - float(since), 0.0))}" if isinstance(since, int | float) else ""
    return f"{_words(start.get('phase'))}{age}"


def capacity_cell(start: Mapping[str, Any] | None) -> str:
    """`821868 tok · 72 req`: SGLang's KV tokens and running-request limit; `-` unknown."""
    cap = (start or {}).get("capacity")
    if not isinstance(cap, Mapping):
        return "-"
    return f"{cap.get('kv_tokens')} tok · {cap.get('max_running_requests')} req"


def start_lines(start: Mapping[str, Any], now: float | None = None) -> list[str]:
    """`why`'s lines on the worker's latest start; with `now`, how long a start in progress
    has been in its phase."""
    durations = start.get("durations") or {}
    steps = ", ".join(f"{_words(p)} {_secs(float(s))}" for p, s in durations.items())
    which = "in progress" if start.get("in_progress") else "its last"
    out = [f"start ({which}): {steps or 'no phase ended yet'}"]
    if start.get("in_progress"):
        out[0] += f"; now {_words(start.get('phase'))}"
        since = start.get("phase_since")
        if now is not None and isinstance(since, int | float):
            out[0] += f" for {_secs(max(now - float(since), 0.0))}"
    for slow in start.get("slow") or ():
        if isinstance(slow, Mapping):
            out.append(f"slow: {slow.get('text')}")
    cap = start.get("capacity")
    if isinstance(cap, Mapping):
        out.append(
            f"capacity SGLang chose: {cap.get('kv_tokens')} KV tokens, "
            f"{cap.get('max_running_requests')} running requests at most, "
            f"context {cap.get('context_len')}"
        )
    return out


def slow_start_notes(workers: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per slow phase of each worker's latest start."""
    return [
        f"worker {w['id']}: slow start: {slow.get('text')}"
        for w in workers
        for slow in (w.get("start") or {}).get("slow") or ()
        if isinstance(slow, Mapping)
    ]


def capacity_outliers(workers: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per worker whose KV tokens or running-request limit differs from the value
    most of its siblings started with (less memory free at its start, other flags)."""
    caps = {
        int(w["id"]): cap
        for w in workers
        if isinstance(cap := (w.get("start") or {}).get("capacity"), Mapping)
    }
    if len(caps) < 3:
        return []
    out: list[str] = []
    for key, what in (("kv_tokens", "KV tokens"), ("max_running_requests", "running requests")):
        counts = Counter(c.get(key) for c in caps.values())
        usual, n = counts.most_common(1)[0]
        if n * 2 <= len(caps):
            continue  # no majority to compare with
        for wid, c in sorted(caps.items()):
            if c.get(key) != usual:
                out.append(
                    f"worker {wid}: SGLang chose {c.get(key)} {what} at its start, "
                    f"{n} of its siblings {usual}"
                )
    return out
