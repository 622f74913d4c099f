"""I/O: `farmctl`, the command line for a running sglang-farm agent.

It talks to the agent's control socket (docs/control-protocol.md). Imports are
kept to click, the standard library and the control client so that it starts in
a few tens of milliseconds: no httpx, prometheus_client or structlog here.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from enum import IntEnum
from typing import IO, Any, NoReturn, TypeVar

import click

from sglang_farm.cli.batchctl import batch
from sglang_farm.cli.readings import errors_cell, errors_line, numa_line
from sglang_farm.cli.startview import (
    capacity_cell,
    capacity_outliers,
    phase_cell,
    slow_start_notes,
    start_lines,
)
from sglang_farm.control import facts, wire
from sglang_farm.control.client import CHANGE_TIMEOUT, Client
from sglang_farm.control.release import release_command
from sglang_farm.control.wire import Reply
from sglang_farm.errors import (
    AgentError,
    AgentUnreachable,
    SocketPermissionDenied,
    UntrustedSocket,
)
from sglang_farm.host.paths import DEFAULT_CONFIG_PATH, DEFAULT_SOCKET


class Exit(IntEnum):
    """farmctl's exit codes (stable; documented in docs/control-protocol.md)."""

    OK = 0
    FAILED = 1  # the agent refused the command or the operation failed
    USAGE = 2  # bad command line, unknown worker, unreadable --config
    NOT_RUNNING = 3  # the named worker is not running / ended failed
    UNREACHABLE = 4  # no agent answers at the socket
    ROLLED_BACK = 5  # reload: the canary failed its analysis and was put back (docs/canary.md)
    HELD = 6  # reload: the change is held (too little traffic to judge, or rejected before)
    TIMED_OUT = 7  # wait, drain-host: time ran out (something is still under way)
    HALTED = 8  # wait: the rollout is halted, or the model stage failed
    DRAINED = 9  # wait: the host is held out of the gateway (drain-host)
    RESTART_NEEDED = 10  # reload: valid, but only an agent restart applies it ([gateway])
    UNCONFIRMED = 11  # drain-host: a gateway that does not answer may still route to the host


class FarmctlError(click.ClickException):
    """An expected error: one line on stderr, no traceback. Subclasses set the exit code."""

    exit_code = Exit.FAILED

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(f"farmctl: {self.format_message()}", file=file or sys.stderr)


class Failed(FarmctlError):
    exit_code = Exit.FAILED


class BadUsage(FarmctlError):
    exit_code = Exit.USAGE


class NotRunning(FarmctlError):
    exit_code = Exit.NOT_RUNNING


class Unreachable(FarmctlError):
    exit_code = Exit.UNREACHABLE


class RolledBack(FarmctlError):
    exit_code = Exit.ROLLED_BACK


class Held(FarmctlError):
    exit_code = Exit.HELD


class RestartNeeded(FarmctlError):
    exit_code = Exit.RESTART_NEEDED


class TimedOut(FarmctlError):
    exit_code = Exit.TIMED_OUT


class Unconfirmed(FarmctlError):
    exit_code = Exit.UNCONFIRMED


class Halted(FarmctlError):
    exit_code = Exit.HALTED


class HostDrained(FarmctlError):
    exit_code = Exit.DRAINED


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


def _version() -> str:
    """farmctl's version, looked up only by the commands that print it (importlib.metadata
    costs ~30 ms, a third of a `farmctl status`)."""
    from sglang_farm import __version__

    return __version__


def start_hint(config: str | None, *, default_socket: bool = False) -> str:
    """How to start the agent that `--config` names: the systemd service runs only the
    packaged /etc/sglang-farm/farm.toml; any other file is a farm run by hand (the demo's
    own script for the shipped demo)."""
    if config is None and default_socket:
        # Issue 31: a farm run by hand (a checkout's demo) is not at the default socket.
        return (
            "is sglang-farm running? (systemctl status sglang-farm); a farm run by hand "
            "is reached through its config: farmctl --config FILE (the demo's: "
            "farmctl --config etc/sglang-farm/demo.toml status)"
        )
    if config is None or os.path.abspath(config) == DEFAULT_CONFIG_PATH:
        return "is sglang-farm running? (systemctl status sglang-farm)"
    import shlex  # only when --config is given

    run = f"sglang-farm run --config {shlex.quote(config)} --runtime process"
    if os.path.basename(config) == "demo.toml":
        return f"is the demo running? start it with ./scripts/demo (or {run})"
    return f"is its farm running? start it with: {run}"


