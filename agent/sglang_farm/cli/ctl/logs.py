"""`farmctl logs N`: a worker's recent output, or (`-f`) its stream until Ctrl-C.

One verb, the only one that streams lines of the worker's own.
"""

from __future__ import annotations

import json

import click

from sglang_farm.cli.ctl.args import WORKER
from sglang_farm.cli.ctl.connection import Ctl, pass_ctl


@click.command()
@click.argument("worker", type=WORKER)
@click.option(
    "-n",
    "--lines",
    type=click.IntRange(0, 10_000),
    default=100,
    show_default=True,
    help="How many recent lines.",
)
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines (Ctrl-C to stop).")
@pass_ctl
def logs(ctl: Ctl, worker: int, lines: int, follow: bool) -> None:
    """Print WORKER's recent output (journal or captured output)."""
    args = {"worker": worker, "lines": lines, "follow": follow}
    if not follow:
        res = ctl.query("logs", args)
        if res is None:
            return
        for ln in res.get("lines", []):
            click.echo(ln)
        return
    try:
        for reply in ctl.stream("logs", args, timeout=0):
            if reply.final:
                break
            line = (reply.payload or {}).get("line", "")
            if ctl.as_json:
                click.echo(json.dumps({"line": line}))
            else:
                click.echo(line)
    except KeyboardInterrupt:
        pass  # Ctrl-C is how a follow ends
