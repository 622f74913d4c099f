"""I/O: the chaos soak: N minutes of seeded random faults against a farm under the real systemd.

`python -m bench.soak --minutes N [--seed S]` (10 minutes by default) boots the
throwaway systemd container (`tests/sdcontainer.py`: an overlay of this machine's
root, never the host's systemd), installs a farm in it (`tests/sdfarm.py`): the
shipped units, `sglang-farm run --runtime systemd`, WORKERS simulator workers as
`sglang@N` units, and `[gateway] mode = "managed"` (smg) with the load generator
(`bench/loadgen.py`, run inside the container: its network is private) sending chat
completions through the gateway for the whole run. Then, for N minutes, faults at
random times (the seed fixes their kinds, order, targets and gaps; it is printed):

- `worker_kill`: SIGKILL of the unit's MainPID. Must cause: that worker crash +1.
- `worker_hang`: SIGSTOP of every process in the unit's cgroup. Must cause: hang +1.
- `worker_oom`: the simulator fails only at times fixed at its start
  (docs/simulator.md), so a reload gives that worker `SGLANG_SIM_FAIL_AFTER`; it dies
  of a CUDA OOM once serving; once it is back, a reload takes the variable away.
  Must cause: config +1 (armed), OOM event `cuda` +1 and oom +1 (its relaunch),
  config +1 (disarmed).
- `agent_kill`: SIGKILL of the agent's MainPID; systemd restarts it. Must cause no
  worker restart: every worker keeps its MainPID and is adopted.
- `reload_valid`: `max_running_requests` toggled, `farmctl reload`. Must cause:
  every worker config +1 (a rolling restart, drained out of the gateway first).
- `reload_invalid`: a config with a TOML error, or with values out of range, `farmctl
  reload`. Must be rejected (the old config keeps running; the good file is then
  put back); no restart.
- `socket_garbage`: non-JSON, non-UTF-8, over-long lines, huge numbers, deep nesting
  and half a request on the control socket. No restart; the agent keeps its PID and
  answers.
- `exporter_burst`: BURST idle TCP connections held on the exporter for
  BURST_HOLD_S. No restart.

How the counts stay exact: a worker fault is injected only into a worker that is
ready, has no fault of its own still settling, and while no `agent_kill` or
`reload_valid` is settling (faults on different workers overlap freely);
`agent_kill` and `reload_valid` wait until no fault is settling and every worker is
ready (a restart is counted once, at the relaunch, with the latest
reason, so two overlapping causes on one worker would count as one). The three
harmless faults go in at any time. A fault has settled when its worker's counters
reached the expected values and it is ready again.

Then quiet: no faults; once every fault settled, QUIET_S more seconds of load. The
verdict passes only if: every worker is ready (farmctl) and its unit active; each
worker's `restarts_by_reason` and `oom_events_by_kind` (farmctl status --json) and
`sglang_farm_worker_restarts_total` / `sglang_farm_worker_oom_events_total` (the
exporter) equal the expected counts; the agent unit's NRestarts equals the agent
kills; every simulator process (launcher and scheduler) sits in the cgroup of its
own `sglang@N.service` and none is stopped; the state file parses; every rejected
reload was rejected and every agent kill kept every worker; and no request through
the gateway failed outside the windows of the unplanned kills (worker_kill,
worker_hang, worker_oom: from injection until the worker is ready again, plus
WINDOW_SLACK_S).

Prints the fault table and the verdict; exits 1 on a failed verdict.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sdcontainer import SystemdContainer
    from sdfarm import SdFarm

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"

WORKERS = 4
MODEL = "sim/Qwen3.6-27B"  # sdfarm.farm_toml's model_path: the served model id
EXPORTER = "127.0.0.1:9840"
GATEWAY_LISTEN = "127.0.0.1:8000"
GATEWAY_METRICS = "127.0.0.1:29000"
LOAD_CLIENTS = 4
LOAD_UNIT = "soak-load.service"
LOAD_OUT = "/var/lib/sglang-soak/load.json"
OOM_AFTER_S = 8.0  # SGLANG_SIM_FAIL_AFTER: the disarming reload must land within this
BURST = 300
BURST_HOLD_S = 8.0
GAP_S = (2.0, 9.0)  # between two faults
SETTLE_TIMEOUT_S = 120.0  # a fault not settled by then is a finding
QUIET_S = 15.0
LOOKAHEAD = 4  # planned faults looked at when the next one cannot go in yet
WINDOW_SLACK_S = 3.0
FLAG_VALUES = (64, 48)  # max_running_requests, toggled by reload_valid

FAULTS = (
    "worker_kill",
    "worker_hang",
    "worker_oom",
    "agent_kill",
    "reload_valid",
    "reload_invalid",
    "socket_garbage",
    "exporter_burst",
)
WORKER_FAULTS = frozenset({"worker_kill", "worker_hang", "worker_oom"})
QUIESCENT_FAULTS = frozenset({"agent_kill", "reload_valid"})

Say = Callable[[str], None]


def _say(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- in-container snippets -------------------------------------------------------------

# argv: SIGNAME MAINPID CONTROL_GROUP ("-": MainPID only). Prints the pids signalled.
_SIGNAL = """\
import json, os, signal, sys
sig, main, cg = getattr(signal, sys.argv[1]), int(sys.argv[2]), sys.argv[3]
pids = [main]
if cg != "-":
    for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified", "/sys/fs/cgroup/systemd"):
        try:
            with open(root + cg + "/cgroup.procs") as f:
                got = [int(x) for x in f.read().split()]
        except OSError:
            continue
        if got:
            pids = got
            break
