"""`farmctl reload`: the config re-read and applied only if valid, then the rollout
followed: the canary's analysis (a line a phase, the verdict raised as exit 5 or 6), then
the restarted workers' waves, as `restart` follows them.

Its own module because the verdict it waits for (`_await_verdict`, by polling `status`)
and its exits (1, 3, 5, 6, 10) are reload's alone.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import click

from sglang_farm.cli.ctl.canaryview import CANARY_WORDS, canary_line
from sglang_farm.cli.ctl.connection import Ctl, pass_ctl
from sglang_farm.cli.ctl.exits import Failed, Held, RestartNeeded, RolledBack
from sglang_farm.cli.ctl.follow import wait_ready
from sglang_farm.cli.ctl.text import who
from sglang_farm.control.client import CHANGE_TIMEOUT

# How often `farmctl reload` reads the farm's view while it waits for the verdict: a
# `status` is a pointer read in the agent, and a verdict takes tens of seconds at least.
ROLLOUT_POLL_S = 1.0


def _ours(
    st: Mapping[str, Any], issued_at: float, change: object = None
) -> Mapping[str, Any] | None:
    """The canary analysis that this reload started: one whose window (or its canary's
    restart) began after the agent took the reload, or `change`'s, the analysis this
    reload found under way (the same change reloaded: it goes on). An earlier change's
    verdict is not ours."""
    cv = st.get("canary")
    if not isinstance(cv, dict):
        return None
    if change is not None and cv.get("change") == change:
        return cv
    started = cv.get("started_at")
    return cv if isinstance(started, int | float) and started >= issued_at else None


def _await_verdict(
    ctl: Ctl, issued_at: float, deadline: float, timeout: float
) -> Mapping[str, Any] | None:
    """Read the farm's view (`status`) until the canary analysis this reload started has
    a verdict, printing a line when the canary restarts, when its window starts, and the
    verdict; None when the reload started no analysis (nothing to roll, no canary among
    the workers it restarts, or `[rollout] analysis_window = "0s"`). The agent builds its
    view before it answers a reload, so the first status already shows the analysis."""
    shown: set[object] = set()
    going_on: object = None  # the change of an analysis under way when the reload returned
    while True:
        st = ctl.call("status")
        cv = _ours(st, issued_at, going_on)
        now = st.get("canary")
        if cv is None and not shown and isinstance(now, dict) and now.get("state") == "analysing":
            # An applied reload supersedes any other change's analysis: one still
            # analysing now is of this reload's change, which the reload left running.
            going_on, cv = now.get("change"), now
        if cv is None:
            if shown:
                raise Failed(
                    "the change this reload started is no longer analysed: another reload "
                    "superseded it (farmctl status)"
                )
            return None
        # A line per phase: the canary restarting, its window, each extension of it, the verdict.
        key = (cv.get("state"), cv.get("ends_at") is not None, cv.get("extensions"))
        if key not in shown:
            shown.add(key)
            if not ctl.as_json:
                click.echo(canary_line(cv, float(st.get("now") or time.time())))
        if cv.get("state") != "analysing":
            return cv
        left = deadline - time.monotonic()
        if left <= 0:
            raise Failed(
                f"no verdict after {timeout:g}s: canary {cv.get('canary')} is still analysing; "
                "the agent carries on (farmctl status follows it), or wait longer with --timeout"
            )
        time.sleep(min(ROLLOUT_POLL_S, left))


def _refused_by_canary(cv: Mapping[str, Any]) -> None:
    """Raise a verdict that stops the rollout: rolled back (exit 5) or held (exit 6)."""
    wid, change, state = cv.get("canary"), cv.get("change"), cv.get("state")
    evidence = str(cv.get("evidence") or "")
    # The agent's evidence may open with the verdict ("rolled back: ..."), said here already.
    word = f"{CANARY_WORDS.get(str(state), state)}: "
    evidence = evidence[len(word) :] if evidence.startswith(word) else evidence
    if state == "rolled_back":
        raise RolledBack(
            f"change {change} rolled back on canary {wid}: {evidence}; the other workers "
            f"kept the old config and the change is not retried (farmctl why {wid})"
        )
    if state == "held":
        raise Held(
            f"change {change} held on canary {wid}: {evidence}; nothing more rolls until the "
            f"next reload (farmctl why {wid}; docs/canary.md)"
        )


def _reload_summary(res: Mapping[str, Any]) -> str:
    """What the applied reload did and will do: the restarts are under way when the agent
    answers, and with a canary analysis only the canary's (the rest wait on its verdict)."""
    restarted = [int(i) for i in res.get("restarted") or ()]
    gate = res.get("gated_on")
    parts: list[str] = []
    if isinstance(gate, int) and gate in restarted:
        rest = [i for i in restarted if i != gate]
        parts.append(f"restarting canary worker {gate} onto the change")
        if rest:
            one = len(rest) == 1
            parts.append(
                f"{who(rest)} follow{'s' if one else ''} in waves if its analysis passes "
                f"(otherwise {'it keeps' if one else 'they keep'} the old config)"
            )
    elif restarted:
        parts.append(f"restarting {who(restarted)}")
    for key in ("added", "removed"):
        if res.get(key):
            parts.append(f"{key} {who([int(i) for i in res[key]])}")
    return "; ".join(parts) if parts else "no worker changed"


