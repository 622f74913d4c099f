"""`farmctl restart`, `start`, `stop` and `reset-oom`: the verbs that change workers, by id
or `all`, each issued as one command and (restart, start --wait) followed until ready.

One family: they share how a change is issued (`_change`: the workers acted on, when,
and the quarantined ones left stopped, each said with its way out) and the drain option.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

import click

from sglang_farm.cli.ctl.args import WORKER, no_drain_option, timeout_option, worker_or_all
from sglang_farm.cli.ctl.connection import Ctl, pass_ctl
from sglang_farm.cli.ctl.exits import NotRunning
from sglang_farm.cli.ctl.follow import wait_ready
from sglang_farm.cli.ctl.text import who
from sglang_farm.control.client import CHANGE_TIMEOUT
from sglang_farm.control.release import release_command


def _change(
    ctl: Ctl, cmd: str, target: int | str, *, drain: bool = True
) -> tuple[list[int], float, list[int]]:
    """Issue `cmd`: the workers acted on, when, and (`start`/`restart all`) the quarantined
    ones the agent left stopped, each said on stderr with its way out. (One named worker
    that is quarantined the agent refuses outright, with the release command.)"""
    args: dict[str, object] = {"worker": target}
    if not drain:
        # Sent only when asked for: an agent older than the argument still takes the rest.
        args["drain"] = False
    res = ctl.call(cmd, args, timeout=CHANGE_TIMEOUT)
    if ctl.as_json:
        ctl.emit_json(res)
    held = [int(i) for i in res.get("quarantined", [])]
    if not ctl.as_json:
        for wid in held:
            click.echo(
                f"worker {wid} is quarantined and stays stopped: release it with "
                f"{release_command(wid, None, ())} once its GPU is dealt with (farmctl why {wid})",
                err=True,
            )
    return list(res.get("workers", [])), float(res.get("issued_at", 0.0)), held


def _quarantined_left(held: Sequence[int]) -> NoReturn:
    """After waiting for the others: the quarantined workers are not running (exit 3)."""
    raise NotRunning(
        f"{who(held)} {'is' if len(held) == 1 else 'are'} quarantined and not running "
        "(said above); the others are ready"
    )


def _drain_note(no_drain: bool) -> str:
    return " (no drain)" if no_drain else ""


@click.command()
@click.argument("target", metavar="N|all", callback=worker_or_all)
@click.option("--no-wait", is_flag=True, help="Return once the restart is issued.")
@timeout_option("Seconds to wait for ready (for 'all': for every worker together).")
@no_drain_option
@pass_ctl
def restart(ctl: Ctl, target: int | str, no_wait: bool, timeout: float, no_drain: bool) -> None:
    """Restart worker TARGET (an id, or 'all' in waves) and wait until it is ready.

    Prints each phase and, once per worker, "ready after S", S counted from when
    the agent took the restart.

    With a gateway, each worker is drained first: taken out of the gateway, then
    restarted once its requests are done (at most [gateway] drain_timeout).
    Exits 3 if a worker ends failed, 1 if it is not ready within --timeout.
    """
    ids, issued_at, held = _change(ctl, "restart", target, drain=not no_drain)
    if not ctl.as_json:
        click.echo(f"restart issued for {who(ids)}{_drain_note(no_drain)}")
    if not no_wait:
        wait_ready(ctl, ids, issued_at, timeout)
        if held:
            _quarantined_left(held)


@click.command()
@click.argument("target", metavar="N|all", callback=worker_or_all)
@click.option("--wait", is_flag=True, help="Wait until the worker(s) are ready.")
@timeout_option("Seconds to wait for ready with --wait.")
@pass_ctl
def start(ctl: Ctl, target: int | str, wait: bool, timeout: float) -> None:
    """Start worker TARGET (an id, or 'all'); returns once the start is recorded."""
    ids, issued_at, held = _change(ctl, "start", target)
    if not ctl.as_json:
        click.echo(f"start requested for {who(ids)}")
    if wait:
        wait_ready(ctl, ids, issued_at, timeout)
        if held:
            _quarantined_left(held)


@click.command()
@click.argument("target", metavar="N|all", callback=worker_or_all)
@no_drain_option
@pass_ctl
def stop(ctl: Ctl, target: int | str, no_drain: bool) -> None:
    """Stop worker TARGET (an id, or 'all'); returns once it has exited.

    With a gateway, each worker is drained first: taken out of the gateway, then
    stopped once its requests are done (at most [gateway] drain_timeout).
    """
    ids, _, _ = _change(ctl, "stop", target, drain=not no_drain)
    if not ctl.as_json:
        click.echo(f"stopped {who(ids)}{_drain_note(no_drain)}")


@click.command("reset-oom")
@click.argument("worker", type=WORKER)
@pass_ctl
def reset_oom(ctl: Ctl, worker: int) -> None:
    """Put WORKER back on its configured flags (OOM ladder step 0) at its next start."""
    res = ctl.query("reset-oom", {"worker": worker}, timeout=CHANGE_TIMEOUT)
    if res is None:
        return
    click.echo(
        f"worker {worker}: OOM ladder reset to step 0; takes effect at its next start "
        f"(farmctl restart {worker})"
    )
