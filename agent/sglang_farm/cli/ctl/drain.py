"""`farmctl drain-host` and `undrain-host`: every worker of this host held out of the
gateway (its requests waited for; exit 7 or 11 when not all are confirmed), and let back.

One family, for a reboot or an upgrade of the host (issue 26).
"""

from __future__ import annotations

import click

from sglang_farm.cli.ctl.connection import Ctl, pass_ctl
from sglang_farm.cli.ctl.exits import TimedOut, Unconfirmed
from sglang_farm.cli.ctl.text import who
from sglang_farm.control.client import CHANGE_TIMEOUT


@click.command("drain-host")
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, max=3600),
    default=None,
    help="Seconds to wait for the requests in flight [default: the farm's "
    "[gateway] drain_timeout].",
)
@pass_ctl
def drain_host(ctl: Ctl, timeout: float | None) -> None:
    """Take every worker of this host out of the gateway and wait for its requests.

    For a reboot or a package upgrade: no worker is stopped, and none goes back
    into the gateway (also a restarted one, also across an agent restart) until
    farmctl undrain-host. Stops, restarts and reloads keep working meanwhile.

    Exits 0 once every serving worker is out of the gateway with no request
    running or queued; 7 when --timeout ran out first (the host stays out of the
    gateway; the workers named still run requests); 11 when a gateway that does not
    answer (frozen, overloaded) never confirmed the workers out: it may still route
    users to them; 1 without a gateway.
    """
    args = {} if timeout is None else {"timeout": timeout}
    res = ctl.call("drain-host", args, timeout=CHANGE_TIMEOUT + (timeout or 3600.0))
    if ctl.as_json:
        ctl.emit_json(res)
    left = {str(w): n for w, n in (res.get("left") or {}).items()}
    waited = float(res.get("waited_s") or 0.0)
    unconfirmed = {str(u): list(ws) for u, ws in (res.get("unconfirmed") or {}).items()}
    if unconfirmed:
        what = "; ".join(
            f"gateway {u} ({who([int(w) for w in ws])})" for u, ws in unconfirmed.items()
        )
        also = f"; and {len(left)} worker(s) still had requests" if left else ""
        raise Unconfirmed(
            f"host held out of the gateway, but could not confirm it out of {what}: that "
            "gateway does not answer (frozen or overloaded) and may still route users to "
            f"these workers{also}; check it (is smg stopped? `farmctl status` names its "
            "error), then run farmctl drain-host again"
        )
    if left:
        what = ", ".join(
            f"worker {w} ({'unknown' if n is None else n} in flight)" for w, n in left.items()
        )
        raise TimedOut(
            f"host out of the gateway, but after {waited:.1f}s {what} still had requests; "
            "the host stays out: run farmctl drain-host again to wait longer"
        )
    if not ctl.as_json:
        click.echo(
            f"host drained: {who([int(w) for w in res.get('workers', [])])} out of the "
            f"gateway, no request in flight (waited {waited:.1f}s); they keep running until "
            "farmctl undrain-host"
        )


@click.command("undrain-host")
@pass_ctl
def undrain_host(ctl: Ctl) -> None:
    """Put this host's workers back into the gateway after farmctl drain-host.

    Returns at once: each ready worker joins as the gateway confirms it; farmctl
    wait blocks until they all have.
    """
    res = ctl.call("undrain-host", timeout=CHANGE_TIMEOUT)
    if ctl.as_json:
        ctl.emit_json(res)
        return
    click.echo(
        f"host back in the gateway: {who([int(w) for w in res.get('workers', [])])} "
        "join as each is ready (farmctl wait blocks until they have)"
    )
