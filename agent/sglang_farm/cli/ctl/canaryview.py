"""Pure: a canary analysis in words, from the status JSON's `canary` (docs/canary.md): the
one line `status` and `reload` print, and the lines `why` prints for the canary worker
(what the farm did, one row per compared figure).

Apart from the verbs because three of them (status, why, reload) word it, the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sglang_farm.cli.ctl.text import duration, table

# A canary analysis's states (canary.view.CanaryState) in words.
CANARY_WORDS = {
    "analysing": "analysing",
    "promoted": "promoted",
    "rolled_back": "rolled back",
    "held": "held",
}


def _secs(seconds: float) -> str:
    return f"{max(round(seconds), 0):,} s"


def canary_line(cv: Mapping[str, Any], now: float) -> str:
    """The canary analysis in one line: "canary 3: rolled back: canary ITL p99 0.052 s =
    5.2x the baseline's over 30 s, 412 vs 2,830 requests"; while the window runs,
    "canary 3: analysing, 12 s of 30 s left" and what is known so far ("analysing, extended 1
    of 2, 40 s of 60 s left" once a window that ended short of traffic was extended)."""
    head = f"canary {cv.get('canary')}"
    state = str(cv.get("state"))
    word = CANARY_WORDS.get(state, state)
    evidence = str(cv.get("evidence") or "")
    if state == "analysing":
        ends = cv.get("ends_at")
        text = "analysing"
        extensions = cv.get("extensions")
        if isinstance(extensions, int) and extensions > 0:
            # The window ended short of traffic and was extended ([rollout] max_extensions).
            said = f"extended {extensions} of {cv.get('max_extensions')}"
            text += f", {said}"
            evidence = evidence.removeprefix(f"{said}: ")
        if isinstance(ends, int | float):
            window = float(cv.get("window_s") or 0)
            text += f", {_secs(float(ends) - now)} of {_secs(window)} left"
        return f"{head}: {text}" + (f" ({evidence})" if evidence else "")
    if not evidence:
        return f"{head}: {word}"
    # The agent's evidence may already open with the verdict ("rolled back: ...").
    return f"{head}: {evidence if evidence.startswith(word) else f'{word}: {evidence}'}"


def _figure(x: object) -> str:
    return f"{x:.4g}" if isinstance(x, int | float) and not isinstance(x, bool) else "-"


# What the farm did, by verdict (docs/canary.md).
_CANARY_DONE = {
    "analysing": "the next wave waits for the verdict",
    "promoted": "the change rolls to the other workers, wave by wave",
    "rolled_back": (
        "the canary was put back on the accepted config, the other workers were not "
        "touched, and the change is recorded as rejected: it is not rolled again on its own"
    ),
    "held": (
        "nothing more rolls: the other workers stay on the accepted config until the next "
        "reload (the same config is judged again, another supersedes it; a change rejected "
        "before needs an edit), and SglangFarmRolloutHeld fires after 30 min"
    ),
}


def canary_why_lines(cv: Mapping[str, Any], now: float) -> list[str]:
    """`farmctl why` of the canary worker: the verdict line, the change and the window,
    what the farm did, and one row per compared figure."""
    started = cv.get("started_at")
    when = (
        f", window {_secs(float(cv.get('window_s') or 0))} from {duration(now - float(started))}"
        " ago"
        if isinstance(started, int | float)
        else ""
    )
    out = [
        canary_line(cv, now),
        f"change {cv.get('change')}{when}; canary rollbacks since the agent started: "
        f"{int(cv.get('rollbacks_total') or 0)}",
    ]
    done = _CANARY_DONE.get(str(cv.get("state")))
    if done:
        out.append(f"what the farm did: {done}")
    checks = [c for c in cv.get("checks") or () if isinstance(c, dict)]
    if checks:
        rows = [["CHECK", "CANARY", "BASELINE", "RATIO", "LIMIT", "RESULT"]]
        for c in checks:
            passed = c.get("passed")
            result = "passed" if passed is True else "FAILED" if passed is False else "not judged"
            ratio = c.get("ratio")
            rows.append(
                [
                    str(c.get("name")),
                    _figure(c.get("canary")),
                    _figure(c.get("baseline")),
                    f"{ratio:.2f}x" if isinstance(ratio, int | float) else "-",
                    _figure(c.get("limit")),
                    result,
                ]
            )
        out += ["  " + ln for ln in table(rows).splitlines()]
    return out