def _unreachable(exc: AgentUnreachable, config: str | None, socket: str) -> FarmctlError:
    return Unreachable(f"{exc}; {start_hint(config, default_socket=socket == DEFAULT_SOCKET)}")


def _denied(exc: SocketPermissionDenied) -> FarmctlError:
    return Failed(
        f"permission denied on {exc.path}: only root and members of the farm's group "
        "(default sglang-farm) may use farmctl; use sudo or ask for 'usermod -aG sglang-farm'"
    )


def _agent_error(cmd: str, exc: AgentError, as_json: bool) -> FarmctlError:
    if as_json:
        click.echo(json.dumps({"ok": False, "error": {"code": exc.code, "message": exc.message}}))
    cls = BadUsage if exc.code in ("unknown_worker", "bad_request") else Failed
    if exc.code == "unknown_command":
        return cls(
            f"the agent does not know {cmd}: it is older than this farmctl ({_version()}); "
            "upgrade sglang-farm and restart it (systemctl restart sglang-farm)"
        )
    what = {
        "forbidden": f"{cmd} refused",
        "busy": f"{cmd} refused (busy)",
        wire.FAILED: f"{cmd} failed",
        "unknown_worker": f"{cmd}",
    }.get(exc.code, f"{cmd} failed ({exc.code})")
    return cls(f"{what}: {exc.message}")


F = TypeVar("F", bound=Callable[..., Any])


class Ctl:
    """What the root command hands to its subcommands (`ctx.obj`).

    A plain class: `dataclasses` costs farmctl ~10 ms at import (issue 17).
    """

    __slots__ = ("as_json", "client", "config", "socket")

    def __init__(self, socket: str, as_json: bool, config: str | None = None) -> None:
        self.socket = socket
        self.as_json = as_json
        self.config = config
        self.client = Client(socket)

    def call(
        self, cmd: str, args: Mapping[str, object] | None = None, *, timeout: float | None = None
    ) -> Any:
        with self._errors(cmd):
            return self.client.call(cmd, args, timeout=timeout)

    def query(
        self, cmd: str, args: Mapping[str, object] | None = None, *, timeout: float | None = None
    ) -> Any:
        """`call`, and with --json print the raw result and return None (nothing to format)."""
        res = self.call(cmd, args, timeout=timeout)
        if self.as_json:
            self.emit_json(res)
            return None
        return res

    def stream(
        self, cmd: str, args: Mapping[str, object] | None = None, *, timeout: float | None = None
    ) -> Iterator[Reply]:
        with self._errors(cmd):
            yield from self.client.stream(cmd, args, timeout=timeout)

    @contextlib.contextmanager
    def _errors(self, cmd: str) -> Iterator[None]:
        """The client's errors as farmctl's messages and exit codes."""
        try:
            yield
        except AgentUnreachable as exc:
            raise _unreachable(exc, self.config, self.socket) from None
        except SocketPermissionDenied as exc:
            raise _denied(exc) from None
        except UntrustedSocket as exc:  # its message says what and what to do
            raise Failed(str(exc)) from None
        except AgentError as exc:
            raise _agent_error(cmd, exc, self.as_json) from None

    def emit_json(self, obj: object) -> None:
        click.echo(json.dumps(obj, indent=None if isinstance(obj, dict) and "stream" in obj else 2))


_pass_ctl = click.make_pass_decorator(Ctl)