for p in pids:
    os.kill(p, sig)
print(json.dumps(pids))
"""

# argv: SOCKET. Each payload on its own connection; prints what came back for each.
_GARBAGE = """\
import json, socket, sys
path = sys.argv[1]
payloads = [
    b"\\x00\\xff\\xfe garbage \\x80\\x81\\n",
    b"not json at all\\n",
    b"[1, 2, 3]\\n",
    b'{"cmd": "status", "args": {"n": ' + b"9" * 5000 + b"}}\\n",
    b'{"cmd": "start", "args": {"worker": 1e999}}\\n',
    b'{"cmd": "' + b"x" * 70000 + b'"}\\n',
    b'{"cmd": "stop", "args": {"worker": ' + b"[" * 5000 + b"]" * 5000 + b"}}\\n",
    b'{"cmd": "status"',  # half a request, then a half-close
    b"\\n\\n\\n",
]
out = []
for p in payloads:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    try:
        s.connect(path)
        s.sendall(p)
        s.shutdown(socket.SHUT_WR)
        got = b""
        while len(got) < 4096:
            b = s.recv(4096)
            if not b:
                break
            got += b
        out.append(got[:160].decode("utf-8", "replace"))
    except OSError as exc:
        out.append(f"{type(exc).__name__}: {exc}")
    finally:
        s.close()
print(json.dumps(out))
"""

# argv: HOST PORT N HOLD_S. Opens N idle connections, holds them, closes them.
_BURST = """\
import socket, sys, time
host, port, n, hold = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
socks, refused = [], 0
for _ in range(n):
    s = socket.socket()
    s.settimeout(2)
    try:
        s.connect((host, port))
        socks.append(s)
    except OSError:
        refused += 1
        s.close()
print(f"held {len(socks)} idle connections ({refused} not accepted)", flush=True)
time.sleep(hold)
for s in socks:
    s.close()
