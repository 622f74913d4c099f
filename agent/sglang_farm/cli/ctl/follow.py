"""I/O: following workers until they are ready through the agent's `wait-ready` stream,
every worker at once under one deadline, each phase printed once, and the end of each
wait raised as its exit code (failed or quarantined: 3; not ready in time: 1).

Apart from the verbs because `restart`, `start --wait` and `reload` (its waves) all end
in it. (Not `cli/waitready`: that is `sglang-farm wait-ready`, the units' readiness gate.)
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import click

from sglang_farm.cli.ctl.connection import Ctl
from sglang_farm.cli.ctl.exits import Failed, NotRunning
from sglang_farm.control import facts
from sglang_farm.control.release import release_command


def _since_issue(obj: Mapping[str, object], issued_at: float, fallback_key: str) -> float:
    """Seconds from the request's `issued_at` to when `obj` (a phase, a worker) entered
    its state: both are the agent's clock. An agent without `since` gets the wait's own
    elapsed time (`fallback_key`)."""
    since = obj.get("since")
    if isinstance(since, int | float) and issued_at:
        return max(float(since) - issued_at, 0.0)
    value = obj.get(fallback_key)
    return float(value) if isinstance(value, int | float) else 0.0


def wait_ready(
    ctl: Ctl, ids: Sequence[int], issued_at: float, timeout: float, *, quiet: bool = False
) -> None:
    """Follow every worker at once (one deadline for all), printing each phase once.

    Each worker is followed on its own connection from the start, so the workers of a
    later wave show their phases too (followed one after another, they were ready by
    their turn). Each worker is reported once: its phases entered since the request,
    then "ready after S" where S counts from when the agent took the request (the
    agent's clock). Failures are raised afterwards, in the order of `ids`. `quiet`: print
    nothing (`reload --json`, which ends with one document).
    """
    import threading

    deadline = time.monotonic() + timeout
    finals: dict[int, Mapping[str, Any]] = {}
    errors: dict[int, BaseException] = {}
    out = threading.Lock()

    def follow(wid: int) -> None:
        try:
            finals[wid] = _follow(ctl, wid, issued_at, deadline, out, quiet=quiet)
        except BaseException as exc:  # re-raised in the caller's thread
            errors[wid] = exc

    threads = [threading.Thread(target=follow, args=(wid,), daemon=True) for wid in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for wid in ids:
        if wid in errors:
            raise errors[wid]
    for wid in ids:
        _judge(wid, finals[wid], timeout)


def _follow(
    ctl: Ctl,
    wid: int,
    issued_at: float,
    deadline: float,
    out: AbstractContextManager[object],
    *,
    quiet: bool = False,
) -> Mapping[str, Any]:
    """One worker's `wait-ready` stream: its phases printed once each; the final result."""
    left = max(deadline - time.monotonic(), 0.001)
    args = {"worker": wid, "timeout": min(left, 3600.0), "after": issued_at}
    final: Mapping[str, Any] = {}
    shown: set[object] = set()  # phases already printed (a drain's restart moves `since`)
    # The server sends a line only on a change: the read bound is the wait's own.
    for reply in ctl.stream("wait-ready", args, timeout=left + 30.0):
        with out:
            if quiet:
                pass
            elif ctl.as_json:
                ctl.emit_json(
                    {"stream": reply.stream, **(reply.payload or {})}
                    if not reply.final
                    else reply.result
                )
            elif not reply.final and reply.payload is not None:
                state = reply.payload.get("state")
                if state not in shown and _print_phase(wid, reply.payload, issued_at):
                    shown.add(state)
        if reply.final and isinstance(reply.result, dict):
            final = reply.result
    if final.get("ready") and not ctl.as_json and not quiet:
        secs = _since_issue(final, issued_at, "waited_s")
        with out:
            click.echo(f"worker {wid}: ready after {secs:.1f}s{_routing_note(final)}")
    return final


def _routing_note(final: Mapping[str, Any]) -> str:
    """Said after "ready after S" when the gateway does not route to the worker yet."""
    if final.get("routed") is not False:
        return ""  # routed to, or no gateway
    if final.get("gateway_up") is False:
        return ", but not in the gateway: the gateway is down (farmctl status)"
    return ", but the gateway does not route to it yet (farmctl status; farmctl why)"


def _judge(wid: int, final: Mapping[str, Any], timeout: float) -> None:
    """Raise what a worker's final `wait-ready` result means, unless it is ready."""
    if final.get("ready"):
        return
    if final.get("timed_out"):
        raise Failed(
            f"worker {wid} is not ready after {timeout:g}s (state {final.get('state')}); "
            f"see farmctl logs {wid}, or wait longer with --timeout"
        )
    q = final.get("quarantine")
    if q:
        raise NotRunning(
            f"worker {wid} is quarantined: GPU {q.get('gpu')} is set aside "
            f"({q.get('reason')}); start and restart leave it stopped until "
            f"{_release_of(wid, final)}; see farmctl why {wid}"
        )
    f = final.get("last_failure") or {}
    summary = f.get("summary") or f"worker {wid} is {final.get('state')}"
    raise NotRunning(f"worker {wid} failed: {summary}; see farmctl why {wid}")


def _release_of(wid: int, w: Mapping[str, Any]) -> str:
    """The command that ends worker `wid`'s quarantine: the agent's `release`, or for an
    agent older than that key the same builder over its `quarantine` and `gpus`."""
    said = w.get("release")
    if isinstance(said, str):
        return said
    q = w.get("quarantine") or {}
    gpu = q.get("gpu")
    return release_command(wid, gpu if isinstance(gpu, int) else None, w.get("gpus") or ())


def _print_phase(wid: int, p: Mapping[str, object], issued_at: float) -> bool:
    """One progress line, for a phase this request caused and that is not the last one;
    whether it was printed.

    Skipped: a phase entered before the request (the worker's state before its turn
    came), and ready/failed/quarantined, which the final line reports.
    """
    since = p.get("since")
    if isinstance(since, int | float) and since < issued_at:
        return False
    if facts.ends_wait_of(p):
        return False
    click.echo(f"worker {wid}: {p.get('state')} ({_since_issue(p, issued_at, 'elapsed_s'):.1f}s)")
    return True