def _json_after_subcommand(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    # The subcommand's options are parsed after the group's callback made the Ctl.
    ctl = ctx.find_object(Ctl)
    if value and ctl is not None:
        ctl.as_json = True


def pass_ctl(f: Callable[..., Any]) -> Callable[..., Any]:
    """`make_pass_decorator(Ctl)`, plus the subcommand's own `--json`.

    `farmctl status --json` and `farmctl --json status` are the same: the group's
    option is kept for scripts that have it, the subcommand's is how people type it.
    """
    option = click.option(
        "--json",
        is_flag=True,
        expose_value=False,
        callback=_json_after_subcommand,
        help="Print the agent's raw results as JSON (same as farmctl --json).",
    )
    return option(_pass_ctl(f))


def _target(ctx: click.Context, param: click.Parameter, value: str) -> int | str:
    """A worker id or `all` (a callback: works with click's 8.1 and later ParamType alike)."""
    if value == "all":
        return value
    try:
        n = int(value)
    except ValueError:
        raise click.BadParameter(f"expected a worker id or 'all', got {value!r}") from None
    if n < 0:
        raise click.BadParameter(f"expected a worker id (>= 0), got {n}")
    return n


WORKER = click.IntRange(min=0)


def _socket_from_config(path: str) -> str:
    import shlex  # only when --config is given
    import tomllib

    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise BadUsage(f"cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise BadUsage(
            f"{path} is not valid TOML ({exc}); "
            f"check it with: sglang-farm check-config --config {shlex.quote(path)}"
        ) from None
    control = data.get("control", {})
    sock = control.get("socket") if isinstance(control, dict) else None
    return sock if isinstance(sock, str) and sock else DEFAULT_SOCKET


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--socket",
    "socket_path",
    envvar="FARMCTL_SOCKET",
    metavar="PATH",
    help=f"Control socket (default: [control].socket of --config, else {DEFAULT_SOCKET}).",
)
@click.option(
    "--config",
    "config_path",
    metavar="FILE",
    help="Read the socket path from this farm.toml's [control].socket.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the agent's raw results as JSON.")
@click.pass_context
def cli(
    ctx: click.Context, socket_path: str | None, config_path: str | None, as_json: bool
) -> None:
    """Operate a running sglang-farm: status, restarts, logs, failures.

    Exit codes: 0 ok, 1 refused or failed, 2 usage, 3 worker not running or
    failed, 4 agent unreachable, 5 reload rolled back, 6 reload held, 7 timed
    out (wait, drain-host), 8 rollout halted (wait), 9 host drained (wait), 10
    reload needs an agent restart, 11 a gateway did not confirm the host out
    (drain-host).
    """
    if socket_path is None:
        socket_path = _socket_from_config(config_path) if config_path else DEFAULT_SOCKET
    ctx.obj = Ctl(socket_path, as_json, config_path)


# --- status ------------------------------------------------------------------------


def _duration(seconds: float) -> str:
    s = max(int(seconds), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


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


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(wd) for c, wd in zip(r, widths, strict=True)).rstrip() for r in rows
    )


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


# A canary analysis's states (canary.view.CanaryState) in words.
_CANARY_WORDS = {
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
    word = _CANARY_WORDS.get(state, state)
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
        f", window {_secs(float(cv.get('window_s') or 0))} from {_duration(now - float(started))}"
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
        out += ["  " + ln for ln in _table(rows).splitlines()]
    return out


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
        head += f" · host DRAINED (out of the gateway) for {_duration(now - float(held))}"
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
            _duration(now - float(w["since"])) if w.get("since") else "-",
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
        _table(rows),
    ]
    if notes:
        out += ["", *notes]
    return "\n".join(out)


@cli.command()
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


# --- state changes -------------------------------------------------------------------


def _since_issue(obj: Mapping[str, object], issued_at: float, fallback_key: str) -> float:
    """Seconds from the request's `issued_at` to when `obj` (a phase, a worker) entered
    its state: both are the agent's clock. An agent without `since` gets the wait's own
    elapsed time (`fallback_key`)."""
    since = obj.get("since")
    if isinstance(since, int | float) and issued_at:
        return max(float(since) - issued_at, 0.0)
    value = obj.get(fallback_key)
    return float(value) if isinstance(value, int | float) else 0.0


def _wait_ready(
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
        f"{_who(held)} {'is' if len(held) == 1 else 'are'} quarantined and not running "
        "(said above); the others are ready"
    )


def _timeout_option(text: str) -> Callable[[F], F]:
    """--timeout for the commands that wait until workers are ready."""
    return click.option(
        "--timeout",
        type=click.FloatRange(min=0, min_open=True, max=3600),
        default=1200.0,
        show_default=True,
        help=text,
    )