"""

# Every simulator process (launcher: cmdline; scheduler: comm or cmdline), with its cgroup.
_PROCS = """\
import json, os
out = []
for p in os.listdir("/proc"):
    if not p.isdigit() or int(p) == os.getpid():  # this script's own text names the module
        continue
    try:
        with open(f"/proc/{p}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\\0", b" ").decode("utf-8", "replace").strip()
        with open(f"/proc/{p}/comm") as f:
            comm = f.read().strip()
        with open(f"/proc/{p}/cgroup") as f:
            cg = f.read().strip().splitlines()[-1].split(":", 2)[2]
        with open(f"/proc/{p}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        continue
    if "sglang_farm.sim" in cmd or comm.startswith("sglang::") or cmd.startswith("sglang::"):
        out.append({"pid": int(p), "cmd": cmd[:300], "comm": comm, "cgroup": cg, "state": state})
print(json.dumps(out))
"""


# -- the record -------------------------------------------------------------------------


@dataclass(slots=True)
class Fault:
    """One injected fault: when (s after the faults began), what, where, and what came of it."""

    n: int
    t: float
    kind: str
    target: str  # "worker N", "agent", "farm", "socket", "exporter"
    detail: str = ""
    settled_after: float | None = None  # s from injection until it settled
    ok: bool = True
    note: str = ""


@dataclass(slots=True)
class Pending:
    """A worker fault still settling; `stage` 1 of worker_oom waits for the OOM's relaunch."""

    fault: Fault
    wall0: float  # time.time() at injection (for the load's windows)
    mono0: float
    stage: int = 0
    last_failure0: Any = None  # the worker's last_failure at injection


@dataclass(slots=True)
class Expected:
    restarts: dict[int, Counter[str]]
    oom: dict[int, Counter[str]]
    agent_kills: int = 0


@dataclass(frozen=True, slots=True)
class Verdict:
    ok: bool
    checks: tuple[tuple[str, bool, str], ...]  # (what, passed, evidence)


@dataclass(slots=True)
class SoakResult:
    seed: int
    minutes: float
    faults: list[Fault] = field(default_factory=list)
    windows: list[tuple[float, float, str]] = field(default_factory=list)  # unplanned, wall
    load: dict[str, Any] = field(default_factory=dict)
    verdict: Verdict | None = None
    duration_s: float = 0.0


# -- the farm's config ------------------------------------------------------------------


def soak_toml(flag: int, armed: frozenset[int], *, gateway: bool) -> str:
    """sdfarm's farm.toml with the soak's knobs; `armed` workers OOM OOM_AFTER_S after start."""
    from sdfarm import farm_toml, gateway_toml

    toml = farm_toml(
        workers=WORKERS,
        canary=0,
        parallel=2,
        load_seconds=1.5,
        period=1.0,
        timeout=3.0,
        threshold=3,
        backoff_initial=0.5,
        backoff_max=2.0,
        # The soak counts restarts; the crash-loop limit is not what it tests.
        max_failures=100_000,
        worker_env={w: {"SGLANG_SIM_FAIL_AFTER": f"{OOM_AFTER_S:g}"} for w in sorted(armed)},
        metrics={"listen": EXPORTER},
        sglang={"max_running_requests": flag},
    )
    if gateway:
        toml += gateway_toml(listen=GATEWAY_LISTEN, metrics_listen=GATEWAY_METRICS)
    return toml


def broken_toml(good: str, variant: int) -> str:
    """A config `farmctl reload` must refuse: a TOML syntax error, or values out of range."""
    if variant == 0:
        return good + '\n[restart]\nbackoff_intial = "1s"\n'  # a duplicate table, a typo
    return good.replace("failure_threshold = 3", 'failure_threshold = "three"').replace(
        "base_port = 30000", "base_port = 99999"
    )


# -- the soak ---------------------------------------------------------------------------


class Soak:
    def __init__(
        self, c: SystemdContainer, farm: SdFarm, rng: random.Random, say: Say, gateway: bool
    ) -> None:
        self.c = c
        self.farm = farm
        self.rng = rng
        self.say = say
        self.gateway = gateway
        self.ids = list(range(WORKERS))
        self.flag_i = 0
        self.armed: frozenset[int] = frozenset()
        self.exp = Expected({w: Counter() for w in self.ids}, {w: Counter() for w in self.ids})
        self.pending: dict[int, Pending] = {}
        self.farm_pending: Pending | None = None  # reload_valid / agent_kill until settled
        self.faults: list[Fault] = []
        self.windows: list[tuple[float, float, str]] = []
        self.findings: list[str] = []
        self.t0 = time.monotonic()
        self.t0_wall = time.time()
        self.bursts = 0
        self.last_status: dict[int, dict[str, Any]] = {}

    # -- helpers ------------------------------------------------------------------------

    def toml(self) -> str:
        return soak_toml(FLAG_VALUES[self.flag_i], self.armed, gateway=self.gateway)

    def status(self) -> dict[int, dict[str, Any]] | None:
        from sdfarm import CONFIG, FARMCTL

        r = self.c.run([FARMCTL, "--config", CONFIG, "--json", "status"], check=False, timeout=30)
        if r.returncode != 0:
            return None
        try:
            st = json.loads(r.stdout)
        except ValueError:
            return None
        out = {int(w["id"]): w for w in st.get("workers", [])}
        self.last_status = out
        return out

    def reload(self) -> tuple[int, dict[str, Any] | str]:
        from sdfarm import CONFIG, FARMCTL

        r = self.c.run(
            [FARMCTL, "--config", CONFIG, "--json", "reload", "--no-wait"], check=False, timeout=120
        )
        try:
            return r.returncode, json.loads(r.stdout)
        except ValueError:
            return r.returncode, (r.stdout + r.stderr).strip()[-400:]

    def reload_until_applied(self, want_restarted: list[int], why: str) -> str:
        """Write the current config and reload; retry while the agent answers busy/absent."""
        self.c.write_file("/etc/sglang-farm/farm.toml", self.toml())
        last: object = None
        for _ in range(60):
            rc, res = self.reload()
            if isinstance(res, dict) and res.get("applied"):
                got = sorted(res.get("restarted", []))
                if got != sorted(want_restarted):
                    self.findings.append(
                        f"{why}: reload restarted {got}, expected {sorted(want_restarted)}: {res}"
                    )
                return f"restarted {got}"
            last = (rc, res)
            time.sleep(1.0)
        raise RuntimeError(f"{why}: reload never applied: {last!r}")

    def worker_pids(self) -> dict[int, int]:
        return self.farm.main_pids(self.ids)

    def ready(self, st: dict[int, dict[str, Any]], w: int) -> bool:
        return st.get(w, {}).get("state") == "ready"

    def matches(self, st: dict[int, dict[str, Any]], w: int) -> bool:
        s = st.get(w, {})
        got_r = {k: v for k, v in (s.get("restarts_by_reason") or {}).items() if v}
        got_o = {k: v for k, v in (s.get("oom_events_by_kind") or {}).items() if v}
        want_r = {k: v for k, v in self.exp.restarts[w].items() if v}
        want_o = {k: v for k, v in self.exp.oom[w].items() if v}
        return got_r == want_r and got_o == want_o

    def free_workers(self) -> list[int]:
        if self.farm_pending is not None:  # a rolling restart or an adoption is settling
            return []
        st = self.last_status
        return [w for w in self.ids if w not in self.pending and self.ready(st, w)]

    def quiescent(self) -> bool:
        st = self.last_status
        return (
            not self.pending
            and self.farm_pending is None
            and all(self.ready(st, w) and self.matches(st, w) for w in self.ids)
        )

    def new_fault(self, kind: str, target: str) -> Fault:
        f = Fault(len(self.faults) + 1, time.monotonic() - self.t0, kind, target)
        self.faults.append(f)
        return f

    # -- settling -------------------------------------------------------------------------

    def poll(self) -> None:
        """Read status; move settled faults out of `pending`; flag faults that never settle."""
        st = self.status()
        if st is None:
            return
        now = time.monotonic()
        for w, p in list(self.pending.items()):
            if p.stage == 3:
                # Disarmed after a finding: once ready, take its counters as they are, so
                # that later faults are judged on their own (the finding stays recorded).
                if self.ready(st, w) and now - p.mono0 < SETTLE_TIMEOUT_S * 2:
                    s = st[w]
                    self.exp.restarts[w] = Counter(s.get("restarts_by_reason") or {})
                    self.exp.oom[w] = Counter(s.get("oom_events_by_kind") or {})
                    del self.pending[w]
                continue
            if p.fault.kind == "worker_oom" and p.stage == 1 and self._misread_oom(st, w, p):
                continue
            if now - p.mono0 > SETTLE_TIMEOUT_S:
                p.fault.ok = False
                p.fault.note = f"not settled in {SETTLE_TIMEOUT_S:g} s: {_brief(st.get(w))}"
                self.findings.append(
                    f"fault #{p.fault.n} {p.fault.kind} on worker {w}: {p.fault.note}"
                )
                self.windows.append((p.wall0, time.time() + WINDOW_SLACK_S, p.fault.kind))
                del self.pending[w]
                continue
            if not (self.ready(st, w) and self.matches(st, w)):
                continue
            if p.fault.kind == "worker_oom" and p.stage == 1:
                # The OOM happened and the worker is back: disarm before it fails again.
                self.windows.append((p.wall0, time.time() + WINDOW_SLACK_S, "worker_oom"))
                self.armed = self.armed - {w}
                self.exp.restarts[w]["config"] += 1
                p.fault.detail += "; disarm: " + self.reload_until_applied([w], "oom disarm")
                p.stage = 2
                continue
            p.fault.settled_after = now - p.mono0
            if p.fault.kind in ("worker_kill", "worker_hang"):
                self.windows.append((p.wall0, time.time() + WINDOW_SLACK_S, p.fault.kind))
            del self.pending[w]
        fp = self.farm_pending
        if fp is not None:
            if all(self.ready(st, w) and self.matches(st, w) for w in self.ids):
                fp.fault.settled_after = now - fp.mono0
                self.farm_pending = None
            elif now - fp.mono0 > SETTLE_TIMEOUT_S:
                fp.fault.ok = False
                fp.fault.note = f"farm not settled in {SETTLE_TIMEOUT_S:g} s"
                self.findings.append(
                    f"fault #{fp.fault.n} {fp.fault.kind}: {fp.fault.note}: "
                    + "; ".join(f"{w}: {_brief(st.get(w))}" for w in self.ids)
                )
                self.farm_pending = None

    def _misread_oom(self, st: dict[int, dict[str, Any]], w: int, p: Pending) -> bool:
        """An armed worker that failed as something else than an OOM: a finding; disarm it."""
        s = st.get(w, {})
        crashes = (s.get("restarts_by_reason") or {}).get("crash", 0)
        lf = s.get("last_failure") or {}
        if crashes <= self.exp.restarts[w]["crash"] and (lf == p.last_failure0 or now_oom_ok(lf)):
            return False
        p.fault.ok = False
        p.fault.note = (
            f"the CUDA OOM was not classified as one: last_failure {lf.get('kind')!r} "
            f"({lf.get('summary')!r}), restarts {s.get('restarts_by_reason')}"
        )
        self.findings.append(f"fault #{p.fault.n} worker_oom on worker {w}: {p.fault.note}")
        self.windows.append((p.wall0, time.time() + 60 + WINDOW_SLACK_S, "worker_oom"))
        self.armed = self.armed - {w}
        self.reload_until_applied([w], "oom disarm after a finding")
        p.stage = 3
        p.mono0 = time.monotonic()
        return True

    # -- faults ---------------------------------------------------------------------------

    def feasible(self, kind: str) -> bool:
        if kind in WORKER_FAULTS:
            return bool(self.free_workers())
        if kind in QUIESCENT_FAULTS:
            return self.quiescent()
        if kind == "reload_invalid":
            return bool(self.last_status)  # an agent that answers
        return True

    def inject(self, kind: str, prefer: int) -> None:
        getattr(self, f"_{kind}")(prefer)

    def _pick(self, prefer: int) -> int:
        free = self.free_workers()
        return min(free, key=lambda w: (w - prefer) % WORKERS)

    def _signal(self, w: int, sig: str, cgroup: bool) -> list[int]:
        from sdcontainer import VENV_PYTHON

        u = f"sglang@{w}.service"
        show = self.farm.show([u], "MainPID,ControlGroup")[u]
        pid = int(show.get("MainPID", "0") or 0)
        if pid <= 1:
            raise RuntimeError(f"{u} has no main process (MainPID={pid})")
        cg = show.get("ControlGroup", "") if cgroup else ""
        r = self.c.run([VENV_PYTHON, "-c", _SIGNAL, sig, str(pid), cg or "-"])
        pids: list[int] = json.loads(r.stdout)
        return pids

    def _worker_kill(self, prefer: int) -> None:
        w = self._pick(prefer)
        f = self.new_fault("worker_kill", f"worker {w}")
        self.exp.restarts[w]["crash"] += 1
        wall = time.time()
        f.detail = f"SIGKILL MainPID {self._signal(w, 'SIGKILL', cgroup=False)[0]}"
        self.pending[w] = Pending(f, wall, time.monotonic())

    def _worker_hang(self, prefer: int) -> None:
        w = self._pick(prefer)
        f = self.new_fault("worker_hang", f"worker {w}")
        self.exp.restarts[w]["hang"] += 1
        wall = time.time()
        f.detail = f"SIGSTOP pids {self._signal(w, 'SIGSTOP', cgroup=True)}"
        self.pending[w] = Pending(f, wall, time.monotonic())

    def _worker_oom(self, prefer: int) -> None:
        w = self._pick(prefer)
        f = self.new_fault("worker_oom", f"worker {w}")
        wall = time.time()
        self.armed = self.armed | {w}
        self.exp.restarts[w]["config"] += 1
        self.exp.restarts[w]["oom"] += 1
        self.exp.oom[w]["cuda"] += 1
        lf0 = self.last_status.get(w, {}).get("last_failure")
        self.pending[w] = Pending(f, wall, time.monotonic(), stage=1, last_failure0=lf0)
        f.detail = f"SGLANG_SIM_FAIL_AFTER={OOM_AFTER_S:g}: " + self.reload_until_applied(
            [w], "oom arm"
        )

    def _agent_kill(self, _prefer: int) -> None:
        from sdfarm import AGENT

        f = self.new_fault("agent_kill", "agent")
        before = self.worker_pids()
        old = self.farm.agent_pid()
        self.farm.kill(old, "KILL")
        self.exp.agent_kills += 1
        self.farm_pending = Pending(f, time.time(), time.monotonic())

        def back() -> tuple[bool, int]:
            pid = self.farm.agent_pid()
            return pid not in (0, old) and self.farm.is_active(AGENT) == "active", pid

        try:
            new = self.farm.wait("a new agent after SIGKILL", back, timeout=60, interval=0.25)
        except AssertionError:
            # A finding: record systemd's view, start the agent by hand, and go on.
            show = self.farm.show([AGENT], "ActiveState,SubState,Result,NRestarts,MainPID")
            ps = self.c.run(["systemctl", "status", "--no-pager", "-n", "0", AGENT], check=False)
            f.ok = False
            f.note = (
                f"no new agent 60 s after SIGKILL of {old}: {show[AGENT]}; "
                f"systemctl status: {ps.stdout.strip()[-700:]!r}"
            )
            self.findings.append(f"fault #{f.n} agent_kill: {f.note}")
            self.exp.agent_kills -= 1  # NRestarts counts systemd's own restarts only
            self.c.run(["systemctl", "start", AGENT], check=False, timeout=120)
            new = self.farm.agent_pid()
        # Adoption: wait until the new agent answers status, then compare MainPIDs.
        self.farm.wait("the new agent answers", lambda: (self.status() is not None, None), 60, 0.5)
        after = self.worker_pids()
        kept = [w for w in self.ids if after[w] == before[w]]
        f.detail = f"agent {old} -> {new}; workers kept {len(kept)}/{WORKERS}"
        if len(kept) != WORKERS:
            f.ok = False
            f.note = f"workers restarted by an agent SIGKILL: {before} -> {after}"
            self.findings.append(f"fault #{f.n} agent_kill: {f.note}")

    def _reload_valid(self, _prefer: int) -> None:
        f = self.new_fault("reload_valid", "farm")
        self.flag_i = 1 - self.flag_i
        for w in self.ids:
            self.exp.restarts[w]["config"] += 1
        self.farm_pending = Pending(f, time.time(), time.monotonic())
        f.detail = f"max_running_requests={FLAG_VALUES[self.flag_i]}: " + self.reload_until_applied(
            self.ids, "valid reload"
        )

    def _reload_invalid(self, _prefer: int) -> None:
        f = self.new_fault("reload_invalid", "farm")
        good = self.toml()
        variant = self.rng.randrange(2)
        self.c.write_file("/etc/sglang-farm/farm.toml", broken_toml(good, variant))
        try:
            rc, res = self.reload()
        finally:
            self.c.write_file("/etc/sglang-farm/farm.toml", good)
        if isinstance(res, dict) and res.get("applied") is False and rc != 0:
            f.detail = f"variant {variant} rejected: {len(res.get('problems', []))} problem(s)"
        elif rc != 0 and isinstance(res, str) and "not valid TOML" in res:
            # farmctl reads the file for the socket's path: it refuses before the agent.
            f.detail = f"variant {variant} refused by farmctl (not valid TOML), agent untouched"
        elif rc != 0 and "busy" in json.dumps(res):
            f.detail = f"variant {variant}: agent busy, nothing applied (rc {rc})"
        else:
            f.ok = False
            f.note = f"broken config not rejected: rc {rc}, {res!r:.300}"
            self.findings.append(f"fault #{f.n} reload_invalid: {f.note}")

    def _socket_garbage(self, _prefer: int) -> None:
        from sdcontainer import VENV_PYTHON

        f = self.new_fault("socket_garbage", "socket")
        pid = self.farm.agent_pid()
        r = self.c.run(
            [VENV_PYTHON, "-c", _GARBAGE, "/run/sglang-farm/control.sock"], check=False, timeout=60
        )
        try:
            replies: list[str] = json.loads(r.stdout)
        except ValueError:
            replies = [r.stderr.strip()[-200:]]
        alive = self.farm.agent_pid() == pid and self.status() is not None
        errs = sum(1 for x in replies if '"ok":false' in x.replace(" ", "") or "error" in x)
        f.detail = f"{len(replies)} payloads, {errs} error replies; agent kept its PID: {alive}"
        if not alive and self.farm_pending is None:
            f.ok = False
            f.note = f"agent lost or silent after garbage: {replies}"
            self.findings.append(f"fault #{f.n} socket_garbage: {f.note}")

    def _exporter_burst(self, _prefer: int) -> None:
        from sdcontainer import VENV_PYTHON

        f = self.new_fault("exporter_burst", "exporter")
        self.bursts += 1
        host, port = EXPORTER.split(":")
        self.c.run(
            [
                "systemd-run",
                f"--unit=soak-burst-{self.bursts}",
                "--collect",
                "--quiet",
                VENV_PYTHON,
                "-c",
                _BURST,
                host,
                port,
                str(BURST),
                str(BURST_HOLD_S),
            ]
        )
        f.detail = f"{BURST} idle connections for {BURST_HOLD_S:g} s"

    # -- the run --------------------------------------------------------------------------

    def plan(self, count: int) -> list[tuple[str, int, float]]:
        """(kind, preferred worker, gap before it): every kind once, shuffled, then random."""
        first = list(FAULTS)
        self.rng.shuffle(first)
        kinds = first + [self.rng.choice(FAULTS) for _ in range(max(0, count - len(first)))]
        return [(k, self.rng.randrange(WORKERS), self.rng.uniform(*GAP_S)) for k in kinds]

    def run_faults(self, minutes: float) -> None:
        end = self.t0 + minutes * 60
        plan = self.plan(int(minutes * 60 / GAP_S[0]) + len(FAULTS))
        i = 0
        next_at = time.monotonic() + plan[0][2]
        while time.monotonic() < end and i < len(plan):
            self.poll()
            if time.monotonic() >= next_at:
                # The next planned fault that can go in now (one waiting for quiescence or
                # a free worker does not hold up the others behind it; it keeps its place).
                j = next(
                    (
                        k
                        for k in range(i, min(i + LOOKAHEAD, len(plan)))
                        if self.feasible(plan[k][0])
                    ),
                    None,
                )
                if j is not None:
                    kind, prefer, _ = plan.pop(j)
                    plan.insert(i, (kind, prefer, 0.0))
                    self.inject(kind, prefer)
                    f = self.faults[-1]
                    flag = "" if f.ok else f"  << {f.note}"
                    self.say(f"#{f.n} t={f.t:6.1f}s {f.kind:<15} {f.target:<9} {f.detail}{flag}")
                    i += 1
                    if i < len(plan):
                        next_at = time.monotonic() + plan[i][2]
            time.sleep(0.3)

    def settle(self) -> None:
        deadline = time.monotonic() + SETTLE_TIMEOUT_S + 30
        while (self.pending or self.farm_pending is not None) and time.monotonic() < deadline:
            self.poll()
            time.sleep(0.5)


def now_oom_ok(last_failure: dict[str, Any]) -> bool:
    """No failure yet, or one the classifier took for an OOM (the armed worker's fault)."""
    return not last_failure or last_failure.get("oom_kind") is not None


def _brief(w: dict[str, Any] | None) -> str:
    if not w:
        return "no status"
    lf = (w.get("last_failure") or {}).get("kind")
    return (
        f"state={w.get('state')} restarts={w.get('restarts_by_reason')} "
        f"oom={w.get('oom_events_by_kind')} last_failure={lf}"
    )


# -- the verdict ------------------------------------------------------------------------

_SAMPLE = re.compile(r"^(sglang_farm_worker_(?:restarts|oom_events)_total)\{([^}]*)\}\s+(\S+)$")


def metric_counts(text: str) -> dict[str, dict[tuple[int, str], float]]:
    """{metric: {(worker, reason-or-kind): value}} from the exporter's text."""
    out: dict[str, dict[tuple[int, str], float]] = {
        "sglang_farm_worker_restarts_total": {},
        "sglang_farm_worker_oom_events_total": {},
    }
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        key = str(labels.get("reason", labels.get("kind", "")))
        if float(m.group(3)):
            out[m.group(1)][(int(labels.get("worker", "-1")), key)] = float(m.group(3))
    return out


def process_check(procs: Sequence[dict[str, Any]], main_pids: dict[int, int]) -> list[str]:
    """Problems: a simulator process outside sglang@N.service, of another port, or stopped."""
    bad: list[str] = []
    seen_main: set[int] = set()
    for p in procs:
        m = re.search(r"/sglang@(\d+)\.service$", p["cgroup"])
        if m is None or int(m.group(1)) not in main_pids:
            bad.append(f"pid {p['pid']} ({p['comm']}) in {p['cgroup']!r}: not in its unit")
            continue
        n = int(m.group(1))
        port = re.search(r"--port (\d+)", p["cmd"])
        from sdfarm import BASE_PORT

        if port and int(port.group(1)) != BASE_PORT + n:
            bad.append(f"pid {p['pid']} serves port {port.group(1)} from sglang@{n}")
        if p["state"] == "T":
            bad.append(f"pid {p['pid']} in sglang@{n} is stopped (T)")
        if p["pid"] == main_pids[n]:
            seen_main.add(n)
    missing = sorted(set(main_pids) - seen_main)
    if missing:
        bad.append(f"no simulator process is the MainPID of sglang@{missing}: {main_pids}")
    return bad


def verdict(soak: Soak, load: dict[str, Any]) -> Verdict:
    from sdcontainer import VENV_PYTHON
    from sdfarm import AGENT, http_get

    checks: list[tuple[str, bool, str]] = []
    ids = soak.ids

    def ready_probe() -> tuple[bool, dict[int, dict[str, Any]] | None]:
        st = soak.status()
        return st is not None and all(soak.ready(st, w) for w in ids), st

    try:
        st = soak.farm.wait("every worker ready at the end", ready_probe, timeout=60, interval=1)
    except AssertionError:
        st = soak.status()
    st = st or {}
    units = soak.farm.states(ids)
    checks.append(
        (
            "every worker ready and its unit active",
            all(soak.ready(st, w) for w in ids) and all(units[w] == "active" for w in ids),
            "; ".join(f"{w}: {st.get(w, {}).get('state')}/{units[w]}" for w in ids),
        )
    )
    bad = [
        f"worker {w}: got {_brief(st.get(w))}, expected restarts={dict(soak.exp.restarts[w])} "
        f"oom={dict(soak.exp.oom[w])}"
        for w in ids
        if not soak.matches(st, w)
    ]
    checks.append(
        (
            "farmctl restart and OOM counters equal the faults injected",
            not bad,
            "; ".join(bad)
            or "; ".join(f"{w}: {dict(soak.exp.restarts[w])} {dict(soak.exp.oom[w])}" for w in ids),
        )
    )
    status, body = http_get(soak.c, f"http://{EXPORTER}/metrics")
    mc = metric_counts(body if isinstance(body, str) else "")
    want_r = {(w, r): float(v) for w in ids for r, v in soak.exp.restarts[w].items() if v}
    want_o = {(w, k): float(v) for w in ids for k, v in soak.exp.oom[w].items() if v}
    got_r, got_o = (
        mc["sglang_farm_worker_restarts_total"],
        mc["sglang_farm_worker_oom_events_total"],
    )
    checks.append(
        (
            "exporter counters equal the faults injected",
            status == 200 and got_r == want_r and got_o == want_o,
            f"HTTP {status}; restarts_total {sorted(got_r.items())} vs {sorted(want_r.items())}; "
            f"oom_events_total {sorted(got_o.items())} vs {sorted(want_o.items())}",
        )
    )
    nrestarts = soak.farm.show([AGENT], "NRestarts")[AGENT].get("NRestarts", "?")
    checks.append(
        (
            "agent restarted only by its SIGKILLs (NRestarts)",
            nrestarts == str(soak.exp.agent_kills),
            f"NRestarts={nrestarts}, agent kills={soak.exp.agent_kills}",
        )
    )
    procs = json.loads(soak.c.run([VENV_PYTHON, "-c", _PROCS]).stdout)
    problems = process_check(procs, soak.worker_pids())
    checks.append(
        (
            "every simulator process in its own sglang@N.service, none stopped",
            not problems,
            "; ".join(problems) or f"{len(procs)} processes, all in their units",
        )
    )
    raw = soak.c.run(["cat", "/var/lib/sglang-farm/state.json"], check=False)
    try:
        parsed = json.loads(raw.stdout)
        state_ok, why = isinstance(parsed, dict), f"{len(raw.stdout)} bytes of JSON"
    except ValueError as exc:
        state_ok, why = False, f"{exc}: {raw.stdout[:200]!r} {raw.stderr.strip()}"
    checks.append(("the state file parses", state_ok, why))
    checks.append(
        (
            "every fault did what it must (rejections, adoptions, settling)",
            not soak.findings,
            "; ".join(soak.findings) or f"{len(soak.faults)} faults",
        )
    )
    if load:
        outside = list(load.get("unexplained", []))
        if outside:
            # The agent's gateway events near each unexplained failure: the evidence.
            gw = [
                (e["_t"], e["_pid"], e["event"], e.get("worker"))
                for e in soak.farm.agent_events()
                if str(e["event"]).startswith("gateway")
            ]
            kills = [(f.t + soak.t0_wall, f.kind) for f in soak.faults if f.kind == "agent_kill"]
            for t in sorted({round(x) for x in load.get("unexplained_t", [])}):
                near = [g for g in gw if abs(g[0] - t) <= 5.0]
                ak = [round(t - k, 1) for k, _ in kills if -2 <= t - k <= 30]
                outside.insert(
                    0, f"at {t}: s after an agent_kill {ak}; gateway events within 5 s: {near}"
                )
        checks.append(
            (
                "no request through the gateway failed outside the unplanned kills",
                load.get("requests", 0) > 0 and not outside,
                f"{load.get('requests')} requests, {load.get('failed')} failed, "
                f"{len(load.get('unexplained', []))} outside the windows: {outside[:12]}",
            )
        )
    return Verdict(all(ok for _, ok, _ in checks), tuple(checks))


# -- the load, inside the container ------------------------------------------------------


def load_child(url: str, seconds: float, out: str) -> int:
    """`python -m bench.soak --load-child URL`: the load generator until SIGTERM or `seconds`.

    Its outcomes go to `out` as JSON rows (started, ended, stream, ok, reason, detail).
    """
    import signal
    import threading

    from bench.loadgen import Load, LoadSpec

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    spec = LoadSpec(url, MODEL, clients=LOAD_CLIENTS, max_tokens=8, max_s=seconds, timeout_s=30)
    load = Load(spec).start()
    while load.running and not stop.wait(0.5):
        pass
    outcomes = load.stop()
    rows = [[o.started, o.ended, o.stream, o.ok, o.reason, o.detail] for o in outcomes]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    err = repr(load.error) if load.error else None
    Path(out).write_text(json.dumps({"error": err, "rows": rows}))
    return 0


def start_load(c: SystemdContainer, seconds: float) -> None:
    from sdcontainer import VENV_PYTHON

    c.run(["mkdir", "-p", str(Path(LOAD_OUT).parent)])
    c.run(
        [
            "systemd-run",
            f"--unit={LOAD_UNIT}",
            "--collect",
            "--quiet",
            f"--setenv=PYTHONPATH={REPO}",
            f"--working-directory={REPO}",
            VENV_PYTHON,
            "-m",
            "bench.soak",
            "--load-child",
            f"http://{GATEWAY_LISTEN}",
            "--load-seconds",
            f"{seconds:.0f}",
        ]
    )


def stop_load(c: SystemdContainer, windows: Sequence[tuple[float, float, str]]) -> dict[str, Any]:
    """Stop the load (SIGINT ends it early: it is bounded anyway) and judge its outcomes."""
    from bench.loadgen import Outcome, report

    c.run(["systemctl", "kill", "-s", "SIGTERM", LOAD_UNIT], check=False)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if c.run(["systemctl", "is-active", LOAD_UNIT], check=False).stdout.strip() != "active":
            break
        time.sleep(0.5)
    raw = c.run(["cat", LOAD_OUT], check=False)
    try:
        data = json.loads(raw.stdout)
    except ValueError:
        journal = c.journal(LOAD_UNIT, lines=30)
        return {"requests": 0, "failed": 0, "unexplained": [f"no load results: {journal[-600:]}"]}
    outs = [Outcome(r[0], r[1], r[1] - r[0], r[2], r[3], r[4], r[5]) for r in data["rows"]]
    rep = report(outs)
    bad = [
        o
        for o in outs
        if not o.ok and not any(o.started <= b and o.ended >= a for a, b, _ in windows)
    ]
    unexplained = [
        f"{o.reason} at {time.strftime('%H:%M:%S', time.localtime(o.ended))}"
        f" (started {o.started:.3f}, ended {o.ended:.3f}): {o.detail[:80]}"
        for o in bad
    ]
    return {
        "requests": rep["requests"],
        "ok": rep["ok"],
        "failed": rep["failed"],
        "reasons": rep["reasons"],
        "latency_ms": rep["latency_ms"],
        "unexplained": unexplained,
        "unexplained_t": [o.ended for o in bad],
        "error": data.get("error"),
    }


# -- top level ----------------------------------------------------------------------------


def _tests_on_path() -> None:
    if str(TESTS) not in sys.path:
        sys.path.append(str(TESTS))


def run(minutes: float, seed: int, *, gateway: bool = True, say: Say = _say) -> SoakResult:
    """Boot the container, run the farm, inject, judge. Raises when the container cannot boot."""
    _tests_on_path()
    import sdcontainer as sdc
    import sdfarm as sdf

    t_run = time.monotonic()
    res = SoakResult(seed, minutes)
    say(f"seed {seed}; {minutes:g} min of faults on {WORKERS} workers (gateway: {gateway})")
    with sdc.booted() as c:
        farm = sdf.SdFarm(c)
        soak = Soak(c, farm, random.Random(seed), say, gateway)
        if gateway:
            sdf.open_test_venv_to_dynamic_users(c)
        sdf.install_farm(c, soak.toml())
        c.run(["systemctl", "start", sdf.AGENT], timeout=120)
        farm.wait(
            "every worker ready",
            lambda: (
                (st := soak.status()) is not None and all(soak.ready(st, w) for w in soak.ids),
                st,
            ),
            timeout=120,
            interval=0.5,
        )
        if gateway:
            farm.wait(
                "the gateway answers a chat completion",
                lambda: (_chat_ok(c), None),
                timeout=60,
                interval=1.0,
            )
            start_load(c, minutes * 60 + SETTLE_TIMEOUT_S + QUIET_S + 120)
        say("farm ready; faults begin")
        try:
            soak.t0 = time.monotonic()
            soak.t0_wall = time.time()
            soak.run_faults(minutes)
            say(f"faults over ({len(soak.faults)}); settling, then {QUIET_S:g} s quiet")
            soak.settle()
            time.sleep(QUIET_S)
            res.windows = list(soak.windows)
            res.load = stop_load(c, soak.windows) if gateway else {}
            res.faults = soak.faults
            res.verdict = verdict(soak, res.load)
        finally:
            if res.verdict is None or not res.verdict.ok:
                print(c.journal(sdf.AGENT, lines=80), file=sys.stderr)
            with contextlib.suppress(Exception):
                c.run(["systemctl", "stop", sdf.TARGET], check=False, timeout=60)
    res.duration_s = time.monotonic() - t_run
    return res


_CHAT = """\
import json, sys, urllib.request
req = urllib.request.Request(sys.argv[1] + "/v1/chat/completions", method="POST",
    data=json.dumps({"model": sys.argv[2], "max_tokens": 2,
                     "messages": [{"role": "user", "content": "hi"}]}).encode(),
    headers={"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=10) as r:
    print(r.status)
"""


def _chat_ok(c: SystemdContainer) -> bool:
    from sdcontainer import VENV_PYTHON

    r = c.run([VENV_PYTHON, "-c", _CHAT, f"http://{GATEWAY_LISTEN}", MODEL], check=False)
    return r.stdout.strip() == "200"


def table(res: SoakResult) -> str:
    """The fault table and the verdict, as text."""
    lines = [
        f"chaos soak: seed {res.seed}, {res.minutes:g} min of faults, {len(res.faults)} faults, "
        f"{res.duration_s:.0f} s in all",
        f"{'#':>3} {'t (s)':>7}  {'fault':<15} {'target':<9} {'settled':>8}  detail",
    ]
    for f in res.faults:
        settled = "-" if f.settled_after is None else f"{f.settled_after:.1f}s"
        flag = "" if f.ok else "  << " + f.note
        lines.append(
            f"{f.n:>3} {f.t:>7.1f}  {f.kind:<15} {f.target:<9} {settled:>8}  {f.detail}{flag}"
        )
    counts = Counter(f.kind for f in res.faults)
    lines.append("faults by kind: " + ", ".join(f"{k} {counts[k]}" for k in FAULTS))
    if res.load:
        ld = res.load
        lines.append(
            f"load through the gateway: {ld.get('requests')} requests, {ld.get('failed')} failed "
            f"{ld.get('reasons')}, {len(res.windows)} unplanned windows"
        )
    if res.verdict is not None:
        for what, ok, why in res.verdict.checks:
            lines.append(f"[{'PASS' if ok else 'FAIL'}] {what}: {why}")
        lines.append(f"VERDICT: {'PASS' if res.verdict.ok else 'FAIL'} (seed {res.seed})")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--no-gateway", action="store_true", help="no smg and no load")
    ap.add_argument("--load-child", metavar="URL", help=argparse.SUPPRESS)
    ap.add_argument("--load-seconds", type=float, default=600.0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.load_child:
        return load_child(a.load_child, a.load_seconds, LOAD_OUT)
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(2**31)
    print(
        f"seed {seed} (rerun: python -m bench.soak --minutes {a.minutes:g} --seed {seed})",
        flush=True,
    )
    res = run(a.minutes, seed, gateway=not a.no_gateway)
    print(table(res), flush=True)
    return 0 if res.verdict is not None and res.verdict.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
