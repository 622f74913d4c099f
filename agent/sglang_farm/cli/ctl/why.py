"""`farmctl why N`: a worker's last failure (the log lines, what the farm did, what to do),
what its state means when the name alone does not, its latest start and readings, and
for the canary of the latest change the verdict with every figure compared.

One verb, the longest text farmctl prints about one worker; it words the agent's `why`
result and judges nothing itself (`control.facts`).
"""

from __future__ import annotations

import time

import click

from sglang_farm.cli.ctl.args import WORKER
from sglang_farm.cli.ctl.canaryview import canary_why_lines
from sglang_farm.cli.ctl.connection import Ctl, pass_ctl
from sglang_farm.cli.ctl.status import staging_line
from sglang_farm.cli.ctl.text import duration
from sglang_farm.cli.readings import errors_line, numa_line
from sglang_farm.cli.startview import start_lines
from sglang_farm.control import facts

# `why`'s words for a last failure that is the worker's past (`failure_past`).
_FAILURE_PAST = {
    "served": "worker {worker} has served since",
    "reset": "the operator has reset worker {worker} since",
}


@click.command()
@click.argument("worker", type=WORKER)
@pass_ctl
def why(ctl: Ctl, worker: int) -> None:
    """Explain WORKER's last failure: the log lines, what the farm did, what to do.

    Also says what its state means when the name alone does not (quarantined,
    with the next step; draining; ready but not in the gateway), and for the
    canary of the latest change its verdict, evidence and every figure compared.
    """
    r = ctl.query("why", {"worker": worker})
    if r is None:
        return
    state = r.get("state")
    since = r.get("since")
    timed = facts.state_timed_of(r) and since
    for_how_long = f" for {duration(time.time() - float(since))}" if timed else ""
    click.echo(f"worker {worker}: {state}{for_how_long}")
    if r.get("state_note"):
        click.echo(str(r["state_note"]))
    if r.get("next_step"):
        click.echo(f"next step: {r['next_step']}")
    if r.get("start"):  # issue 34 §4: its latest start, phase by phase, and its capacity
        for ln in start_lines(r["start"], time.time()):
            click.echo(ln)
    if r.get("recent_5xx"):  # issue 34 §2: from SGLang's own counter
        click.echo(errors_line(r["recent_5xx"]))
    if r.get("numa_nodes") and r.get("gpus"):  # issue 34 §5: a host of several nodes
        click.echo(numa_line(r["gpus"], r["numa_nodes"]))
    sg = r.get("staging")
    if sg and sg.get("state") == "staging":
        click.echo(staging_line(sg))  # the progress; a failed stage is the note above
    cv = r.get("canary")
    if cv:
        for ln in canary_why_lines(cv, time.time()):
            click.echo(ln)
    f = r.get("last_failure")
    if not f:
        if not r.get("quarantine") and not sg:  # said above: the GPU's or the stage's failure
            click.echo("no failure recorded")
        return
    when = []
    if r.get("last_failure_at"):
        when.append(f"{duration(time.time() - float(r['last_failure_at']))} ago")
    # Issue 31: a failure the worker has served since (or the operator reset) is its past.
    past = _FAILURE_PAST.get(str(r.get("failure_past")))
    if past is not None:
        when.append(past.format(worker=worker))
    when_text = f" ({'; '.join(when)})" if when else ""
    click.echo(f"last failure{when_text}: {f.get('summary')} [{f.get('kind')}]")
    for ln in f.get("lines", []):
        click.echo(f"  | {ln}")
    if r.get("last_action"):
        click.echo(f"what the farm did{' then' if past else ''}: {r['last_action']}")
    if r.get("advice"):
        click.echo(f"what to do{' if it happens again' if past else ''}: {r['advice']}")
    if r.get("oom_step"):
        name = f" ({r['oom_step_name']})" if r.get("oom_step_name") else ""
        click.echo(f"OOM ladder step: {r['oom_step']}{name}; farmctl reset-oom {worker} undoes it")
    by = r.get("restarts_by_reason") or {}
    if any(by.values()):
        click.echo("restarts: " + ", ".join(f"{k} {v}" for k, v in by.items() if v))