def _who(ids: Sequence[int]) -> str:
    return f"worker{'s' if len(ids) != 1 else ''} {', '.join(str(i) for i in ids) or '(none)'}"


_no_drain_option = click.option(
    "--no-drain",
    is_flag=True,
    help="Skip the gateway drain: the worker is stopped while requests may still be running.",
)


def _drain_note(no_drain: bool) -> str:
    return " (no drain)" if no_drain else ""


@cli.command()
@click.argument("target", metavar="N|all", callback=_target)
@click.option("--no-wait", is_flag=True, help="Return once the restart is issued.")
@_timeout_option("Seconds to wait for ready (for 'all': for every worker together).")
@_no_drain_option
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
        click.echo(f"restart issued for {_who(ids)}{_drain_note(no_drain)}")
    if not no_wait:
        _wait_ready(ctl, ids, issued_at, timeout)
        if held:
            _quarantined_left(held)


@cli.command()
@click.argument("target", metavar="N|all", callback=_target)
@click.option("--wait", is_flag=True, help="Wait until the worker(s) are ready.")
@_timeout_option("Seconds to wait for ready with --wait.")
@pass_ctl
def start(ctl: Ctl, target: int | str, wait: bool, timeout: float) -> None:
    """Start worker TARGET (an id, or 'all'); returns once the start is recorded."""
    ids, issued_at, held = _change(ctl, "start", target)
    if not ctl.as_json:
        click.echo(f"start requested for {_who(ids)}")
    if wait:
        _wait_ready(ctl, ids, issued_at, timeout)
        if held:
            _quarantined_left(held)


@cli.command()
@click.argument("target", metavar="N|all", callback=_target)
@_no_drain_option
@pass_ctl
def stop(ctl: Ctl, target: int | str, no_drain: bool) -> None:
    """Stop worker TARGET (an id, or 'all'); returns once it has exited.

    With a gateway, each worker is drained first: taken out of the gateway, then
    stopped once its requests are done (at most [gateway] drain_timeout).
    """
    ids, _, _ = _change(ctl, "stop", target, drain=not no_drain)
    if not ctl.as_json:
        click.echo(f"stopped {_who(ids)}{_drain_note(no_drain)}")


@cli.command("reset-oom")
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
    word = f"{_CANARY_WORDS.get(str(state), state)}: "
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
                f"{_who(rest)} follow{'s' if one else ''} in waves if its analysis passes "
                f"(otherwise {'it keeps' if one else 'they keep'} the old config)"
            )
    elif restarted:
        parts.append(f"restarting {_who(restarted)}")
    for key in ("added", "removed"):
        if res.get(key):
            parts.append(f"{key} {_who([int(i) for i in res[key]])}")
    return "; ".join(parts) if parts else "no worker changed"


@cli.command()
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
    _wait_ready(ctl, ids, issued_at, max(deadline - time.monotonic(), 0.001), quiet=ctl.as_json)
    if not ctl.as_json:
        what = f"change {cv.get('change')} promoted on canary {cv.get('canary')}" if cv else ""
        click.echo(f"rollout done{': ' + what + ', every wave ready' if what else ''}")


