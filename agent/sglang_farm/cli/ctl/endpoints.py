"""`farmctl endpoints`: the base URL of every ready worker (what a router balances over),
or with `--gateway` the gateway's alone (the one URL for users).

One verb, read by scripts: its stdout is URLs only; what it says besides goes to stderr.
"""

from __future__ import annotations

import click

from sglang_farm.cli.ctl.connection import Ctl, pass_ctl
from sglang_farm.cli.ctl.exits import Failed


@click.command()
@click.option(
    "--gateway",
    "gateway_only",
    is_flag=True,
    help="Print only the gateway's URL, the one URL for users (exit 1 if there is none).",
)
@pass_ctl
def endpoints(ctl: Ctl, gateway_only: bool) -> None:
    """Print the base URL of every ready worker, one per line.

    None while the host is held out of the gateway (farmctl drain-host): said on
    stderr, until farmctl undrain-host. The gateway is not a worker and is not listed
    (farmctl status shows it); --gateway prints its URL alone:

    \b
        curl "$(farmctl endpoints --gateway)/v1/models"
    """
    if (r := ctl.query("endpoints")) is None:
        return
    if not gateway_only:
        click.echo("".join(f"{e['base_url']}\n" for e in r.get("endpoints", [])), nl=False)
        if r.get("held_out_since") is not None:
            click.echo(
                "farmctl: the host is drained (farmctl drain-host): no worker listed until "
                "farmctl undrain-host",
                err=True,
            )
        return
    if not r.get("gateway"):
        raise Failed(
            "this farm has no gateway ([gateway] is off in its config); switch it on "
            "as docs/gateway.md says, or use the workers' URLs (farmctl endpoints)"
        )
    click.echo(r["gateway"])