@click.command()
@click.option(
    "--no-wait", is_flag=True, help="Return once the config is applied, before the verdict."
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True, max=24 * 3600),
    default=3600.0,
    show_default=True,
    help="Seconds to wait for the canary's verdict and the waves after it, together.",
)
@pass_ctl
def reload(ctl: Ctl, no_wait: bool, timeout: float) -> None:
    """Re-read and validate the config; apply it only if valid.

    Only workers whose command line changed are restarted, canary first, then in
    waves. By default farmctl then follows the rollout: the canary's analysis
    (a line when it restarts, when its window starts, and its verdict with the
    evidence), then each restarted worker as restart does ("worker N: ready
    after S").

    Exits 1 (and the old config keeps running) when the new one has problems or
    the rollout is not over within --timeout; 3 when a restarted worker ends
    failed; 5 when the canary was rolled back; 6 when the change is held (too
    little traffic to judge, no source of the canary's errors, or its canary
    rejected it before: the agent then does not apply it); 10 when the config is
    valid but only an agent restart applies it (a [gateway] change): systemctl
    restart sglang-farm, the workers keep running.
    """
    asked_at = time.time()
    res = ctl.call("reload", timeout=CHANGE_TIMEOUT)
    if ctl.as_json and (no_wait or not res.get("applied")):
        ctl.emit_json(res)
    if not res.get("applied") and res.get("held"):
        # Its change was rejected by a canary before: not rolled again (docs/canary.md).
        raise Held(f"reload held: {res['held']}")
    if not res.get("applied"):
        problems = list(res.get("problems", []))
        if not ctl.as_json:
            for p in problems:
                click.echo(f"  {p}", err=True)
        if res.get("restart_needed"):
            # Not a problem of the config: an orchestrator branches on exit 10.
            raise RestartNeeded(
                "reload not applied: the change needs an agent restart; the old config "
                "keeps running; apply it with systemctl restart sglang-farm (the workers "
                "keep running and the new agent adopts them)"
            )
        n = len(problems)
        raise Failed(
            f"reload rejected: {n} problem{'s' if n != 1 else ''} in the config; "
            "the old config keeps running; fix them and run farmctl reload again"
        )
    if not ctl.as_json:
        click.echo("config applied: " + _reload_summary(res))
    if no_wait:
        return
    deadline = time.monotonic() + timeout
    # The agent's clock when it took the reload; an agent without it: ours (same host).
    issued = res.get("issued_at")
    issued_at = float(issued) if isinstance(issued, int | float) else asked_at
    cv = _await_verdict(ctl, issued_at, deadline, timeout)
    if cv is not None and ctl.as_json:
        # One document, whatever the verdict: the reload's result and the analysis.
        ctl.emit_json({**res, "canary": cv})
    if cv is not None:
        _refused_by_canary(cv)
    elif ctl.as_json:
        ctl.emit_json({**res, "canary": None})
    ids = [int(i) for i in (*res.get("restarted", ()), *res.get("added", ()))]
    if not ids:
        return
    # The waves: each restarted worker followed as `farmctl restart` does.
    wait_ready(ctl, ids, issued_at, max(deadline - time.monotonic(), 0.001), quiet=ctl.as_json)
    if not ctl.as_json:
        what = f"change {cv.get('change')} promoted on canary {cv.get('canary')}" if cv else ""
        click.echo(f"rollout done{': ' + what + ', every wave ready' if what else ''}")