@cli.command("release-gpu")
@click.argument("gpu", metavar="[GPU]", type=click.IntRange(min=0), required=False)
@click.option(
    "--worker",
    type=WORKER,
    metavar="N",
    help="Release worker N instead, whichever GPU its quarantine names (a reload moved "
    "it): the GPUs it uses now are the ones re-checked.",
)
@pass_ctl
def release_gpu(ctl: Ctl, gpu: int | None, worker: int | None) -> None:
    """Take a quarantined GPU back into service and start its worker again.

    The agent first re-checks the GPU through NVML: healthy, no row remaps pending,
    memory free, no compute process left. Reset the GPU before this (nvidia-smi -r -i
    GPU, or reboot: farmctl why N says which). Exits 1, printing each problem, when a
    check fails: the quarantine then stays. With --worker N instead of GPU: worker N's
    quarantine, whichever GPU it names.
    """
    if (gpu is None) == (worker is None):
        raise BadUsage(
            "name the GPU (farmctl release-gpu G) or the worker (farmctl release-gpu "
            "--worker N), one of the two; farmctl status shows which is quarantined"
        )
    args = {"gpu": gpu} if worker is None else {"worker": worker}
    res = ctl.call("release-gpu", args, timeout=CHANGE_TIMEOUT)
    if ctl.as_json:
        ctl.emit_json(res)
    held = [int(i) for i in res.get("workers", [])]
    what, again = (
        (f"GPU {gpu}", f"farmctl release-gpu {gpu}")
        if worker is None
        else (f"worker {worker}", f"farmctl release-gpu --worker {worker}")
    )
    if not res.get("released"):
        problems = [str(p) for p in res.get("problems", [])]
        if not ctl.as_json:
            for p in problems:
                click.echo(f"  {p}", err=True)
        stays = f"; {_who(held)} stay{'s' if len(held) == 1 else ''} stopped" if held else ""
        raise Failed(
            f"{what} not released: the quarantine stays{stays}; fix what is listed and "
            f"run {again} again"
        )
    if ctl.as_json:
        return
    if not held:
        click.echo(f"{what} released")
        return
    checked = ", ".join(str(int(g)) for g in res.get("checked", []))
    gpus = f" (GPU {checked} checked)" if worker is not None and checked else ""
    click.echo(
        f"{what} released{gpus}: {_who(held)} starting again "
        f"(farmctl status shows the progress; farmctl logs {held[0]} -f the output)"
    )


# --- the host, for an orchestrator (issue 26) ------------------------------------------

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
        return f"{_who(ids)} {'is' if one else 'are'} ready, not yet in the gateway"
    return (
        f"{_who(ids)} {'is' if one else 'are'} ready; the gateway at {', '.join(gateways)} "
        f"does not route {'it' if one else 'them'}"
    )


@cli.command()
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


@cli.command("drain-host")
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
            f"gateway {u} ({_who([int(w) for w in ws])})" for u, ws in unconfirmed.items()
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
            f"host drained: {_who([int(w) for w in res.get('workers', [])])} out of the "
            f"gateway, no request in flight (waited {waited:.1f}s); they keep running until "
            "farmctl undrain-host"
        )


@cli.command("undrain-host")
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
        f"host back in the gateway: {_who([int(w) for w in res.get('workers', [])])} "
        "join as each is ready (farmctl wait blocks until they have)"
    )


# --- read-only ---------------------------------------------------------------------------


@cli.command()
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


# `why`'s words for a last failure that is the worker's past (`failure_past`).
_FAILURE_PAST = {
    "served": "worker {worker} has served since",
    "reset": "the operator has reset worker {worker} since",
}


@cli.command()
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
    for_how_long = f" for {_duration(time.time() - float(since))}" if timed else ""
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
        when.append(f"{_duration(time.time() - float(r['last_failure_at']))} ago")
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


@cli.command()
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


@cli.command()
@pass_ctl
def version(ctl: Ctl) -> None:
    """Print farmctl's version, and the agent's with its protocol version."""
    try:
        r = ctl.call("version")
    except FarmctlError:
        click.echo(f"farmctl {_version()}")
        raise
    if ctl.as_json:
        ctl.emit_json({"farmctl_version": _version(), **r})
        return
    click.echo(f"farmctl {_version()}")
    click.echo(f"agent {r.get('agent_version')} (protocol {r.get('protocol_version')})")


@cli.command()
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]), default="bash")
@click.pass_context
def completion(ctx: click.Context, shell: str) -> None:
    """Print the shell completion script for SHELL (bash by default).

    Load it with: eval "$(farmctl completion bash)", or install it as
    /usr/share/bash-completion/completions/farmctl.
    """
    from click.shell_completion import get_completion_class

    cls = get_completion_class(shell)
    assert cls is not None  # the Choice above only names shells click knows
    root = ctx.find_root().command
    click.echo(cls(root, {}, "farmctl", "_FARMCTL_COMPLETE").source())


cli.add_command(batch)  # farmctl batch ...: the batch service (cli/batchctl.py, issue 33)


def main() -> NoReturn:
    """The `farmctl` entry point."""
    sys.exit(cli.main(prog_name="farmctl"))


if __name__ == "__main__":
    main()
