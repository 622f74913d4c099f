"""`farmctl status`: the farm in a header line, the gateway's and the model stage's lines,
a table of workers and a note per quarantined GPU or failure (`format_status`, pure, from
the status JSON), and the verb that prints it.

The rendering is most of this module: the verb is one call. `staging_line` is also what
`why` prints of a stage under way.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import click

from sglang_farm.cli.ctl.canaryview import canary_line
from sglang_farm.cli.ctl.connection import Ctl, pass_ctl
from sglang_farm.cli.ctl.text import duration, table
from sglang_farm.cli.readings import errors_cell
from sglang_farm.cli.startview import (
    capacity_cell,
    capacity_outliers,
    phase_cell,
    slow_start_notes,
)
from sglang_farm.control import facts


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


def _restarts(w: Mapping[str, Any]) -> str:
    total = int(w.get("restarts_total") or 0)
    by = w.get("restarts_by_reason") or {}
    if not total:
        return "0"
    parts = ", ".join(f"{k} {v}" for k, v in sorted(by.items(), key=lambda kv: -kv[1]) if v)
    return f"{total} ({parts})" if parts else str(total)


def _vram(w: Mapping[str, Any], gpus: Mapping[int, Mapping[str, Any]]) -> str:
    mine = [gpus[g] for g in w.get("gpus", []) if g in gpus]
    # No process (facts.has_process): its GPU's figure is not the worker's.
    if not mine or not facts.has_process_of(w):
        return "-"
    used = sum(g["used_bytes"] for g in mine)
    total = sum(g["total_bytes"] for g in mine)
    sim = " (simulated)" if any(g.get("simulated") for g in mine) else ""
    return f"{_gib(used)}/{_gib(total)} GiB{sim}"


def _gateway_line(gw: Mapping[str, Any], n_workers: int) -> str:
    """`gateway URL · up · routes to N of M workers` (and the error count, if any)."""
    members = int(gw.get("members") or 0)
    if gw.get("up"):
        state = f"up · routes to {members} of {n_workers} workers"
    else:
        state = f"down · routed to {members} of {n_workers} workers when last confirmed"
    errors = int(gw.get("errors") or 0)
    if errors:
        state += f" · {errors} error{'s' if errors != 1 else ''} since the agent started"
    foreign = [str(u) for u in gw.get("foreign") or ()]
    if foreign:
        state += (
            f" · {len(foreign)} member{'s' if len(foreign) != 1 else ''} not of this "
            f"farm: {', '.join(foreign)}"
        )
    for o in gw.get("overloaded") or ():
        if isinstance(o, Mapping):
            state += (
                f" · worker {o.get('worker')} overloaded ({o.get('reason')}): the gateway "
                "routes new requests to other workers while it is"
            )
    return f"gateway {gw.get('url')} · {state}"


def staging_line(sg: Mapping[str, Any]) -> str:
    """The model stage in one line: progress (bytes, rate, time left), or how it ended."""
    from sglang_farm.staging.plan import gib
    from sglang_farm.staging.progress import StageProgress, describe, seconds_text

    head = f"model {sg.get('source')} -> {sg.get('target')}"
    state = sg.get("state")
    if state == "staging":
        done, total = int(sg.get("bytes_done") or 0), int(sg.get("bytes_total") or 0)
        rate = sg.get("rate_bytes_per_s")
        elapsed = done / float(rate) if rate else 0.0
        progress = StageProgress(sg.get("step") or "checking", done, total, elapsed)
        return f"{head} · staging: {describe(progress)}"
    if facts.stage_failed_of(sg):
        return (
            f"{head} · staging FAILED [{sg.get('error_kind')}]: {sg.get('error')}; "
            f"what to do: {sg.get('fix')}; no worker starts until a stage succeeds"
        )
    if state == "waiting":
        return f"{head} · waiting to stage"
    took = sg.get("last_duration_s")
    when = f" in {seconds_text(float(took))}" if took is not None else ""
    if state == "current":
        line = f"{head} · staged (the copy in place was current{when})"
    else:
        line = f"{head} · staged ({gib(int(sg.get('last_copied_bytes') or 0))} copied{when})"
    if sg.get("error"):  # a reload whose model could not be staged
        line += (
            f"; reload REJECTED [{sg.get('error_kind')}]: {sg.get('error')}; what to do: "
            f"{sg.get('fix')}; the reload was not applied: workers keep the previous copy"
        )
    return line


def _ready_part(st: Mapping[str, Any], workers: Sequence[Mapping[str, Any]], gw: bool) -> str:
    """The header's count (issue 31): `N/M ready`, naming the workers that are not, by
    their state (`(worker 5 failed)`); with a gateway what users get: `and routed`, or
    which ready workers it does not route (`, the gateway does not route worker 5`)."""
    text = f"{st.get('ready', 0)}/{len(workers)} ready"
    ready = st.get("ready_workers")
    if not isinstance(ready, list):
        return text  # an older agent: the count alone
    by_state: dict[str, list[str]] = {}
    for w in workers:
        if w["id"] not in ready:
            by_state.setdefault(str(w.get("state")), []).append(str(w["id"]))
    if by_state:
        text += (
            " ("
            + "; ".join(
                f"worker{'s' if len(ids) > 1 else ''} {_few(ids)} {state}"
                for state, ids in by_state.items()
            )
            + ")"
        )
    if not gw or not ready or st.get("held_out_since") is not None:
        return text  # a drained host says so next
    unrouted = [str(w["id"]) for w in workers if w["id"] in ready and not w.get("in_gateway")]
    if not unrouted:
        return text + " and routed"
    s = "s" if len(unrouted) > 1 else ""
    return text + f", the gateway does not route worker{s} {_few(unrouted)}"


def _few(ids: Sequence[str], most: int = 8) -> str:
    """Ids for a header line: the first `most`, then how many more (64 workers starting)."""
    more = f" and {len(ids) - most} more" if len(ids) > most else ""
    return ", ".join(ids[:most]) + more


def format_status(st: Mapping[str, Any]) -> str:
    """The `farmctl status` text: a header line, the gateway's line when there is one,
    a table, and one line per quarantined GPU or failure (and for a gateway that does
    not answer)."""
    now = float(st.get("now") or time.time())
    workers: list[Mapping[str, Any]] = st.get("workers", [])
    gpus = {int(g["index"]): g for g in st.get("gpus", [])}
    has_queue = any("queue_depth" in w for w in workers)
    has_capacity = any((w.get("start") or {}).get("capacity") for w in workers)
    has_5xx = any("recent_5xx" in w for w in workers)  # issue 34 §2: SGLang >= 0.5.20
    has_node = any("numa_nodes" in w for w in workers)  # issue 34 §5: several nodes
    gw: Mapping[str, Any] | None = st.get("gateway")
    head = (
        f"farm {st.get('farm')} · {st.get('runtime')} runtime · rollout {st.get('rollout')}"
        + (f" ({st['rollout_reason']})" if st.get("rollout_reason") else "")
        + f" · {_ready_part(st, workers, gw is not None)}"
    )
    if any(
        isinstance(a, Mapping) and a.get("kind") == "not_saved"
        for a in st.get("state_alerts") or ()
    ):
        head += " · STATE NOT SAVED"
    held = st.get("held_out_since")
    if isinstance(held, int | float):
        head += f" · host DRAINED (out of the gateway) for {duration(now - float(held))}"
    cols = ["WORKER", "GPU", *(["NODE"] if has_node else []), "PORT", "STATE"]
    if gw is not None:
        cols.append("GATEWAY")  # in: the gateway confirmed it routes to the worker
    cols += ["FOR", "PID", "RESTARTS"]
    if has_queue:
        cols.append("QUEUE")
    if has_5xx:
        cols.append("5XX")  # the 5xx share of its answers over its recent polls
    if gpus:
        cols.append("VRAM")
    if has_capacity:
        cols.append("CAPACITY")  # what SGLang chose at the worker's start (issue 34 §4)
    rows: list[list[str]] = [cols]
    notes: list[str] = []
    for w in workers:
        row = [
            str(w["id"]),
            ",".join(str(g) for g in w.get("gpus", [])),
            *([",".join(str(n) for n in w.get("numa_nodes") or []) or "-"] if has_node else []),
            str(w.get("port", "")),
            str(w.get("state", ""))
            + (f" · {cell}" if (cell := phase_cell(w.get("start"), now)) else ""),
            *(["in" if w.get("in_gateway") else "out"] if gw is not None else []),
            duration(now - float(w["since"])) if w.get("since") else "-",
            str(w["pid"]) if w.get("pid") else "-",
            _restarts(w),
        ]
        if has_queue:
            q = w.get("queue_depth")
            row.append("-" if q is None else str(q))
        if has_5xx:
            row.append(errors_cell(w.get("recent_5xx")))
        if gpus:
            row.append(_vram(w, gpus))
        if has_capacity:
            row.append(capacity_cell(w.get("start")))
        rows.append(row)
        q = w.get("quarantine")
        f = w.get("last_failure")
        if q:
            notes.append(
                f"worker {w['id']}: GPU {q.get('gpu')} quarantined ({q.get('reason')}): "
                f"farmctl why {w['id']}"
            )
        elif (
            f and facts.failure_shown_of(w)  # issue 31: not once served or reset since
        ):
            step = f", OOM step {w['oom_step']}" if w.get("oom_step") else ""
            notes.append(f"worker {w['id']}: {f.get('summary')}{step} (farmctl why {w['id']})")
    notes += capacity_outliers(workers)
    notes += slow_start_notes(workers)  # issue 34 §4: the worker_start_slow line's
    if isinstance(held, int | float):
        notes.append(
            "host drained: every worker is held out of the gateway (farmctl drain-host), also "
            "when it restarts, until farmctl undrain-host"
        )
    for a in st.get("state_alerts") or ():  # issue 30: state not saved, damaged or refused
        if isinstance(a, Mapping):
            notes.append(str(a.get("message") or a.get("file")))
    # Issue 26: several gateways ([gateway] urls) are shown one line each.
    each: list[Mapping[str, Any]] = st.get("gateways") or ([gw] if gw is not None else [])
    for g in each:
        if not g.get("up"):
            why = f": {g['last_error']}" if g.get("last_error") else ""
            others = " and its other gateways" if len(each) > 1 else ""
            notes.append(
                f"gateway {g.get('url')} is not answering{why}; the farm keeps supervising "
                f"its workers{others} and retries"
            )
    sg: Mapping[str, Any] | None = st.get("staging")
    cv: Mapping[str, Any] | None = st.get("canary")
    out = [
        head,
        *(_gateway_line(g, len(workers)) for g in each),
        *([staging_line(sg)] if sg is not None else []),
        *([canary_line(cv, now)] if cv is not None else []),
        "",
        table(rows),
    ]
    if notes:
        out += ["", *notes]
    return "\n".join(out)


@click.command()
@pass_ctl
def status(ctl: Ctl) -> None:
    """Show every worker: GPU, port, state, time in state, PID, restarts, VRAM.

    Also, where known: a starting worker's phase and how long it has been in it,
    the queue, the 5xx share of its recent answers (SGLang 0.5.20 or later), the
    capacity SGLang chose at its start, and on a host of several NUMA nodes each
    worker's node (NODE).

    With a gateway: its URL, whether it answers, how many workers it routes to,
    and a GATEWAY column (in/out) per worker. Once a change has been judged on a
    canary, one line with its verdict and evidence (farmctl why N says more). A
    note line follows for each worker whose GPU is quarantined and each failing
    worker.
    """
    if (st := ctl.query("status")) is not None:
        click.echo(format_status(st))
