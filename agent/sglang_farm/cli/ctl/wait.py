"""`farmctl wait`: block until the farm is settled, for an orchestrator (issue 26): the
agent's `settled` polled, what it waits for printed as that changes, and what holds the
farm (`control.wire.FAILURE_KINDS`) raised at once as its exit code (`WAIT_EXITS`).

One verb: the settled rule is the agent's (`control.settled`); this words and exits.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import click

from sglang_farm.cli.ctl.connection import Ctl, pass_ctl
from sglang_farm.cli.ctl.exits import (
    Failed,
    FarmctlError,
    Halted,
    Held,
    HostDrained,
    NotRunning,
    RolledBack,
    TimedOut,
)
from sglang_farm.cli.ctl.text import who
from sglang_farm.control import wire

# `farmctl wait`: what holds the farm (control.wire.FAILURE_KINDS) -> its exit.
WAIT_EXITS: Mapping[str, type[FarmctlError]] = {
    wire.STAGE_FAILED: Halted,
    wire.ROLLOUT_HALTED: Halted,
    wire.CANARY_ROLLED_BACK: RolledBack,
    wire.CANARY_HELD: Held,
    wire.HOST_DRAINED: HostDrained,
    wire.WORKER_FAILED: NotRunning,
    wire.WORKER_QUARANTINED: NotRunning,
}


# How often `farmctl wait` asks whether the farm is settled: a pointer read in the agent.
SETTLED_POLL_S = 0.5


def _items(res: Mapping[str, Any], key: str) -> list[str]:
    """The messages of `res[key]`; the workers the same gateways do not route yet
    (`not_routed_by`) said once, in one message naming them all (issue 31: eight
    `worker N is ready; the gateway ... does not route it` in one line)."""
    said: list[str | tuple[str, ...]] = []  # a message, or the gateways of a group
    joining: dict[tuple[str, ...], list[int]] = {}
    for i in res.get(key) or ():
        if not isinstance(i, dict):
            continue
        by, wid = i.get("not_routed_by"), i.get("worker")
        if not isinstance(by, list) or not isinstance(wid, int):
            said.append(str(i.get("message")))
            continue
        gws = tuple(str(g) for g in by)
        if gws not in joining:
            said.append(gws)
        joining.setdefault(gws, []).append(wid)
    return [m if isinstance(m, str) else _not_routed_text(joining[m], m) for m in said]


def _not_routed_text(ids: Sequence[int], gateways: Sequence[str]) -> str:
    one = len(ids) == 1
    if not gateways:  # not confirmed in yet
        return f"{who(ids)} {'is' if one else 'are'} ready, not yet in the gateway"
    return (
        f"{who(ids)} {'is' if one else 'are'} ready; the gateway at {', '.join(gateways)} "
        f"does not route {'it' if one else 'them'}"
    )


@click.command()
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, max=24 * 3600),
    default=600.0,
    show_default=True,
    help="Seconds to wait for the farm to settle.",
)
@pass_ctl
def wait(ctl: Ctl, timeout: float) -> None:
    """Block until the farm is settled, for an orchestrator (Ansible, a script).

    Settled: every worker that should serve is ready and, with a gateway, in it;
    no model stage, rollout, canary analysis, rolling restart, drain or stop under
    way. A worker an operator stopped does not count; a failed or quarantined one
    does. Prints what it waits for as that changes.

    Exits 0 settled; 7 still not settled after --timeout; at once, when the farm
    holds what will not change by itself: 8 the rollout is halted or the model
    stage failed, 5 the latest change's canary was rolled back, 6 it is held, 9
    the host is held out of the gateway (farmctl undrain-host), 3 a worker failed
    or is quarantined (in that order when several hold); 4 agent unreachable.
    """
    began = time.monotonic()
    deadline = began + timeout
    said: list[str] = []
    while True:
        res = ctl.call("settled")
        if res.get("settled") or res.get("failures") or time.monotonic() >= deadline:
            break
        waiting = _items(res, "waiting")
        if waiting != said and not ctl.as_json:
            click.echo("waiting: " + "; ".join(waiting))
        said = waiting
        time.sleep(min(SETTLED_POLL_S, max(deadline - time.monotonic(), 0.0)))
    failures = [f for f in res.get("failures") or () if isinstance(f, dict)]
    waited = time.monotonic() - began
    if ctl.as_json:
        timed_out = not res.get("settled") and not failures
        ctl.emit_json({**res, "timed_out": timed_out, "waited_s": round(waited, 3)})
    if res.get("settled"):
        if not ctl.as_json:
            n, m = res.get("serving"), res.get("should_serve")
            where = " (ready and in the gateway)" if res.get("serving") is not None else ""
            click.echo(f"settled: {n} of {m} workers serving{where}")
        return
    if failures:
        if not ctl.as_json:
            for msg in _items(res, "failures")[1:]:
                click.echo(f"  also: {msg}", err=True)
        first = failures[0]
        raise WAIT_EXITS.get(str(first.get("kind")), Failed)(f"not settled: {first.get('message')}")
    raise TimedOut(
        f"not settled after {timeout:g}s: waiting for {'; '.join(_items(res, 'waiting'))}; "
        "farmctl status shows the farm, or wait longer with --timeout"
    )
